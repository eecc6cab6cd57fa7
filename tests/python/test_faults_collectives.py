"""Issue 10, section 4: a frozen or diverged rank ends the job with an error naming the cause; NumPy views of gathered
parameters do not break leaving ``gathered_parameters()``.

Every run is 2 gloo ranks with a 10 s process-group timeout, under run_ranks' hard deadline: a regression fails, it
does not hang.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from launch import run_ranks

WORKER = Path(__file__).parent / "scripts" / "faults_collectives.py"


def _failed_run(mode: str, stage: int, out: Path) -> str:
    with pytest.raises(AssertionError) as info:
        run_ranks(WORKER, [mode, str(stage), str(out)], timeout=150)
    report = str(info.value)
    assert "killed after" not in report, report[-4000:]  # ended by the error, not by the deadline
    return report


def _rank_output(report: str, rank: int) -> str:
    parts = re.split(r"===== rank (\d+) \(exit (-?\d+)\) =====", report)
    for i in range(1, len(parts), 3):
        if int(parts[i]) == rank:
            return parts[i + 2]
    raise AssertionError(f"no output of rank {rank} in: {report[-2000:]}")


@pytest.mark.parametrize(
    "stage, collective, what",
    [
        (1, "gradient reduce-scatter", "gradient bucket 0 ('norm.bias'"),
        (2, "gradient reduce-scatter", "gradient bucket 0 ('norm.bias'"),
        (3, "parameter all-gather", "unit '<root>' (forward)"),
    ],
)
def test_a_frozen_rank_ends_the_job_naming_collective_unit_step_and_rank(tmp_path, stage, collective, what):
    # rank 1 SIGSTOPs itself at the start of step 2; rank 0 waits in its first collective of that step
    report = _failed_run("stop", stage, tmp_path)
    rank0 = _rank_output(report, 0)
    assert "zeroshard.sharding.collective_errors.CollectiveError" in rank0, rank0[-3000:]
    line = next(ln for ln in rank0.splitlines() if "zeroshard: the " in ln)
    assert f"the {collective} of {what}" in line, line
    assert "failed on rank 0 (of 2) at step 2: it timed out" in line, line
    assert "ZeroStrategy(timeout=" in line, line
    # the backend's error is kept (gloo words it as "Timed out waiting 10000ms ..." or "Application timeout ...")
    backend = line.split("Backend error: ", 1)[1].lower()
    assert "timed out" in backend or "timeout" in backend, line


@pytest.mark.parametrize(
    "mode, stage, collective, what",
    [
        ("read_one", 3, "parameter all-gather", "a read outside forward (a callback or user code) of 'blocks.0.up"),
        ("grad_one", 2, "gradient all-gather", "reading the .grad of 'blocks.0.up.weight'"),
    ],
)
def test_a_read_on_one_rank_ends_with_an_error_naming_the_read(tmp_path, mode, stage, collective, what):
    # a read of a sharded parameter or gradient is a collective: made on rank 0 alone, it times out naming itself
    rank0 = _rank_output(_failed_run(mode, stage, tmp_path), 0)
    line = next(ln for ln in rank0.splitlines() if "zeroshard: the " in ln)
    assert f"the {collective} of" in line and what in line, line
    assert "failed on rank 0 (of 2)" in line and "timed out" in line, line


# Not "skip" (rank 1 skips the second, last block): every rank still makes the same all-gathers (the prefetch from
# blocks.0 gathers blocks.1 on rank 1 too, and backward does not gather the last block again: it stays gathered from
# its forward), so nothing is mixed and the step reduces blocks.1's gradients as unused on rank 1, as DDP's
# find_unused_parameters would; the job completes.
@pytest.mark.parametrize("mode", ["swap", "skip_first"])
def test_diverged_ranks_end_with_an_error_naming_both_units_without_the_debug_check(tmp_path, mode):
    # at step 3 rank 1 runs the same-size blocks in the other order (swap) or skips the first one (skip_first):
    # check_gather_order is off; the tag each unit all-gather carries catches it before the buffer is used
    report = _failed_run(mode, 3, tmp_path)
    for rank in (0, 1):
        out = _rank_output(report, rank)
        line = next((ln for ln in out.splitlines() if "DivergedRanksError: zeroshard: ranks diverged" in ln), None)
        assert line is not None, out[-3000:]
        assert "step 3" in line and f"this is rank {rank}" in line, line
        assert "rank 0 -> 'blocks." in line and "rank 1 -> 'blocks." in line, line
        assert "'blocks.0'" in line and "'blocks.1'" in line, line  # both units named
    assert "terminate called" not in report  # no backend abort on a mismatched collective


def test_ranks_waiting_in_different_collectives_each_name_theirs(tmp_path):
    # at step 3 rank 1 skips both blocks: rank 0 waits in the all-gather of blocks.0, rank 1 in a gradient
    # reduce-scatter (all-gathers run on a group of their own, so the two never meet as one mismatched collective,
    # which gloo answers with an abort): both time out, each naming where it waited
    report = _failed_run("skip_all", 3, tmp_path)
    assert "terminate called" not in report
    rank0, rank1 = _rank_output(report, 0), _rank_output(report, 1)
    assert "CollectiveError: zeroshard: the parameter all-gather of unit 'blocks.0' (forward) failed on rank 0" in rank0
    assert "CollectiveError: zeroshard: the gradient reduce-scatter of gradient bucket" in rank1
    assert "failed on rank 1 (of 2) at step 3: it timed out" in rank1


def test_numpy_views_of_gathered_parameters_survive_leaving_the_block(tmp_path):
    run_ranks(WORKER, ["numpy", "3", str(tmp_path)], timeout=200)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"numpy_rank{rank}.json").read_text())
        assert got == {
            "same_after_exit": True,  # the arrays keep the values they viewed
            "regathered_equal": True,  # the shards were not disturbed
            "forward_equal": True,  # a forward after the block (gathering into fresh buffers) equals one inside
            "forward_after_write_equal": True,  # writing the old array does not reach the model
        }, (rank, got)


def test_train_gpt_timeout_flag_reaches_the_strategy(monkeypatch):
    from datetime import timedelta

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    import train_gpt

    for extra in (["--stage", "3"], ["--strategy", "ddp"]):
        strategy = train_gpt.make_strategy(train_gpt.parse_args(["--timeout", "90", *extra]))
        assert strategy._timeout == timedelta(seconds=90), extra
    assert train_gpt.make_strategy(train_gpt.parse_args([]))._timeout == timedelta(minutes=30)  # Lightning's default
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--timeout", "0"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gather_tags_are_exact_in_every_compute_dtype(dtype):
    import torch

    from zeroshard.sharding import gather_check

    dt = getattr(torch, dtype)
    for index in (0, 1, 255, 256, 2047, 2049, 65_537, (1 << 24) - 1):
        for backward in (False, True):
            tag = torch.tensor(gather_check.encode(index, backward), dtype=dt)
            assert gather_check.decode(tag.float().tolist()) == (index, backward), (dtype, index, backward)
    same = torch.tensor(gather_check.encode(300, False) * 2, dtype=dt)
    assert gather_check.disagreement(same) is None
    # units 1 and 257 differ only in their second digit; bf16 would round 257 itself to 256
    mixed = torch.tensor(gather_check.encode(1, True) + gather_check.encode(257, True), dtype=dt)
    assert gather_check.disagreement(mixed) == [(0, 1, True), (1, 257, True)]
    other = torch.tensor(gather_check.encode(3, False) + [0.5, 7.0, 0.0, 2.0], dtype=dt)  # not a tag
    assert gather_check.disagreement(other) == [(0, 3, False), None]
    with pytest.raises(ValueError, match="2\\*\\*24"):
        gather_check.encode(1 << 24, False)

"""A NaN/inf loss on one rank never reaches the master weights silently (issue 18, case 14).

Rank 1's loss is multiplied by NaN (or inf) at step 2 of 5, on 2 gloo ranks, at stages 1-3 with and without optimizer
offload. With ``nonfinite="error"`` (the default) every rank raises ``NonFiniteGradientError`` naming the step and the
first bucket, and its master shards, parameter shards and optimizer state are bit for bit those from before the step;
the weights equal DDP's after the two good steps. With ``"skip"`` the step is skipped on every rank with a warning
(state bit for bit unchanged), training goes on, and the weights after 5 steps equal DDP's trained on the 4 good steps
only; also with gradient clipping, and in bf16 with an inf. Through Lightning's Trainer the error ends ``fit`` on every
rank and a skip still counts the step (``global_step``), as an fp16 overflow skip does. One launch for every case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "nonfinite_runs.py"
CONFIGS = {
    "s1": {"stage": 1},
    "s2": {"stage": 2},
    "s3": {"stage": 3},
    "s1_offload": {"stage": 1, "offload": True},
    "s2_offload": {"stage": 2, "offload": True},
    "s3_offload": {"stage": 3, "offload": True},
}
EXTRA = {
    "s3_offload_clip_skip": {"stage": 3, "offload": True, "clip": 0.05, "mode": "skip"},
    "s2_clip_error": {"stage": 2, "clip": 0.05, "mode": "error"},
    "s2_bf16_inf_skip": {"stage": 2, "bf16": True, "bad": "inf", "mode": "skip"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nonfinite")
    plan = [
        {"name": "ddp_two", "strategy": "ddp", "batches": [0, 1]},
        {"name": "ddp_two_clip", "strategy": "ddp", "batches": [0, 1], "clip": 0.05},
        {"name": "ddp_four", "strategy": "ddp", "batches": [0, 1, 3, 4]},
        {"name": "ddp_four_clip", "strategy": "ddp", "batches": [0, 1, 3, 4], "clip": 0.05},
    ]
    for name, cfg in CONFIGS.items():
        plan += [{"name": f"{name}_{mode}", "strategy": "zeroshard", "mode": mode, **cfg} for mode in ("error", "skip")]
    plan += [{"name": name, "strategy": "zeroshard", **cfg} for name, cfg in EXTRA.items()]
    plan += [{"name": f"trainer_{mode}", "strategy": "trainer", "stage": 2, "mode": mode} for mode in ("error", "skip")]
    run_ranks(SCRIPT, [str(out), json.dumps(plan)], timeout=900)
    return out


def _record(out: Path, name: str, rank: int) -> dict:
    return json.loads((out / f"{name}_rank{rank}.json").read_text())


def _equal_ddp(out: Path, name: str, ref: str) -> None:
    a, b = torch.load(out / f"{ref}.pt"), torch.load(out / f"{name}.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{name} vs {ref}, {k}: {m}")


ERROR_CASES = [f"{c}_error" for c in CONFIGS] + ["s2_clip_error"]
SKIP_CASES = [f"{c}_skip" for c in CONFIGS] + ["s3_offload_clip_skip", "s2_bf16_inf_skip"]


@pytest.mark.parametrize("name", ERROR_CASES)
def test_error_raises_on_every_rank_before_any_change(runs, name):
    """Both ranks raise at step 2 (rank 0's own loss was finite), naming the step and bucket 0 by its first
    parameter; nothing changed; the weights are DDP's after steps 0 and 1."""
    for rank in range(2):
        rec = _record(runs, name, rank)
        assert rec["raised"] is not None, f"{name} rank {rank}: no error"
        assert rec["raised"].startswith("2: ") and "at step 2" in rec["raised"], rec["raised"]
        assert "gradient bucket 0" in rec["raised"] and f"'{rec['first_name']}'" in rec["raised"], rec["raised"]
        assert rec["unchanged"] is True, f"{name} rank {rank}: master/optimizer state changed"
        assert rec["finite"]
    _equal_ddp(runs, name, "ddp_two_clip" if "clip" in name else "ddp_two")


@pytest.mark.parametrize("name", SKIP_CASES)
def test_skip_skips_everywhere_and_training_goes_on(runs, name):
    """Both ranks skip step 2 with a warning naming it, state bit for bit unchanged; after 5 steps the weights are
    DDP's after the 4 good batches (bf16: finite, no reference at that precision)."""
    for rank in range(2):
        rec = _record(runs, name, rank)
        assert rec["raised"] is None, rec["raised"]
        assert rec["unchanged"] is True, f"{name} rank {rank}: the skipped step changed state"
        assert rec["skipped_steps"] == 1
        assert len(rec["warned"]) == 1 and "skipped step 2" in rec["warned"][0], rec["warned"]
        assert rec["finite"]
    if "bf16" not in name:
        _equal_ddp(runs, name, "ddp_four_clip" if "clip" in name else "ddp_four")


def test_trainer_error_and_skip(runs):
    """Lightning's Trainer (stage 2): "error" ends fit on both ranks at step 2; "skip" finishes all 5 steps, counting
    the skipped one as Lightning counts an fp16 overflow skip, with finite weights."""
    for rank in range(2):
        err = _record(runs, "trainer_error", rank)
        assert err["raised"] is not None and "at step 2" in err["raised"], err
        skip = _record(runs, "trainer_skip", rank)
        assert skip["raised"] is None and skip["global_step"] == 5 and skip["losses"] == 5, skip
        assert skip["finite"]


@pytest.mark.parametrize("bad", ["warn", None, "ERROR", 1])
def test_bad_setting_fails_at_construction(bad):
    """Both strategies refuse a bad ``nonfinite`` when built, naming the value and the choices."""
    import zeroshard

    for cls in (zeroshard.ZeroStrategy, zeroshard.ZeroFabricStrategy):
        with pytest.raises(ValueError, match=rf"nonfinite={bad!r}.*'error', 'skip', 'ignore'"):
            cls(nonfinite=bad)
    with pytest.raises(ValueError, match="nonfinite='skip'.*overlap_step"):
        zeroshard.ZeroConfig(offload_optimizer=True, overlap_step=True, nonfinite="skip")


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
def test_huge_finite_gradient_is_not_flagged(group, offload):  # noqa: F811
    """The reducer flags a bucket whose shard sum is not finite; finite elements whose sum overflows fp32 are
    re-checked exactly and step normally (one process)."""
    from zeroshard import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-40)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2, offload_optimizer=offload))
    (model.weight.sum() * 3e38).backward()  # every weight gradient 3e38: their sum overflows fp32
    engine.finish_backward()
    engine.optimizer.step()
    engine.after_step()
    assert engine.skipped_steps == 0
    assert torch.isfinite(model.weight).all()
    engine.remove_hooks()

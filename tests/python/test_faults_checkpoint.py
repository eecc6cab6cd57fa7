"""Checkpoint safety under faults and bad input (issue 10, items 1-3), each tested the way it was found.

1. Loading runs no code: the trainer state is JSON + safetensors; a crafted pickle is refused (naming the file and
   the opt-in) and its code does not run; pickled objects load only with ``weights_only=False``.
2. Every file and the layout are verified: a changed index, trainer state or rank file, a layout that disagrees with
   the safetensors headers or the model, and a directory that is no checkpoint each give one error naming the file
   or parameter, before any state changes.
3. A SIGKILL at every step of a save leaves a checkpoint that loads, fully verified, as either the old or the new
   state (compared exactly with references taken before the save), says which version, and a later save works.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_tools import Exploit, edit_index, make_legacy, reseal, version_dir
from launch import run_ranks

from zeroshard.checkpoint import trainer_state
from zeroshard.checkpoint.adopt import adopt_checkpoint
from zeroshard.checkpoint.checkpoint_dir import POINTER, resolve
from zeroshard.checkpoint.checkpoint_verify import CheckpointError
from zeroshard.checkpoint.sharded_checkpoint import read_trainer_state, verify
from zeroshard.checkpoint.trainer_state import UnsafeCheckpointError
from zeroshard.consolidate import consolidate

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_faults.py"
TIMEOUT = 180  # seconds per multi-rank run: a hang fails the test


def _killed_run(args: list[str]) -> str:
    """A run in which a rank SIGKILLs itself: the others must fail too (not hang); returns every rank's output."""
    with pytest.raises(AssertionError) as info:
        run_ranks(SCRIPT, args, timeout=TIMEOUT)
    text = str(info.value)
    assert "exit -9" in text, text[-3000:]  # the kill happened (not some other failure)
    assert "killed after" not in text, text[-3000:]
    return text


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """OUT/ck with A (v00001) and B (v00002, committed), saved with no kill; A.pt and B.pt the references."""
    out = tmp_path_factory.mktemp("clean")
    run_ranks(SCRIPT, ["killsave", str(out), "no_such_step"], timeout=TIMEOUT)
    return out


# -- 1. loading runs no code ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Cfg:
    width: int = 3


def test_trainer_state_round_trips_without_pickle(tmp_path):
    import random
    from collections import OrderedDict

    rng = np.random.RandomState(7)
    state = {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.6.6",
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4}}, "ok": True}},
        "callbacks": {"ModelCheckpoint{'monitor': 'val'}": {"best_model_score": torch.tensor(1.5), "kth": None}},
        "lr_schedulers": [{"base_lrs": [0.1, 0.01], "last_epoch": 7, "_last_lr": [float("nan"), float("inf")]}],
        "int_keys": {0: "a", 5: (1, 2.5, "x")},
        "ordered": OrderedDict(b=1, a=2),
        "tensors": [torch.randn(3, 4), torch.arange(5), torch.ones(2, dtype=torch.bfloat16), torch.tensor(True)],
        "rng": {"torch": torch.get_rng_state(), "numpy": rng.get_state(), "python": random.getstate()},
        "np_scalar": np.float32(0.25),
        "meta": {"dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3])},
    }
    written = trainer_state.save(tmp_path, state)
    assert written == ["trainer.json", "trainer.safetensors"]  # nothing needed pickle
    got = trainer_state.load(tmp_path)
    assert got.keys() == state.keys()
    for k in ("epoch", "global_step", "loops", "int_keys", "ordered", "meta"):
        assert got[k] == state[k] and type(got[k]) is type(state[k]), k
    torch.testing.assert_close(got["callbacks"], state["callbacks"], rtol=0, atol=0)
    lrs = got["lr_schedulers"][0]["_last_lr"]
    assert np.isnan(lrs[0]) and lrs[1] == float("inf")
    for a, b in zip(got["tensors"], state["tensors"]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(got["rng"]["torch"], state["rng"]["torch"])
    assert got["rng"]["python"] == state["rng"]["python"]
    np_got, np_ref = got["rng"]["numpy"], state["rng"]["numpy"]
    assert np_got[0] == np_ref[0] and np.array_equal(np_got[1], np_ref[1]) and np_got[1].dtype == np_ref[1].dtype
    assert np_got[2:] == np_ref[2:]
    rng2 = np.random.RandomState()
    rng2.set_state(np_got)
    assert rng2.rand() == rng.rand()  # the restored generator continues the same stream
    assert got["np_scalar"] == state["np_scalar"] and got["np_scalar"].dtype == np.float32


def test_objects_without_json_form_load_only_with_weights_only_false(tmp_path):
    state = {"hyper_parameters": {"lr": 0.1, "cfg": _Cfg(5)}, "global_step": 2}
    assert trainer_state.save(tmp_path, state)[-1] == "trainer.pickle"
    structure = json.loads((tmp_path / "trainer.json").read_text())
    assert "_Cfg" in json.dumps(structure) and '"lr": 0.1' in json.dumps(structure)  # only the dataclass is pickled
    with pytest.raises(UnsafeCheckpointError, match=r"trainer\.pickle needs pickle.*hyper_parameters\.cfg.*_Cfg") as e:
        trainer_state.load(tmp_path)
    assert "weights_only=False" in str(e.value) and "add_safe_globals" in str(e.value)
    with pytest.raises(UnsafeCheckpointError):
        trainer_state.load(tmp_path, weights_only=True)
    assert trainer_state.load(tmp_path, weights_only=False) == state
    with torch.serialization.safe_globals([_Cfg]):  # torch's allowlist works as for Lightning's own checkpoints
        assert trainer_state.load(tmp_path) == state


def test_the_json_decoder_builds_only_data(tmp_path):
    """trainer.json can name no callable: a "dtype" that is a torch function or a numpy object dtype is an error."""
    trainer_state.save(tmp_path, {"a": np.arange(3)})
    missing = "names tensor 't9', which trainer.safetensors lacks"
    for bad, message in [({"$dtype": "load"}, "'load' is not a torch dtype"), ({"$tensor": "t9"}, missing)]:
        (tmp_path / "trainer.json").write_text(json.dumps({"format_version": 1, "state": bad}))
        with pytest.raises(ValueError, match=message):
            trainer_state.load(tmp_path)
    obj = {"$ndarray": "t0", "dtype": "|O", "shape": [3]}
    (tmp_path / "trainer.json").write_text(json.dumps({"format_version": 1, "state": obj}))
    with pytest.raises(ValueError, match=re.escape("'|O' is not a numeric numpy dtype")):
        trainer_state.load(tmp_path)


def test_a_crafted_pickle_is_refused_and_runs_no_code(clean, tmp_path):
    """The exploit of issue 10 in every place a pickle can be: a re-sealed trainer.pickle of a new checkpoint, the
    older layout's trainer.pt, and ``consolidate --format lightning``. The error names the file and the opt-in."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil"
    shutil.copytree(clean / "ck", evil)
    d = version_dir(evil)
    structure = {"format_version": 1, "state": {"$dict": {"tag": "B", "cfg": {"$pickle": "p0", "at": "cfg"}}}}
    (d / "trainer.json").write_text(json.dumps(structure))
    torch.save({"p0": Exploit(marker)}, d / "trainer.pickle")
    reseal(evil)  # an attacker can fix the checksums too: the pickle rule must hold on its own
    verify(evil)
    with pytest.raises(UnsafeCheckpointError, match=r"trainer\.pickle needs pickle.*weights_only=False"):
        read_trainer_state(evil)
    assert not marker.exists()

    legacy = tmp_path / "legacy"
    make_legacy(clean / "ck", legacy)
    torch.save({"tag": "B", "x": Exploit(marker)}, legacy / "trainer.pt")
    adopt_checkpoint(legacy)  # a directory without a manifest loads only once adopted; adopting unpickles nothing
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match=r"legacy/trainer\.pt needs pickle.*weights_only=False"):
        read_trainer_state(legacy)
    assert not marker.exists()

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "zeroshard.consolidate", str(evil), str(tmp_path / "m.ckpt"), "--format", "lightning"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={"PYTHONPATH": str(repo / "python")}, timeout=120)
    assert proc.returncode != 0 and "trainer.pickle needs pickle" in proc.stderr and "--allow-pickle" in proc.stderr
    assert not marker.exists()
    assert read_trainer_state(clean / "ck") == {"tag": "B"}  # the honest checkpoint needs no opt-in


def test_fit_resumes_the_committed_checkpoint_after_a_kill_and_refuses_pickles(tmp_path):
    """Through the Trainer: a save killed after its rank files leaves the previous checkpoint, which
    ``fit(ckpt_path=...)`` resumes (at its step, with its dataclass hyper_parameters) only with weights_only=False;
    a crafted pickle is refused by ``fit`` and never runs."""
    _killed_run(["fit_save", str(tmp_path)])
    marker = tmp_path / "pwned"
    shutil.copytree(tmp_path / "ck", tmp_path / "evil")
    torch.save({"p0": Exploit(marker)}, version_dir(tmp_path / "evil") / "trainer.pickle")
    reseal(tmp_path / "evil")
    out = run_ranks(SCRIPT, ["fit_resume", str(tmp_path)], timeout=TIMEOUT)
    for rank_out in out:
        assert re.search(r"REFUSED evil: .*evil/v00001/trainer\.pickle needs pickle.*weights_only=False", rank_out)
        assert re.search(r"REFUSED ck: .*ck/v00001/trainer\.pickle needs pickle.*hyper_parameters\.cfg", rank_out)
        assert "RESUMED_AT 4" in rank_out  # A (step 4), not the killed save of step 8
        assert "HPARAMS Cfg(width=7, note='a dataclass in hyper_parameters')" in rank_out
    assert f"loaded sharded checkpoint {tmp_path / 'ck'}, version v00001" in out[0]
    assert not marker.exists()


# -- 2. every file and the layout are verified ------------------------------------------------------------------------


def test_every_file_is_checksummed_the_index_included(clean, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(clean / "ck", bad)
    d = version_dir(bad)

    def shrink(index):  # the 256x64-for-128x64 edit of the issue, on blocks.0.up.weight
        entry = next(e for e in index["flat_params"] if "blocks.0.up.weight" in e["names"])
        entry["shapes"][entry["names"].index("blocks.0.up.weight")] = [64, 32]

    edit_index(bad, shrink, seal=False)
    changed = r"v00002: index\.json (is corrupt \(SHA-256 differs from|has \d+ bytes,) manifest\.json"
    with pytest.raises(CheckpointError, match=changed):
        verify(bad)
    with pytest.raises(CheckpointError, match=changed):
        consolidate(bad, tmp_path / "out")  # consolidate refuses a tampered index too
    assert not (tmp_path / "out").exists()

    shutil.rmtree(bad)
    shutil.copytree(clean / "ck", bad)
    data = bytearray((d / "trainer.json").read_bytes())
    data[len(data) // 2] ^= 0x01
    (d / "trainer.json").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"trainer\.json is corrupt"):
        read_trainer_state(bad)
    shutil.copy(clean / "ck" / "v00002" / "trainer.json", d / "trainer.json")
    (d / "trainer.safetensors").write_bytes((d / "trainer.safetensors").read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"trainer\.safetensors has \d+ bytes, manifest\.json says"):
        verify(bad)
    shutil.copy(clean / "ck" / "v00002" / "trainer.safetensors", d / "trainer.safetensors")
    (d / "manifest.json").write_text((d / "manifest.json").read_text().replace('"bytes"', '"bytes" '))
    with pytest.raises(CheckpointError, match=r"manifest\.json is corrupt \(SHA-256 differs from .*LATEST"):
        verify(bad)


def test_the_layout_is_checked_against_the_safetensors_headers(clean, tmp_path):
    bad = tmp_path / "bad"
    cases = {
        "world_size": (
            lambda ix: ix.update(world_size=3),
            r"world_size 3 means \['rank00000.safetensors', 'rank00001.safetensors', 'rank00002.safetensors'\]",
        ),
        "shard_numel": (
            lambda ix: ix["flat_params"][0].update(shard_numel=ix["flat_params"][0]["shard_numel"] // 2),
            r"parameter \S+: ends at element \d+, past the flat buffer's 2 x \d+ elements",
        ),
        "shard_numel_up": (
            lambda ix: ix["flat_params"][0].update(shard_numel=ix["flat_params"][0]["shard_numel"] * 2),
            r"rank00000\.safetensors holds flat\.0\.[\w.]+ with \d+ elements of F32; index\.json says \d+ elements",
        ),
        "offset": (
            lambda ix: ix["flat_params"][0]["offsets"].__setitem__(1, 0),
            r"parameter \S+: shape \[.*\] at offset 0 overlaps the previous parameter",
        ),
        "dtype": (
            lambda ix: ix["flat_params"][0].update(dtype="bfloat16"),
            r"holds flat\.0\.param with \d+ elements of F32; index\.json says \d+ elements of BF16",
        ),
    }
    for edit, message in cases.values():
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(clean / "ck", bad)
        edit_index(bad, edit, seal=True)
        with pytest.raises(CheckpointError, match=message):
            verify(bad)
        with pytest.raises(CheckpointError, match=message):
            consolidate(bad, tmp_path / "out")


def test_a_directory_that_is_no_checkpoint_says_what_it_lacks(clean, tmp_path):
    import zeroshard

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    lacks = r"is not a zeroshard sharded checkpoint: it has no LATEST .* and no index\.json .* holds \['notes\.txt'\]"
    with pytest.raises(ValueError, match=lacks):
        verify(empty)
    with pytest.raises(ValueError, match=lacks):  # fit/validate(ckpt_path=DIR) take this path: no IsADirectoryError
        zeroshard.ZeroStrategy().load_checkpoint(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        verify(tmp_path / "missing")

    legacy = tmp_path / "legacy"
    make_legacy(clean / "ck", legacy)
    (legacy / "index.json").write_text('{"world_size": 2, ')
    with pytest.raises(CheckpointError, match=r"legacy has no manifest\.json"):  # refused until adopted
        verify(legacy)
    with pytest.raises(CheckpointError, match=r"legacy: index\.json is not valid JSON \(Expecting"):
        adopt_checkpoint(legacy)
    (legacy / "index.json").unlink()
    with pytest.raises(ValueError, match=r"has no LATEST .* and no index\.json"):
        verify(legacy)

    interrupted = tmp_path / "interrupted"
    shutil.copytree(clean / "ck", interrupted)
    (interrupted / POINTER).unlink()
    with pytest.raises(ValueError, match=r"uncommitted versions \['v00001', 'v00002'\]: a save was interrupted"):
        verify(interrupted)
    shutil.copytree(clean / "ck", tmp_path / "badptr")
    (tmp_path / "badptr" / POINTER).write_text("v2")
    with pytest.raises(ValueError, match=r"LATEST is corrupt .* Load a version directory directly, e.g. .*v00002"):
        verify(tmp_path / "badptr")
    assert verify(tmp_path / "badptr" / "v00001")["world_size"] == 2  # a version directory loads on its own


def test_the_layout_is_checked_against_the_model_before_any_state_changes(clean, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(clean / "ck", bad)

    def shrink(index):
        entry = next(e for e in index["flat_params"] if "blocks.0.up.weight" in e["names"])
        entry["shapes"][entry["names"].index("blocks.0.up.weight")] = [64, 32]

    edit_index(bad, shrink, seal=True)  # consistent with the headers: only the model can tell
    out = run_ranks(SCRIPT, ["mismatch", str(bad)], timeout=TIMEOUT)
    for rank_out in out:
        assert re.search(
            r"ERROR CheckpointError: .*blocks\.0\.up\.weight has shape \[64, 32\] in the checkpoint and "
            r"\[128, 32\] in the model",
            rank_out,
        ), rank_out[-2000:]
    assert "UNCHANGED" in out[0]


# -- 3. a crash at any point of a save leaves a loadable checkpoint ---------------------------------------------------

# (ZEROSHARD_TEST_KILL_AT, whether OUT/ck is a symbolic link, which state loads, its version, where it is loaded from)
KILLS = [
    ("before_write:1", False, "A", "v00001", "ck"),
    ("rank_file_written:1", False, "A", "v00001", "ck"),  # mid-write: rank 0's file written, rank 1's not synced
    ("after_rank_files:0", False, "A", "v00001", "ck"),
    ("before_pointer:0", False, "A", "v00001", "ck"),  # the new version complete and fsynced, not committed
    ("after_pointer:0", False, "B", "v00002", "ck"),
    ("after_cleanup:0", False, "B", "v00002", "ck"),
    ("before_pointer:0", True, "A", "v00001", "ck"),  # ck -> real: the link is still there
    ("between_renames:0", True, "B", "v00001", "ck.partial"),  # the link removed, ck.partial not yet renamed
]


KILL_IDS = [k[0] + "_link" * k[1] for k in KILLS]
LEGACY = "legacy"  # the case of test_the_single_version_layout_loads_and_is_replaced_by_versions


@pytest.fixture(scope="module")
def loads(clean, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Case -> (its OUT directory, rank 0's output of loading OUT/ck then saving over it), or the error of its killed
    save. Each kill needs a launch of its own (it ends the process group); the loads share one launch."""
    root = tmp_path_factory.mktemp("loads")
    outs, failed = {}, {}
    for i, ((spec, link, *_), case) in enumerate(zip(KILLS, KILL_IDS)):
        out = root / f"kill{i}"
        out.mkdir()
        try:
            _killed_run(["killsave", str(out), spec] + (["link"] if link else []))
            outs[case] = out
        except (AssertionError, pytest.fail.Exception) as e:  # reported by this case's test alone
            failed[case] = e
    legacy = root / LEGACY
    legacy.mkdir()
    make_legacy(clean / "ck", legacy / "ck")
    adopt_checkpoint(legacy / "ck")  # it has no manifest: adopted by hand first (zeroshard.checkpoint.adopt)
    for ref in ("A.pt", "B.pt"):
        shutil.copy(clean / ref, legacy / ref)
    outs[LEGACY] = legacy
    text = run_ranks(SCRIPT, ["load", *map(str, outs.values())], timeout=2 * TIMEOUT)[0]
    sections = re.split(r"^CASE (.*)$", text, flags=re.M)
    by_dir = {Path(sections[i]): sections[i + 1] for i in range(1, len(sections), 2)}
    missing = f"no CASE line in:\n{text[-3000:]}"
    return {**{case: (out, by_dir.get(out, missing)) for case, out in outs.items()}, **failed}


def _load_of(loads, case: str) -> tuple[Path, str]:
    got = loads[case]
    if isinstance(got, BaseException):
        raise got
    return got


@pytest.mark.parametrize(
    "case, spec, link, tag, version, source", [(c, *k) for c, k in zip(KILL_IDS, KILLS)], ids=KILL_IDS
)
def test_a_kill_at_each_save_step_loads_the_old_or_the_new_checkpoint(loads, case, spec, link, tag, version, source):
    tmp_path, out0 = _load_of(loads, case)
    assert f"LOADED {tag}" in out0, out0  # parameters and optimizer state equal the reference exactly (checked there)
    assert f"loaded sharded checkpoint {tmp_path / source}, version {version} (" in out0
    after = eval(re.search(r"AFTER (\[.*\])", out0).group(1))
    versions = [e for e in after if re.fullmatch(r"v\d{5}", e)]
    assert after == ["LATEST", *versions], after  # no temporary pointer left
    # the later save kept the version it replaced and its own, and deleted the crash's uncommitted leftovers
    assert len(versions) == (1 if link and tag == "A" else 2) and (link and tag == "A" or versions[0] == version)
    parent = eval(re.search(r"AFTER_PARENT (\[.*\])", out0).group(1))
    assert "ck.partial" not in parent
    if link:
        assert verify(tmp_path / "real") and read_trainer_state(tmp_path / "real") == {"tag": "A"}  # target untouched


def test_the_single_version_layout_loads_and_is_replaced_by_versions(loads):
    tmp_path, out0 = _load_of(loads, LEGACY)  # the old layout of clean's B, adopted, loaded in the loads' launch
    assert "LOADED B" in out0 and f"loaded sharded checkpoint {tmp_path / 'ck'}, version legacy (" in out0
    after = eval(re.search(r"AFTER (\[.*\])", out0).group(1))
    # the old layout is the previous version until the next save commits
    legacy = ["index.json", "manifest.json", "rank00000.safetensors", "rank00001.safetensors", "trainer.pt"]
    assert after == ["LATEST", *legacy, "v00001"]
    assert resolve(tmp_path / "ck").version == "v00001"

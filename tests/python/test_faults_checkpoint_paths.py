"""A checkpoint directory is hostile input (issue 18, cases 1, 2, 3, 5, 9, 10 and two smaller items), each tested the
way it was found: the directory edited as an attacker with write access would, manifest and pointer re-sealed.

1. A planted ``LATEST.tmp`` link is never written through, and ``LATEST`` stays a regular file.
2. Names outside the directory (``..``, absolute) in the manifest are refused without a word about the file they
   name; a rank file or version directory that is a link is refused.
3. ``world_size: 10**9`` is refused at once, in bounded memory.
5. Negative dimensions are refused by the index check; ``consolidate`` writes nothing.
9. A version without ``manifest.json`` is refused, and adopted by hand (``python -m zeroshard.checkpoint.adopt``).
10. Every trainer-state decode error names the file and the key, before any weight is loaded; safetensors errors name
    the file.
Smaller: a failed first save does not claim a previous checkpoint; a failed commit's complete version and
``LATEST.tmp`` are cleaned by the next save.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from ckpt_tools import edit_index, make_legacy, reseal, version_dir
from launch import run_ranks

from zeroshard.checkpoint import trainer_state
from zeroshard.checkpoint.adopt import adopt_checkpoint
from zeroshard.checkpoint.checkpoint_dir import POINTER
from zeroshard.checkpoint.checkpoint_verify import MANIFEST, CheckpointError
from zeroshard.checkpoint.sharded_checkpoint import read_trainer_state, verify
from zeroshard.consolidate import consolidate

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 240


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, str]:
    """OUT/ck after the saves of scripts/ckpt_paths.py (D committed as v00004, C kept as v00003); rank 0's output."""
    out = tmp_path_factory.mktemp("paths")
    return out, run_ranks(SCRIPTS / "ckpt_paths.py", ["saves", str(out)], timeout=TIMEOUT)[0]


def _line(output: str, key: str) -> str:
    found = re.search(rf"^{key} (.*)$", output, re.MULTILINE)
    assert found, output[-3000:]
    return found.group(1)


def _copy(saved: tuple[Path, str], tmp_path: Path) -> Path:
    shutil.copytree(saved[0] / "ck", tmp_path / "ck", symlinks=True)
    return tmp_path / "ck"


def _seal_manifest(ckpt: Path, edit) -> None:
    """``edit(files)`` on the committed manifest's file list, then the pointer re-sealed (as an attacker would)."""
    d = version_dir(ckpt)
    manifest = json.loads((d / MANIFEST).read_text())
    edit(manifest["files"])
    data = json.dumps(manifest).encode()
    (d / MANIFEST).write_bytes(data)
    pointer = json.loads((ckpt / POINTER).read_text())
    pointer["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    (ckpt / POINTER).write_text(json.dumps(pointer))


# -- 1 and the smaller save items -------------------------------------------------------------------------------------


def test_a_planted_latest_tmp_link_is_never_written_through(saved):
    out, rank0 = saved
    assert _line(rank0, "OUTSIDE") == "precious, outside the checkpoint"
    assert (out / "outside.txt").read_text() == "precious, outside the checkpoint"
    assert _line(rank0, "LATEST_IS_LINK") == "False" and not (out / "ck" / POINTER).is_symlink()
    assert "LOADS D" in rank0  # the save committed and loads
    assert eval(_line(rank0, "AFTER_PLANTED")) == ["LATEST", "v00003", "v00004"]  # the link was removed


def test_a_failed_first_save_does_not_claim_a_previous_checkpoint(saved):
    out, rank0 = saved
    message = _line(rank0, "FIRST_SAVE_ERROR")
    assert "rank 1 failed writing its rank file" in message and "No space left on device" in message
    assert "no checkpoint was committed there before this save, and none is now" in message
    assert "previous checkpoint is untouched" not in message
    with pytest.raises(ValueError, match="is not a zeroshard sharded checkpoint"):  # and indeed there is none
        verify(out / "first")


def test_a_failed_commit_leaves_a_version_and_latest_tmp_that_the_next_save_removes(saved):
    """The commit failed after LATEST.tmp was written: the complete v00002 and LATEST.tmp stay (never read: A still
    loads), and the next save (C, v00003) removes both after its own commit, keeping A as the previous version."""
    _, rank0 = saved
    assert "failed committing" in _line(rank0, "COMMIT_ERROR")
    assert eval(_line(rank0, "AFTER_FAILED_COMMIT")) == ["LATEST", "LATEST.tmp", "v00001", "v00002"]
    loads = re.findall(r"^LOADS (\w+)$", rank0, re.MULTILINE)
    assert loads == ["A", "C", "D"], loads
    assert eval(_line(rank0, "AFTER_NEXT_SAVE")) == ["LATEST", "v00001", "v00003"]


# -- 2. names and links outside the directory -------------------------------------------------------------------------


def test_manifest_names_outside_the_directory_are_refused_without_revealing_them(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 631)
    depth = len(version_dir(ckpt).relative_to(tmp_path).parts)
    for name in ["../" * depth + "secret", str(secret)]:  # relative, then absolute: both reach the same file
        assert (version_dir(ckpt) / name).resolve() == secret.resolve()

        def add(files, name=name):
            files[name] = {"bytes": 1, "sha256": "0" * 64}

        _seal_manifest(ckpt, add)
        with pytest.raises(CheckpointError, match="which is not a plain file name inside the checkpoint") as e:
            verify(ckpt)
        assert repr(name) in str(e.value) and "631" not in str(e.value)  # the name as given, nothing about the file
        _seal_manifest(ckpt, lambda files, name=name: files.pop(name))
    verify(ckpt)  # as sealed by the save again


def test_a_linked_rank_file_version_directory_or_pointer_is_refused(saved, tmp_path):
    """Each link points at an exact copy, so every hash matches: only the link itself can be refused."""
    ckpt = _copy(saved, tmp_path)
    d = version_dir(ckpt)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    shutil.move(d / "rank00001.safetensors", elsewhere / "rank00001.safetensors")
    (d / "rank00001.safetensors").symlink_to(elsewhere / "rank00001.safetensors")
    with pytest.raises(CheckpointError, match=r"rank00001\.safetensors \(manifest\.json names it\) is a symbolic link"):
        verify(ckpt)
    (d / "rank00001.safetensors").unlink()
    shutil.move(elsewhere / "rank00001.safetensors", d / "rank00001.safetensors")
    verify(ckpt)

    shutil.move(d, elsewhere / d.name)
    d.symlink_to(elsewhere / d.name, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"v00004 \(LATEST names it\) is a symbolic link"):
        verify(ckpt)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        read_trainer_state(ckpt)
    d.unlink()
    shutil.move(elsewhere / d.name, d)

    shutil.move(ckpt / POINTER, elsewhere / POINTER)
    (ckpt / POINTER).symlink_to(elsewhere / POINTER)
    with pytest.raises(CheckpointError, match=r"LATEST \(the directory names it\) is a symbolic link") as e:
        verify(ckpt)
    assert str(elsewhere) not in str(e.value)


# -- 3. sizes bounded before use --------------------------------------------------------------------------------------


def test_a_billion_ranks_in_the_index_is_refused_at_once_in_bounded_memory(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    edit_index(ckpt, lambda ix: ix.update(world_size=10**9), seal=True)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(
            CheckpointError, match=r"world_size 1000000000 means rank00000\.safetensors \.\. rank999999999"
        ):
            verify(ckpt)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0, elapsed
    assert peak < 64 << 20, peak  # the files hashed and parsed, not a billion names


# -- 5. negative dimensions -------------------------------------------------------------------------------------------


def test_negative_dimensions_are_refused_and_consolidate_writes_nothing(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    found = {}

    def negate(index):  # [a, b] -> [-a, -b]: the same product, so the old check passed it
        for entry in index["flat_params"]:
            for j, shape in enumerate(entry["shapes"]):
                if len(shape) == 2 and not found:
                    entry["shapes"][j] = [-shape[0], -shape[1]]
                    found["name"], found["shape"] = entry["names"][j], entry["shapes"][j]

    edit_index(ckpt, negate, seal=True)
    message = rf"parameter {re.escape(found['name'])}: shape \[{found['shape'][0]}, {found['shape'][1]}\]; expected"
    with pytest.raises(CheckpointError, match=message + r" a list of at most 64 non-negative ints"):
        verify(ckpt)
    with pytest.raises(CheckpointError, match=message):
        consolidate(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    cmd = [sys.executable, "-m", "zeroshard.consolidate", str(ckpt), str(tmp_path / "cli")]
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0 and re.search(message, proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "cli").exists() or not any((tmp_path / "cli").iterdir())


# -- 9. the manifest is required --------------------------------------------------------------------------------------


def test_a_version_without_manifest_is_refused_until_adopted_by_hand(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    d = version_dir(ckpt)
    sealed = (d / MANIFEST).read_bytes()
    (d / MANIFEST).unlink()
    adopt = rf"has no manifest\.json, so its files cannot be verified.*python -m zeroshard\.checkpoint\.adopt {d}"
    for where in (ckpt, d):  # through LATEST, and the version directory given directly
        with pytest.raises(CheckpointError, match=adopt):
            verify(where)
        with pytest.raises(CheckpointError, match=adopt):
            read_trainer_state(where)

    # adoption checks the rank files against the index: a changed byte is refused, and nothing is written
    rank1 = (d / "rank00001.safetensors").read_bytes()
    (d / "rank00001.safetensors").write_bytes(rank1[:-1] + bytes([rank1[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=r"rank00001\.safetensors is corrupt \(SHA-256 differs from index\.json"):
        adopt_checkpoint(ckpt)
    assert not (d / MANIFEST).exists()
    (d / "rank00001.safetensors").write_bytes(rank1)

    cmd = [sys.executable, "-m", "zeroshard.checkpoint.adopt", str(ckpt)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "python")})
    assert proc.returncode == 0, proc.stderr
    assert "trainer state: trainer.json (every key" in proc.stdout and f"rewrote {ckpt / POINTER}" in proc.stdout
    assert (d / MANIFEST).read_bytes() == sealed  # the same manifest the save wrote: same files, same bytes
    assert verify(ckpt) and read_trainer_state(ckpt) == {"tag": "D"}
    with pytest.raises(CheckpointError, match="already has a manifest.json; nothing to adopt"):
        adopt_checkpoint(ckpt)


def test_the_single_version_layout_is_refused_until_adopted(saved, tmp_path):
    legacy = tmp_path / "legacy"
    make_legacy(saved[0] / "ck", legacy)
    with pytest.raises(CheckpointError, match=r"legacy has no manifest\.json"):
        verify(legacy)
    _, done = adopt_checkpoint(legacy)
    assert any("trainer.pt not opened" in line for line in done), done
    assert verify(legacy)["world_size"] == 2 and read_trainer_state(legacy) == {"tag": "D"}


# -- 10. trainer state schema -----------------------------------------------------------------------------------------


def _nest(levels: int) -> dict:
    node: dict = {"$dict": {}}
    for _ in range(levels):
        node = {"$dict": {"a": node}}
    return node


LIGHTNING = {"pytorch-lightning_version": "2.6.6", "epoch": 1, "global_step": 4}
# (state written into trainer.json, the key the error must name, the problem it must state)
BAD_STATES = [
    (
        _nest(80),
        r"nests more than 100 levels deep at key state(\.\$dict\.a)+\. \.\.\. (\.\$dict\.a)+\.\$dict, ",
        "levels",
    ),
    ({"$dict": {"dev": {"$device": "warp:9"}}}, "trainer_state.dev", r"\$device 'warp:9' is not a torch device"),
    ({"$dict": {"dev": {"$device": 3}}}, "trainer_state.dev", r"\$device 3 is not a torch device"),
    ({"$list": [1, 2]}, "trainer_state", r"is list; the trainer state must be a dict"),
    (5, "trainer_state", r"is int; the trainer state must be a dict"),
    ({"$dict": {**LIGHTNING, "loops": {"$list": []}}}, "trainer_state.loops", r"is list \[\]; expected a dict"),
    (
        {"$dict": {**LIGHTNING, "loops": {"$dict": {"fit_loop": 7}}}},
        "trainer_state.loops.fit_loop",
        "is int 7; expected a dict",
    ),
    (
        {
            "$dict": {
                **LIGHTNING,
                "loops": {"$dict": {"fit_loop": {"$dict": {"p": {"$dict": {"total": {"$dict": {"ready": "x"}}}}}}}},
            }
        },
        "trainer_state.loops.fit_loop.p.total.ready",
        "is str x; expected a non-negative int",
    ),  # fmt: skip
    ({"$dict": {**LIGHTNING, "global_step": True}}, "trainer_state.global_step", "expected a non-negative int"),
    ({"$dict": {**LIGHTNING, "lr_schedulers": {"$list": [3]}}}, r"trainer_state.lr_schedulers\[0\]", "expected a dict"),
    ({"$dict": {"s": {"$size": [2, -1]}}}, "trainer_state.s", "is not a list of at most 64 non-negative ints"),
    ({"$dict": {"f": {"$float": "lots"}}}, "trainer_state.f", "is not 'nan', 'inf' or '-inf'"),
    ({"$dict": {"t": {"$tensor": "t9"}}}, "trainer_state.t", "names tensor 't9', which trainer.safetensors lacks"),
    ({"$dict": {"x": {"$what": 1}}}, "trainer_state.x", "unknown tag '\\$what'"),
    ({"$dict": {"x": {"$list": [], "extra": 1}}}, "trainer_state.x", "not a tagged object"),
    ({"$dict": {"x": {"$dict": [1]}}}, "trainer_state.x", r"\$dict holds list, not an object"),
    (
        {"$dict": {"a": {"$ndarray": "t0", "dtype": "<f4", "shape": [100]}}},
        "trainer_state.a",
        r"does not hold the bytes of a <f4 array of shape \[100\]",
    ),
    ({"$dict_items": [[{"$list": []}, 1]]}, r"trainer_state.<key 0>", "a list cannot be a dict key"),
]


@pytest.mark.parametrize("state, key, problem", BAD_STATES, ids=[f"case{i}" for i in range(len(BAD_STATES))])
def test_each_trainer_state_decode_error_names_the_file_and_the_key(tmp_path, state, key, problem):
    trainer_state.save(tmp_path, {"a": __import__("numpy").arange(3, dtype="float32")})  # t0: 12 bytes
    file = tmp_path / "trainer.json"
    file.write_text(json.dumps({"format_version": 1, "state": state}))
    with pytest.raises(CheckpointError) as e:
        trainer_state.load(tmp_path)
    text = str(e.value)
    assert text.startswith(str(file)), text
    assert re.search(key, text) and re.search(problem, text), text


def test_trainer_state_depth_beyond_the_parser_and_safetensors_errors_name_the_file(saved, tmp_path):
    (tmp_path / "trainer.json").write_text('{"format_version": 1, "state": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match=r"trainer\.json nests deeper than Python's JSON parser can go"):
        trainer_state.load(tmp_path)
    with pytest.raises(ValueError, match=r"nests 1\d\d levels deep as JSON \(trainer\.json, at state"):
        trainer_state.save(tmp_path / "x", {"deep": __import__("functools").reduce(lambda a, _: [a], range(60), 0)})

    ckpt = _copy(saved, tmp_path)
    d = version_dir(ckpt)
    (d / "trainer.safetensors").write_bytes(b"\xff" * 8 + b"{not json")
    (d / "trainer.json").write_text(json.dumps({"format_version": 1, "state": {"$dict": {"t": {"$tensor": "t0"}}}}))
    reseal(ckpt)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(d))}/trainer\.safetensors is not a valid safetensors"):
        read_trainer_state(ckpt)
    (d / "rank00001.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{broken!")
    reseal(ckpt)
    with pytest.raises(CheckpointError, match=r"rank00001\.safetensors is not a valid safetensors file"):
        verify(ckpt)


def test_a_bad_trainer_state_is_refused_before_any_weight_is_loaded(saved, tmp_path):
    """Through load_sharded (as Trainer.fit(ckpt_path=...) calls it): the error names the file and key on every rank,
    and the engine's parameters and optimizer state are unchanged."""
    ckpt = _copy(saved, tmp_path)
    d = version_dir(ckpt)
    (d / "trainer.json").write_text(json.dumps({"format_version": 1, "state": {"$dict": {"d": {"$device": "gpu"}}}}))
    reseal(ckpt)
    out = run_ranks(SCRIPTS / "ckpt_faults.py", ["mismatch", str(ckpt)], timeout=TIMEOUT)
    for rank_out in out:
        assert f"ERROR CheckpointError: {d}/trainer.json: key trainer_state.d: $device 'gpu'" in rank_out, rank_out
    assert "UNCHANGED" in out[0]

"""Sharded checkpoints: written per rank with no gather, loaded at another world size and stage, saved atomically,
checked for missing and corrupt files. The reference is the consolidated checkpoint of the same training state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import run_ranks

from zeroshard.checkpoint.checkpoint_dir import resolve
from zeroshard.checkpoint.sharded_checkpoint import verify

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_sharded.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    run_ranks(SCRIPT, ["save", str(out), "2"])
    return out


@pytest.mark.parametrize(
    "world, stage", [(1, 2), (2, 3), (3, 3), (3, 1)], ids=["2to1_s2", "2to2_s3", "2to3_s3", "2to3_s1"]
)
def test_loads_at_any_world_size_and_stage(saved, world, stage):
    run_ranks(SCRIPT, ["load", str(saved), str(stage)], world_size=world)
    ref = torch.load(saved / "full.ckpt", weights_only=False)
    got = torch.load(saved / f"loaded_{world}_{stage}.pt", weights_only=False)
    assert got["state_dict"].keys() == ref["state_dict"].keys()
    for k, v in ref["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][k], v, rtol=0, atol=0, msg=k)
    ro, go = ref["optimizer_states"][0], got["optimizer"]
    assert go["state"].keys() == ro["state"].keys()
    for idx, st in ro["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(go["state"][idx][key], st[key], rtol=0, atol=0, msg=f"{idx} {key}")
    assert [g["lr"] for g in go["param_groups"]] == [g["lr"] for g in ro["param_groups"]]


def test_each_rank_wrote_only_its_shards(saved):
    index = verify(saved / "sharded")
    assert sorted(index["files"]) == ["rank00000.safetensors", "rank00001.safetensors"]
    sizes = [index["files"][f]["bytes"] for f in sorted(index["files"])]
    full = (saved / "full.ckpt").stat().st_size
    assert max(sizes) < 0.75 * full, (sizes, full)  # about half the parameters and optimizer state each


def test_a_failed_save_leaves_the_previous_checkpoint_whole(saved, tmp_path):
    import shutil

    work = tmp_path / "c"
    shutil.copytree(saved / "sharded", work / "sharded")
    before = verify(work / "sharded")
    with pytest.raises(AssertionError, match="disk full"):
        run_ranks(SCRIPT, ["crash", str(work), "2"])
    assert verify(work / "sharded") == before


def test_missing_and_corrupt_files_are_named(saved, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(saved / "sharded", bad)
    file = resolve(bad).dir / "rank00001.safetensors"  # in the committed version directory
    data = bytearray(file.read_bytes())
    data[-10] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="rank00001.safetensors is corrupt"):
        verify(bad)
    file.write_bytes(bytes(data[:-100]))
    with pytest.raises(ValueError, match="rank00001.safetensors has .* bytes"):
        verify(bad)
    file.unlink()
    with pytest.raises(FileNotFoundError, match="rank00001.safetensors is missing"):
        verify(bad)


def test_consolidate_streams_to_plain_files(saved, tmp_path):
    """`python -m zeroshard.consolidate` gives the state dict the consolidated checkpoint holds, loadable plainly."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from zeroshard.consolidate import consolidate

    ref = torch.load(saved / "full.ckpt", weights_only=False)["state_dict"]
    torch_out = tmp_path / "model.pt"
    env_path = str(Path(__file__).resolve().parents[2] / "python")
    cmd = [sys.executable, "-m", "zeroshard.consolidate", str(saved / "sharded"), str(torch_out), "--format", "torch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={"PYTHONPATH": env_path, "PATH": ""}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plain = torch.load(torch_out)
    assert plain.keys() == ref.keys()
    for k, v in ref.items():
        torch.testing.assert_close(plain[k], v, rtol=0, atol=0, msg=k)

    files = consolidate(saved / "sharded", tmp_path / "st", max_shard_size=20_000, dtype=torch.bfloat16)
    assert len(files) > 1 and (tmp_path / "st" / "model.safetensors.index.json").is_file()
    merged = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert merged.keys() == ref.keys()
    for k, v in ref.items():
        assert merged[k].dtype == (torch.bfloat16 if v.is_floating_point() else v.dtype)
        torch.testing.assert_close(merged[k].float(), v.float(), rtol=1e-2, atol=1e-2, msg=k)
    # the unwrapped model loads it
    from tiny_lm import TinyLM

    TinyLM().load_state_dict(plain)

"""Sharded checkpoints of bf16 and int8 optimizer state (``optimizer_state_dtype``; ``scripts/state_format_ckpt.py``).

* Saved as kept: bf16 moments as BF16, int8 moments as uint8 codes with one fp32 absmax per block of 2048 elements of
  the shard, and the two dynamic maps (``quant.map.*``) so the file can be read without the kernel. No fp32 copy.
  Under int8 the flat parameters of small parameters (under ``min_8bit_size`` = 4096 elements) keep fp32 moments:
  saved as F32, without absmax, beside the others' codes; resume and reshard hold for the mixed state too.
* Same world size and layout: every rank's state loads back bit for bit, and training resumes bit for bit.
* Reshard (2 -> 3 ranks, or stage 2 -> 3 at 2 ranks: other shard boundaries): int8 blocks would straddle the new
  shard boundaries, so the saved codes are turned into their exact fp32 values and requantised over the new shard's
  blocks by the kernel's rule. Deterministic, and checked bit for bit against that rule applied to the saved values
  (not equal to the saved bits: requantising loses what a block's new absmax cannot represent). bf16 reshards exactly.
* The consolidated (torch-format) optimizer state holds fp32 moments for int8 state (exact values: ``moments_fp32``)
  and bf16 moments for bf16 state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_ranks
from safetensors import safe_open

from zeroshard.checkpoint.checkpoint_dir import resolve

SCRIPT = Path(__file__).parent / "scripts" / "state_format_ckpt.py"
FMTS = ("int8", "bf16")
# TinyLM's trainable parameters under 4096 elements (its matrices up/down have 4096: int8)
SMALL = {"embed.weight", "norm.weight", "norm.bias"} | {
    f"blocks.{b}.{n}" for b in (0, 1) for n in ("norm.weight", "norm.bias", "up.bias", "down.bias")
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("state_format_ckpt")
    run_ranks(SCRIPT, ["save", str(out), ",".join(FMTS)])
    return out


def _rank_file(path: Path, rank: int):
    where = resolve(path, "index.json")
    return safe_open(str(where.dir / f"rank{rank:05d}.safetensors"), framework="pt"), json.loads(
        (where.dir / "index.json").read_text()
    )


@pytest.mark.parametrize("fmt", FMTS)
def test_state_is_saved_as_kept(saved, fmt):
    for rank in range(2):
        f, index = _rank_file(saved / fmt / "ckpt", rank)
        with f:
            keys = set(f.keys())
            moments = [k for k in keys if k.endswith((".optim.exp_avg", ".optim.exp_avg_sq"))]
            assert moments
            kept = set()
            for k in moments:
                i = int(k.split(".")[1])
                shard = index["flat_params"][i]["shard_numel"]
                sl = f.get_slice(k)
                # a flat parameter of TinyLM's small parameters only (norms, biases, the 2048-element embedding)
                small = all(n in SMALL for n in index["flat_params"][i]["names"])
                want = "BF16" if fmt == "bf16" else "F32" if small else "U8"
                assert sl.get_dtype() == want and sl.get_shape() == [shard], k
                kept.add(want)
                absmax = f"{k}_absmax"
                if want == "U8":
                    a = f.get_slice(absmax)
                    assert a.get_dtype() == "F32" and a.get_shape() == [-(-shard // 2048)], absmax
                else:
                    assert absmax not in keys
            assert kept == ({"F32", "U8"} if fmt == "int8" else {"BF16"})
            assert ({"quant.map.exp_avg", "quant.map.exp_avg_sq"} <= keys) == (fmt == "int8")
        assert index["optimizer"]["quant_block"] == 2048


@pytest.mark.parametrize("fmt", FMTS)
def test_consolidated_moments(saved, fmt):
    sd = torch.load(saved / fmt / "consolidated.pt")
    assert sd["state"]
    for st in sd["state"].values():
        assert "exp_avg_absmax" not in st and "exp_avg_sq_absmax" not in st
        want = torch.float32 if fmt == "int8" else torch.bfloat16
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == want


def test_resume_bit_for_bit_at_the_same_world_size(saved):
    run_ranks(SCRIPT, ["load", str(saved), ",".join(FMTS), "2"])  # the script compares every state tensor
    for fmt in FMTS:
        report = json.loads((saved / fmt / "loaded_2_2.json").read_text())
        assert report["same_shards"] and report["checked"] > 0
        continued, resumed = torch.load(saved / fmt / "continued.pt"), torch.load(saved / fmt / "resumed.pt")
        torch.testing.assert_close(resumed, continued, rtol=0, atol=0)


@pytest.mark.parametrize("world, stage", [(3, 2), (2, 3)], ids=["2to3_ranks", "stage2to3"])
def test_reshard_requantises_deterministically(saved, world, stage):
    run_ranks(SCRIPT, ["load", str(saved), ",".join(FMTS), str(stage)], world_size=world)
    for fmt in FMTS:
        report = json.loads((saved / fmt / f"loaded_{world}_{stage}.json").read_text())
        assert not report["same_shards"] and report["checked"] > 0, report

"""Hybrid sharding on 4 gloo ranks as 2 shard groups of 2 (``ZeroStrategy(shard_group_size=2)``): stages 1-3 train
like Lightning's DDP (fp32, 20 optimizer steps, gradient accumulation 2 and clipping by the global norm), the
cross-group traffic is the all-reduce of one gradient shard, and a sharded checkpoint written at 2x2 (by one replica
group only, as its index says) resumes at 1x4 (stage 3) and 4x1 (stage 1) like an uninterrupted DDP run. The model's
parameter count divides by neither 3 nor 4, and the plain (1x4) stage 2 run covers ZeRO at world size 4. A 2-D
``(replicate, shard)`` DeviceMesh (FSDP2's form) gives the same layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "fit_runs.py"
WORLD = 4
RTOL, ATOL = 1e-5, 1e-6
STEPS = 20  # 640 samples / 4 ranks / batch 4 = 40 micro-batches = 20 optimizer steps per epoch
TRAINABLE = 18_947


def _rank(tmp: Path, name: str, rank: int) -> dict:
    return json.loads((tmp / f"{name}_rank{rank}.json").read_text())


def _losses(tmp: Path, name: str, rank: int) -> torch.Tensor:
    return torch.tensor(_rank(tmp, name, rank)["losses"], dtype=torch.float64)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hybrid")
    ckpt = str(out / "hybrid_2x2_stage2")
    base = {"odd": True, "accumulate": 2, "clip": 0.05, "samples": 640, "max_epochs": 1}
    runs = [{"name": "ddp", "strategy": "ddp", **base}]
    runs += [{"name": f"h{s}", "strategy": "zeroshard", "stage": s, "shard_group_size": 2, **base} for s in (1, 2, 3)]
    runs[2] |= {"save_ckpt": ckpt, "sharded": True}  # h2
    runs.append({"name": "plain_stage2", "strategy": "zeroshard", "stage": 2, **base})
    runs.append({"name": "mesh_stage3", "strategy": "zeroshard", "stage": 3, "mesh": [2, 2], **base})
    # resumes in the second epoch; the reference is DDP through both epochs
    two = {**base, "max_epochs": 2}
    runs.append({"name": "ddp_2_epochs", "strategy": "ddp", **two})
    runs.append({"name": "resume_1x4", "strategy": "zeroshard", "stage": 3, "resume_from": ckpt, **two})
    runs.append(
        {"name": "resume_4x1", "strategy": "zeroshard", "stage": 1, "shard_group_size": 1, "resume_from": ckpt, **two}
    )
    run_ranks(SCRIPT, [str(out), json.dumps(runs)], world_size=WORLD)
    return out


def _assert_close_run(tmp: Path, ref: str, got: str, offset: int = 0) -> None:
    for rank in range(WORLD):
        a, b = _losses(tmp, ref, rank)[offset:], _losses(tmp, got, rank)
        assert len(a) == len(b) == 2 * STEPS, (ref, got, len(a), len(b))
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m, r=rank: f"{got} vs {ref}, rank {r}: {m}")
    pa, pb = torch.load(tmp / f"{ref}.pt"), torch.load(tmp / f"{got}.pt")
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{got} vs {ref}, {k}: {m}")


@pytest.mark.parametrize("run", ["h1", "h2", "h3", "plain_stage2", "mesh_stage3"])
def test_hybrid_2x2_matches_ddp(world4, run):
    _assert_close_run(world4, "ddp", run)
    assert _losses(world4, "ddp", 0)[-8:].mean() < _losses(world4, "ddp", 0)[:8].mean()


@pytest.mark.parametrize("run", ["h1", "h2", "h3"])
def test_cross_group_traffic_is_one_gradient_shard(world4, run):
    comm = _rank(world4, run, 0)["comm"]
    shard, replicate = comm["groups"]["shard"], comm["groups"]["replicate"]
    assert shard["world_size"] == 2 and replicate["world_size"] == 2
    rep = replicate["last_step"]
    assert rep["all_gather"]["calls"] == rep["reduce_scatter"]["calls"] == 0
    # 2 (Psi / k) (R - 1) / R with k = R = 2: the (padded) gradient shard, once; equal to the in-group reduce-scatter
    psi = 4 * TRAINABLE
    assert psi / 2 <= rep["all_reduce"]["bytes"] <= 1.02 * psi / 2
    assert rep["all_reduce"]["bytes"] == shard["last_step"]["reduce_scatter"]["bytes"]
    assert rep["all_reduce"]["calls"] == shard["last_step"]["reduce_scatter"]["calls"]
    assert comm["last_step"]["all_reduce"] == rep["all_reduce"]  # the summary adds the groups


def test_one_replica_group_writes_and_the_index_says_so(world4):
    from zeroshard.checkpoint.checkpoint_dir import resolve
    from zeroshard.checkpoint.sharded_checkpoint import verify

    ckpt = world4 / "hybrid_2x2_stage2"
    index = verify(ckpt)
    assert sorted(index["files"]) == ["rank00000.safetensors", "rank00001.safetensors"]
    assert (index["world_size"], index["replicate_size"], index["written_by_replica"]) == (2, 2, 0)
    assert not list(resolve(ckpt).dir.glob("rank0000[23].safetensors"))


@pytest.mark.parametrize("run", ["resume_1x4", "resume_4x1"])
def test_checkpoint_saved_at_2x2_resumes_at_other_layouts(world4, run):
    for rank in range(WORLD):
        ref = _losses(world4, "ddp_2_epochs", rank)
        first = _losses(world4, "ddp", rank)
        torch.testing.assert_close(ref[: 2 * STEPS], first, rtol=0, atol=0)  # DDP is deterministic
        got = _losses(world4, run, rank)
        assert len(got) == 2 * STEPS, (run, len(got))
        torch.testing.assert_close(got, ref[2 * STEPS :], rtol=RTOL, atol=ATOL, msg=lambda m: f"{run}: {m}")
    pa, pb = torch.load(world4 / "ddp_2_epochs.pt"), torch.load(world4 / f"{run}.pt")
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{run}, {k}: {m}")

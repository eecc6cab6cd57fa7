"""zeroshard._C.BucketedCollectives on a real torch.distributed gloo group (2 spawned processes), and FlatParamLayout.

Each collective is checked against torch.distributed's own collective or against a sum every rank computes locally
from the other ranks' (deterministic) inputs.
"""

import json
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zeroshard import _C

WORLD = 2
SHARD_NUMELS = [5, 1, 17, 0, 8, 3, 40]
BUCKET_UNITS = [1, 6, 26, 1 << 20]  # in units of world_size elements: all single, splits, one bucket
# A hang guard, not a speed check: each spawned rank imports this module, so zeroshard and Lightning (~10 s alone on
# a loaded 2-core machine, more while `make test` runs two pytest workers there).
TIMEOUT_S = 90.0


def _input(rank, index, numel, dtype=torch.float32):
    """Small integers, exact in bf16; distinct per (rank, tensor, element)."""
    k = torch.arange(numel, dtype=torch.float64)
    sign = 1 if (rank + index) % 2 == 0 else -1
    return (sign * (k.remainder(13) + 3 * index + 17 * rank + 1)).to(dtype)


def _entry(rank, world, store_path, out_dir):
    """One spawned rank: runs every check in order, recording a traceback (or None) per check."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    results = {}
    for name, check in CHECKS.items():
        try:
            check(rank, world)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """Spawns WORLD ranks once for all checks (spawning costs most of the time); kills them after TIMEOUT_S."""
    out = tmp_path_factory.mktemp("gloo")
    ctx = mp.start_processes(
        _entry, args=(WORLD, str(out / "store"), str(out)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"gloo ranks did not finish within {TIMEOUT_S} s")
    results = []
    for r in range(WORLD):
        with open(out / f"rank{r}.json") as f:
            results.append(json.load(f))
    return results


# --- workers (module level so spawn can pickle them) -------------------------------------------------------------


def _all_gather_worker(rank, world):
    bc = _C.BucketedCollectives(dist.group.WORLD)
    assert (bc.rank, bc.world_size) == (rank, world)
    for unit in BUCKET_UNITS:
        shards = [_input(rank, i, n) for i, n in enumerate(SHARD_NUMELS)]
        fulls = [torch.full((world * n,), -999.0) for n in SHARD_NUMELS]
        handle = bc.all_gather(shards, fulls, unit * world)
        handle.wait()
        assert handle.is_completed()
        for i, n in enumerate(SHARD_NUMELS):
            ref = torch.empty(world * n)
            dist.all_gather_into_tensor(ref, shards[i])
            torch.testing.assert_close(fulls[i], ref, rtol=0, atol=0, msg=f"bucket {unit} tensor {i}")
    # In place: each shard is this rank's slice of its full buffer.
    for unit in (1, 1 << 20):
        fulls = [torch.full((world * n,), -999.0, dtype=torch.float64) for n in SHARD_NUMELS]
        shards = [f[rank * n : (rank + 1) * n] for f, n in zip(fulls, SHARD_NUMELS)]
        for i, s in enumerate(shards):
            s.copy_(_input(rank, i, s.numel(), torch.float64))
        bc.all_gather(shards, fulls, unit * world).wait()
        for i, n in enumerate(SHARD_NUMELS):
            ref = torch.cat([_input(r, i, n, torch.float64) for r in range(world)])
            torch.testing.assert_close(fulls[i], ref, rtol=0, atol=0, msg=f"in place bucket {unit} tensor {i}")


def _reduce_scatter_worker(rank, world):
    bc = _C.BucketedCollectives(dist.new_group(list(range(world))))
    for unit in BUCKET_UNITS:
        for full_dtype in (torch.float32, torch.bfloat16):
            for accumulate in (False, True):
                scale = 1.0 / world
                fulls = [_input(rank, i, world * n, full_dtype) for i, n in enumerate(SHARD_NUMELS)]
                shards = [torch.full((n,), 0.25) for n in SHARD_NUMELS]  # fp32 out, also from bf16 in
                bc.reduce_scatter(fulls, shards, unit * world, scale, accumulate).wait()
                for i, n in enumerate(SHARD_NUMELS):
                    total = sum(_input(r, i, world * n, torch.float64)[rank * n : (rank + 1) * n] for r in range(world))
                    ref = (total * scale + (0.25 if accumulate else 0.0)).float()
                    torch.testing.assert_close(
                        shards[i], ref, rtol=1e-6, atol=1e-6, msg=f"{full_dtype} bucket {unit} acc {accumulate} t {i}"
                    )
    # Same dtype in and out, compared with torch's own reduce_scatter_tensor (SUM) scaled by hand.
    fulls = [_input(rank, i, world * n) for i, n in enumerate(SHARD_NUMELS)]
    refs = []
    for f, n in zip(fulls, SHARD_NUMELS):
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, f.clone(), op=dist.ReduceOp.SUM)
        refs.append(out * 0.5)
    shards = [torch.empty(n) for n in SHARD_NUMELS]
    bc.reduce_scatter(fulls, shards, 1 << 20, 0.5, False).wait()
    for i in range(len(SHARD_NUMELS)):
        torch.testing.assert_close(shards[i], refs[i], rtol=1e-6, atol=1e-6)


def _all_reduce_worker(rank, world):
    bc = _C.BucketedCollectives(torch.distributed.distributed_c10d._get_default_group())
    for unit in (1, 7, 30, 1 << 20):
        tensors = [_input(rank, i, 2 * n + 1).view(1, -1) for i, n in enumerate(SHARD_NUMELS)]
        refs = [t.clone() for t in tensors]
        for r in refs:
            dist.all_reduce(r, op=dist.ReduceOp.SUM)
            r.mul_(0.5)
        handle = bc.all_reduce(tensors, unit, 0.5)
        handle.wait()
        handle.wait()  # second wait is a no-op: not scaled twice
        for i, (t, r) in enumerate(zip(tensors, refs)):
            torch.testing.assert_close(t, r, rtol=1e-6, atol=1e-6, msg=f"bucket {unit} tensor {i}")


def _bad_input_worker(rank, world):
    bc = _C.BucketedCollectives(dist.group.WORLD)
    with pytest.raises(RuntimeError, match=r"fulls\[1\] has 5 elements, expected world_size \(2\)"):
        bc.all_gather([torch.zeros(2), torch.zeros(3)], [torch.zeros(4), torch.zeros(5)], 8)
    with pytest.raises(RuntimeError, match=r"shards\[1\] has dtype BFloat16, expected Float"):
        bc.reduce_scatter([torch.zeros(4), torch.zeros(6)], [torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)], 8)
    with pytest.raises(RuntimeError, match=r"tensors\[0\] must be contiguous"):
        bc.all_reduce([torch.zeros(4, 4).t()], 8)
    with pytest.raises(RuntimeError, match="bucket_elems must be >= 1"):
        bc.all_reduce([torch.zeros(4)], 0)
    with pytest.raises(TypeError):
        _C.BucketedCollectives("not a process group")
    # The group still works after the rejected calls (nothing was half-launched).
    t = [torch.ones(3)]
    bc.all_reduce(t, 8).wait()
    torch.testing.assert_close(t[0], torch.full((3,), float(world)))


CHECKS = {
    "all_gather": _all_gather_worker,
    "reduce_scatter": _reduce_scatter_worker,
    "all_reduce": _all_reduce_worker,
    "bad_input": _bad_input_worker,
}


@pytest.mark.parametrize("check", list(CHECKS))
def test_collectives_on_gloo(gloo_results, check):
    for rank, results in enumerate(gloo_results):
        assert results[check] is None, f"rank {rank} failed {check}:\n{results[check]}"


# --- FlatParamLayout ----------------------------------------------------------------------------------------------


def test_flat_layout_sizes_and_slices():
    layout = _C.FlatParamLayout([[3, 5], [10], [], [0], [2, 3]], 2, 4)
    assert layout.num_params == 5
    assert layout.numels == [15, 10, 1, 0, 6]
    assert layout.offsets == [0, 16, 28, 32, 32]
    assert (layout.total_numel, layout.padded_numel, layout.shard_numel) == (38, 40, 20)
    assert layout.shapes == [[3, 5], [10], [], [0], [2, 3]]
    assert layout.shard_range(1) == (20, 40)
    assert layout.shard_slices(0) == [(0, 0, 0, 15), (1, 0, 16, 4)]
    assert layout.shard_slices(1) == [(1, 4, 0, 6), (2, 0, 8, 1), (4, 0, 12, 6)]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_flat_layout_shards_rebuild_every_param(world):
    shapes = [[7, 3], [1], [], [33], [4, 4, 2]]
    layout = _C.FlatParamLayout(shapes, world, 16)
    params = [torch.randn(s) for s in shapes]
    flat = layout.flatten(params)
    assert flat.shape == (layout.padded_numel,) and flat.dtype == torch.float32
    # Rebuild every parameter from the shards alone, through shard_slices (what resharding a checkpoint does).
    rebuilt = [torch.full((p.numel(),), float("nan")) for p in params]
    for r in range(world):
        begin, end = layout.shard_range(r)
        shard = flat[begin:end]
        for index, p_off, s_off, n in layout.shard_slices(r):
            assert 0 <= s_off and s_off + n <= layout.shard_numel
            rebuilt[index][p_off : p_off + n] = shard[s_off : s_off + n]
    for p, q in zip(params, rebuilt):
        torch.testing.assert_close(q.view(p.shape), p, rtol=0, atol=0)
    # Views alias the buffer, copy_out / copy_into round trip, padding is zero.
    views = layout.views(flat)
    views[0].fill_(3.0)
    assert flat[0].item() == 3.0
    outs = [torch.empty(s, dtype=torch.float64) for s in shapes]
    layout.copy_out(flat, outs)
    torch.testing.assert_close(outs[3], params[3].double())
    flat2 = torch.full((layout.padded_numel,), -1.0)
    layout.copy_into(flat2, params)
    assert flat2[layout.total_numel :].eq(-1.0).all()
    assert flat[layout.total_numel :].eq(0.0).all()
    bf16 = layout.flatten(params, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert bf16.dtype == torch.bfloat16


def test_flat_layout_errors():
    with pytest.raises(RuntimeError, match="world_size must be >= 1, got 0"):
        _C.FlatParamLayout([[2]], 0, 1)
    with pytest.raises(RuntimeError, match=r"shapes\[0\] has negative dim 0 = -2"):
        _C.FlatParamLayout([[-2]], 1, 1)
    layout = _C.FlatParamLayout([[2, 2]], 2, 4)
    with pytest.raises(RuntimeError, match="needs padded_numel = 8"):
        layout.views(torch.zeros(7))
    with pytest.raises(RuntimeError, match=r"tensors\[0\] has shape \[4\], the layout expects \[2, 2\]"):
        layout.flatten([torch.zeros(4)])
    with pytest.raises(RuntimeError, match="out of range"):
        layout.shard_slices(2)

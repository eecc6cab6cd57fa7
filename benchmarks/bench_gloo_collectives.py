"""How fast are ZeRO's collectives on gloo? torch's own against zeroshard's all-to-alls (2 CPU ranks).

gloo has no reduce-scatter: torch's ``reduce_scatter_tensor`` on gloo all-reduces the whole buffer and keeps this
rank's chunk (twice the bytes of a reduce-scatter). zeroshard's ``BucketedCollectives.reduce_scatter`` sends chunk r
of every rank's buffer to rank r (``all_to_all_single``) and sums the received chunks locally, in rank order. Its
``all_gather`` is gloo's own (``all_gather_single``): an all-to-all of the shard copied once per rank measured slower
here (0.6-0.9x, its send buffer allocated on every call), so the all-gather rows are the check that ours adds nothing.

Per buffer size (fp32 elements of the full buffer), the median over ``--reps`` calls of each op, in rotating order:
wall ms (the slower rank) and this process's CPU ms (all threads, rank 0), for torch's ``reduce_scatter_tensor`` and
zeroshard's reduce-scatter (launch, wait, local sum and the 1/world scale, as the engine calls it), torch's
``all_gather_into_tensor`` and zeroshard's all-gather (in place, the shard a view of the full buffer, as stages 1-2
gather their parameters), and ``all_reduce`` of the same buffer for scale. Each pair must agree bit for bit (checked
on every size; 2 ranks sum in one order either way); a mismatch fails the run. Writes a table to stdout and JSON with
the command, machine and versions.

    PYTHONPATH=python python benchmarks/bench_gloo_collectives.py            # launches 2 gloo ranks itself
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from rank_launch import machine, versions, worker_or_two_ranks  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="50000,800000,3000000", help="full-buffer elements (fp32), comma-separated")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "gloo_collectives.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _timed(fn, reps: int) -> tuple[list[float], list[float]]:
    wall, cpu = [], []
    for _ in range(reps):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


def _ops(n: int, rank: int, world: int, ours) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The ops over a full buffer of ``n`` fp32 elements, and the outputs each pair must agree on."""
    full = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    work = full.clone()
    torch_out, our_out = torch.empty(n // world), torch.empty(n // world)
    torch_full, our_full = torch.empty(n), torch.empty(n)
    shard = full[rank * (n // world) : (rank + 1) * (n // world)]

    def torch_rs():
        work.copy_(full)  # gloo reduces in place
        dist.reduce_scatter_tensor(torch_out, work)
        torch_out.mul_(1.0 / world)

    def our_rs():
        work.copy_(full)
        ours.reduce_scatter([work], [our_out], n, 1.0 / world, False).wait()

    def torch_ag():
        dist.all_gather_into_tensor(torch_full, shard)

    own = our_full[rank * (n // world) : (rank + 1) * (n // world)]
    own.copy_(shard)  # in place, as stages 1-2 gather: this rank's shard is a view of the full buffer

    def our_ag():
        ours.all_gather([own], [our_full], n).wait()

    def all_reduce():
        work.copy_(full)
        dist.all_reduce(work)

    ops = {
        "torch reduce_scatter_tensor": torch_rs,
        "zeroshard reduce_scatter": our_rs,
        "torch all_gather_into_tensor": torch_ag,
        "zeroshard all_gather": our_ag,
        "all_reduce": all_reduce,
    }
    return ops, [(torch_out, our_out), (torch_full, our_full)]


def worker(args: argparse.Namespace) -> None:
    from zeroshard import _C

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = _C.BucketedCollectives(dist.group.WORLD)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        n -= n % world
        ops, pairs = _ops(n, rank, world, ours)
        for fn in ops.values():
            fn()
        same = all(torch.equal(a, b) for a, b in pairs)
        samples = {name: ([], []) for name in ops}
        for r in range(args.reps):
            names = list(ops)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                w, c = _timed(ops[name], 1)
                samples[name][0].extend(w)
                samples[name][1].extend(c)
        walls = [None] * world
        dist.all_gather_object(walls, {k: v[0] for k, v in samples.items()})
        row = {"elements": n, "mbytes": n * 4 / 1e6, "bitwise_equal": same}
        for name in ops:
            slowest = [max(w[name][i] for w in walls) for i in range(args.reps)]
            cpu = statistics.median(samples[name][1])
            row[name] = {"wall_ms": statistics.median(slowest) * 1e3, "cpu_ms": cpu * 1e3}
        rows.append(row)
    if rank == 0:
        head = f"{'MB':>6} | " + " | ".join(f"{k} wall / CPU ms" for k in rows[0] if isinstance(rows[0][k], dict))
        print(head + " | speed-up RS / AG | equal bits")
        for row in rows:
            cells = [f"{row[k]['wall_ms']:.2f} / {row[k]['cpu_ms']:.2f}" for k in row if isinstance(row[k], dict)]
            rs = row["torch reduce_scatter_tensor"]["wall_ms"] / row["zeroshard reduce_scatter"]["wall_ms"]
            ag = row["torch all_gather_into_tensor"]["wall_ms"] / row["zeroshard all_gather"]["wall_ms"]
            row["speedup_reduce_scatter"], row["speedup_all_gather"] = rs, ag
            line = f"{row['mbytes']:6.1f} | " + " | ".join(cells)
            print(line + f" | {rs:.2f}x / {ag:.2f}x | {row['bitwise_equal']}")
        out = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]).replace(" --worker", ""),
            "machine": machine(),
            "versions": versions(),
            "world_size": world,
            "torch_threads": 1,
            "reps": args.reps,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    bad = [row["elements"] for row in rows if not row["bitwise_equal"]]
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"zeroshard's collectives differ from torch's at sizes {bad}")


if __name__ == "__main__":
    worker_or_two_ranks(Path(__file__), parse_args(), worker)

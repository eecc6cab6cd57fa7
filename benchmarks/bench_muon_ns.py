"""How is Muon's Newton-Schulz work split across ranks: zeroshard's one owner per matrix against DeepSpeed's design,
where every rank all-gathers the momentum and orthogonalises every matrix?

Method: the Muon matrices of the examples' GPT (the blocks' 2-D weights: attention qkv and projection, MLP fc and
projection) are given owners by :func:`zeroshard.sharding.owner_assignment.assign_owners` for each world size N.
FLOPs per rank are :func:`~zeroshard.sharding.owner_assignment.ns_flops` summed over the rank's matrices (5 iterations);
the all-gather design runs all of them on every rank. Measured: torch's ``_zeropower_via_newtonschulz`` (bf16, what
``torch.optim.Muon`` and zeroshard's owner run) timed per matrix (median of ``--reps``) in one process with
``--threads`` threads, then summed per rank: the Newton-Schulz time of the slowest rank, with ranks on separate
devices. On CUDA (``--device cuda``) the timings synchronise the device.

Usage:
    PYTHONPATH=python:examples python benchmarks/bench_muon_ns.py [--n_layer 4 --n_embd 256] [--worlds 1,2,4,8]
        [--reps 5] [--threads 1] [--device cpu|cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

from rank_launch import machine, versions  # noqa: E402


def matrix_shapes(n_layer: int, n_embd: int, n_head: int) -> list[tuple[str, tuple[int, int]]]:
    import torch

    from gpt import GPT, GPTConfig

    with torch.device("meta"):
        gpt = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=128))
    return [(n, tuple(p.shape)) for n, p in gpt.named_parameters() if n.startswith("blocks.") and p.dim() == 2]


def time_ns(shape: tuple[int, int], reps: int, device: str) -> float:
    import torch
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(shape, device=device)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--worlds", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", default=f"benchmarks/results/muon_ns_{socket.gethostname()}.json")
    args = p.parse_args(argv)

    import torch

    from zeroshard.sharding.owner_assignment import assign_owners, ns_flops

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    named = matrix_shapes(args.n_layer, args.n_embd, args.n_head)
    shapes = [s for _, s in named]
    flops = [ns_flops(s) for s in shapes]
    seconds = [time_ns(s, args.reps, args.device) for s in shapes]
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        owners = assign_owners(shapes, world)
        per_rank_flops = [sum(f for f, o in zip(flops, owners) if o == r) for r in range(world)]
        per_rank_s = [sum(t for t, o in zip(seconds, owners) if o == r) for r in range(world)]
        rows.append({
            "world": world,
            "owner_flops_per_rank": per_rank_flops,
            "owner_max_gflop": max(per_rank_flops) / 1e9,
            "allgather_gflop_per_rank": sum(flops) / 1e9,
            "flop_ratio": max(per_rank_flops) / sum(flops),
            "owner_max_ms": 1e3 * max(per_rank_s),
            "allgather_ms_per_rank": 1e3 * sum(seconds),
            "time_ratio": max(per_rank_s) / sum(seconds),
        })  # fmt: skip
    print(f"{len(shapes)} Muon matrices of the GPT ({args.n_layer} x {args.n_embd}): {sorted(set(shapes))}; "
          f"{args.device}, {args.threads} thread(s), load {load_start[0]:.2f}")  # fmt: skip
    header = "| ranks | owner: max GFLOP/rank | all-gather: GFLOP/rank | ratio | owner: max ms/rank | all-gather ms |"
    print(header + " ratio |")
    print(
        "|------:|---------------------:|-----------------------:|------:|-------------------:|--------------:|------:|"
    )
    for r in rows:
        print(f"| {r['world']:5d} | {r['owner_max_gflop']:20.3f} | {r['allgather_gflop_per_rank']:22.3f} | "
              f"{r['flop_ratio']:5.3f} | {r['owner_max_ms']:18.2f} | {r['allgather_ms_per_rank']:13.2f} | "
              f"{r['time_ratio']:5.3f} |")  # fmt: skip
    result = {
        "benchmark": "muon_ns",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(args),
        "machine": machine() | {"load_average_start": load_start, "load_average_end": os.getloadavg()},
        "versions": versions(),
        "matrices": [
            {"name": n, "shape": list(s), "flops": f, "seconds": t} for (n, s), f, t in zip(named, flops, seconds)
        ],  # fmt: skip
        "rows": rows,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

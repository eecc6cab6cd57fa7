"""What does the always-on gather check cost? ZeRO-3 step time with and without the unit tag (CPU, gloo, 2 ranks).

Every stage-3 unit all-gather carries 4 extra elements per rank (the unit's index and phase) on a process group of its
own, and every rank compares the gathered tags before using the buffer (:mod:`zeroshard.sharding.gather_check`). This
times full training steps (forward, backward, AdamW step) of the example GPT (``examples/gpt.py``, one unit per block)
under three engines built side by side over identical models, ``tagged`` (the default), ``untagged`` (the check off:
``gather_check.ENABLED = False`` while that engine is built, all-gathers on the shard group without a tag, as before)
and ``group_only`` (the dedicated group, no tag), one step of each per round in rotating order, so machine load drifts
hit all alike. The cost is the median over rounds of the
per-round ratio ``tagged / untagged - 1``, for the wall clock (the slower rank) and for the CPU time of each
rank's process (every thread, gloo's included; the mean over ranks), which a loaded machine disturbs less. It also
times the parts alone: the 4-element tag all-gather (wall and CPU) and the host-side comparison of one gathered tag.

Run as 2 ranks (each rank a process; rank 0 prints and writes the JSON):

    python benchmarks/bench_gather_check.py                    # launches 2 gloo ranks itself
    python benchmarks/bench_gather_check.py --n_layer 8 --n_embd 512 --rounds 30 --json PATH
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

import zeroshard  # noqa: E402
from gpt import Block  # noqa: E402
from gpt_step_run import GptStepRun  # noqa: E402
from rank_launch import gpt_step_parser, worker_or_two_ranks  # noqa: E402
from zeroshard import ZeroConfig, ZeroEngine  # noqa: E402
from zeroshard.sharding import gather_check  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = gpt_step_parser(
        __doc__.split("\n")[0],
        REPO / "benchmarks" / "results" / "gather_check_cpu.json",
        n_embd=256,
        block_size=128,
        batch=8,
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return p.parse_args(argv)


def make_run(name: str, args: argparse.Namespace) -> GptStepRun:
    def make_engine(model, opt) -> ZeroEngine:
        gather_check.ENABLED = name != "untagged"
        try:
            engine = ZeroEngine(model, opt, ZeroConfig(stage=3, wrap_policy=Block))
        finally:
            gather_check.ENABLED = True
        if name == "group_only":  # the dedicated all-gather group, without the tag
            engine.sharded.tagged = False
        return engine

    return GptStepRun(name, args, make_engine)


def check_alone_us(world: int) -> float:
    """Microseconds of one host-side tag comparison (what every rank adds per all-gather on CPU)."""
    tags = torch.tensor(gather_check.encode(7, False) * world, dtype=torch.bfloat16)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        gather_check.disagreement(tags)
    return (time.perf_counter() - t0) / n * 1e6


# tagged: the default (dedicated all-gather group + tag); untagged: as before the check (shard group, no tag);
# group_only: the dedicated group without the tag, to tell the tag's cost from the group's effect
NAMES = ("tagged", "untagged", "group_only")


def tag_collective_us(collectives, world: int, n: int = 300) -> tuple[float, float]:
    """(wall, CPU) microseconds of one 4-element tag all-gather alone, issued and waited back to back: an upper bound,
    since in a step it overlaps the unit's own all-gather and gloo's threads wait for both at once."""
    shard = torch.tensor(gather_check.encode(7, False), dtype=torch.float32)
    full = torch.empty(world * gather_check.TAG_ELEMS)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        collectives.all_gather([shard], [full], full.numel()).wait()
    return (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = [make_run(name, args) for name in NAMES]
    for _ in range(args.warmup):
        for r in runs:
            r.step(record=False)
    for i in range(args.rounds):
        k = i % len(runs)
        for r in runs[k:] + runs[:k]:  # rotate the order round by round
            r.step(record=True)
    # per-round ratios, paired within a round; the slower rank's time is the step time
    times, cpu = {}, {}
    for r in runs:
        t = torch.tensor(r.step_s, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[r.name] = t.tolist()
        c = torch.tensor(r.cpu_s, dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.SUM)
        cpu[r.name] = (c / world).tolist()
    tagged_units = runs[0].engine.sharded
    tag_wall_us, tag_cpu_us = tag_collective_us(tagged_units.collectives, world)
    gathers = tagged_units.collectives.stats.last_step()["all_gather"]
    units = len(tagged_units.units)
    tag_elem_bytes = tagged_units.units[0].flat_params[0].full.element_size()
    if rank == 0:
        ratios = [a / b - 1 for a, b in zip(times["tagged"], times["untagged"])]
        med = {k: statistics.median(v) for k, v in times.items()}
        cpu_ratios = [a / b - 1 for a, b in zip(cpu["tagged"], cpu["untagged"])]
        cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
        tag_ratios = [a / b - 1 for a, b in zip(times["tagged"], times["group_only"])]
        tag_cpu_ratios = [a / b - 1 for a, b in zip(cpu["tagged"], cpu["group_only"])]
        check_us = check_alone_us(world)
        result = {
            "benchmark": "bench_gather_check",
            "command": " ".join([Path(sys.executable).name, *sys.argv]).replace(" --worker", ""),
            "machine": {
                "host": socket.gethostname(),
                "platform": platform.platform(),
                "processor": platform.processor(),
                "cpu_count": os.cpu_count(),
                "cpu_isa": zeroshard.cpu_isa(),
            },
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "zeroshard": zeroshard.__version__,
            },
            "config": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
            "world_size": world,
            "backend": "gloo",
            "units": units,
            "all_gathers_per_step": gathers["calls"],
            "tag_bytes_per_all_gather_per_rank": gather_check.TAG_ELEMS * tag_elem_bytes,
            "step_ms_median": {k: 1e3 * v for k, v in med.items()},
            "step_ms_all": {k: [1e3 * x for x in v] for k, v in times.items()},
            "overhead_pct_median_of_paired_rounds": 100 * statistics.median(ratios),
            "overhead_pct_of_medians": 100 * (med["tagged"] / med["untagged"] - 1),
            "tag_only_overhead_pct_median_of_paired_rounds": {
                "wall": 100 * statistics.median(tag_ratios),
                "cpu": 100 * statistics.median(tag_cpu_ratios),
            },
            "cpu_ms_per_rank_median": {k: 1e3 * v for k, v in cpu_med.items()},
            "cpu_overhead_pct_median_of_paired_rounds": 100 * statistics.median(cpu_ratios),
            "cpu_overhead_pct_of_medians": 100 * (cpu_med["tagged"] / cpu_med["untagged"] - 1),
            "load_average_1min_at_end": os.getloadavg()[0],
            "tag_all_gather_alone_us": {"wall": tag_wall_us, "cpu": tag_cpu_us},
            "tag_all_gather_cpu_pct_of_step_cpu": 100 * tag_cpu_us * 1e-6 * gathers["calls"] / cpu_med["tagged"],
            "check_alone_us_per_all_gather": check_us,
            "check_alone_pct_of_step": 100 * check_us * 1e-6 * gathers["calls"] / med["tagged"],
        }
        print(f"{'config':<10} {'median step ms':>15} {'median CPU ms/rank':>18}")
        for k, v in med.items():
            print(f"{k:<10} {1e3 * v:>15.2f} {1e3 * cpu_med[k]:>18.2f}")
        print(f"units {units}, all-gathers per step {gathers['calls']}, {args.rounds} paired rounds")
        print(f"overhead (median of paired rounds): {result['overhead_pct_median_of_paired_rounds']:+.2f} %")
        print(f"overhead (ratio of medians):        {result['overhead_pct_of_medians']:+.2f} %")
        print(
            f"CPU-time overhead (median of paired rounds): {result['cpu_overhead_pct_median_of_paired_rounds']:+.2f} %"
        )
        print(f"CPU-time overhead (ratio of medians):        {result['cpu_overhead_pct_of_medians']:+.2f} %")
        tag_only = result["tag_only_overhead_pct_median_of_paired_rounds"]
        print(f"tag alone (tagged vs group_only, paired): wall {tag_only['wall']:+.2f} %, CPU {tag_only['cpu']:+.2f} %")
        tag_pct = result["tag_all_gather_cpu_pct_of_step_cpu"]
        print(
            f"tag all-gather alone: {tag_wall_us:.0f} us wall, {tag_cpu_us:.0f} us CPU; x {gathers['calls']} per step "
            f"= {tag_pct:.2f} % of a step's CPU time"
        )
        print(f"load average at the end: {result['load_average_1min_at_end']:.1f} ({os.cpu_count()} CPUs)")
        print(
            f"tag check alone: {check_us:.1f} us per all-gather = {result['check_alone_pct_of_step']:.3f} % of a step"
        )
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    dist.destroy_process_group()


def main() -> None:
    worker_or_two_ranks(Path(__file__), parse_args(), worker)


if __name__ == "__main__":
    main()

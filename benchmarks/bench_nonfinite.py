"""What does the non-finite gradient check cost? (CPU, gloo, 2 ranks)

With ``nonfinite="error"`` (the default) each reduced gradient shard is summed as its reduce-scatter completes (a
NaN/inf makes the sum non-finite; flagged buckets are re-checked exactly, which costs nothing in a clean step), and
the per-bucket flags travel in the one small all-reduce per step that also carries the used-parameter bitmap
(:mod:`zeroshard.engine.step_flags`); ``"ignore"`` skips the check but keeps that all-reduce (unused parameters need
it). This times full training steps (forward, backward, AdamW step) of the example GPT (``examples/gpt.py``) at
ZeRO stages 2 and 3 under three engines built side by side over identical models: ``error``, ``ignore``, and
``no_flags`` (``"ignore"`` with the step-flags all-reduce removed: the engine before this change), one step of each per
round in rotating order, so load drifts hit all alike. The cost is the median over rounds of the per-round ratio
``error / ignore - 1`` (wall clock of the slower rank, and CPU time of each rank's process); ``flags / no_flags - 1``
is the all-reduce's. It also times the parts alone: the check of every reduced shard, and the flags all-reduce.

    python benchmarks/bench_nonfinite.py                    # launches 2 gloo ranks itself
    python benchmarks/bench_nonfinite.py --n_layer 8 --rounds 30 --json PATH
"""

from __future__ import annotations

import argparse
import json
import os
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
from rank_launch import gpt_step_parser, machine, versions, worker_or_two_ranks  # noqa: E402
from zeroshard import ZeroConfig, ZeroEngine  # noqa: E402
from zeroshard.engine.engine import _comm_device  # noqa: E402
from zeroshard.engine.step_flags import exchange_flags  # noqa: E402

NAMES = ("error", "ignore", "no_flags")


def parse_args(argv=None) -> argparse.Namespace:
    p = gpt_step_parser(__doc__.split("\n")[0], REPO / "benchmarks" / "results" / "nonfinite_cpu.json")
    p.add_argument("--stages", default="2,3")
    return p.parse_args(argv)


def make_run(name: str, stage: int, args: argparse.Namespace) -> GptStepRun:
    def make_engine(model, opt) -> ZeroEngine:
        wrap = Block if stage == 3 else None
        config = ZeroConfig(stage=stage, wrap_policy=wrap, nonfinite="error" if name == "error" else "ignore")
        engine = ZeroEngine(model, opt, config)
        if name == "no_flags":  # no step-flags all-reduce: the engine before non-finite and unused-parameter checks
            engine._check_step_flags = engine.reducer.take_flags
        return engine

    return GptStepRun(name, args, make_engine)


def parts_us(run: GptStepRun, n: int = 100) -> dict[str, float]:
    """Microseconds of each part alone: ``check`` (the NaN/inf test of every flat parameter's gradient-shard-sized
    buffer, as the reducer runs it after each reduce-scatter: a sum, flagged when not finite) and
    ``flags_all_reduce`` (the exchange, 2 ranks)."""
    engine = run.engine
    shards = [torch.randn(fp.layout.shard_numel) for fp in engine.flat_params]
    t0 = time.perf_counter()
    for _ in range(n):  # as GradReducer: a sum per reduced shard, then one flag per bucket
        bad = torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for g in shards])).logical_not().float()
    check = (time.perf_counter() - t0) / n * 1e6
    used = [set(range(len(fp.params))) for fp in engine.flat_params]
    sizes = [len(fp.params) for fp in engine.flat_params]
    group = engine.groups.world
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        exchange_flags(bad, used, sizes, group, _comm_device(group), step=0)
    flags = (time.perf_counter() - t0) / n * 1e6
    return {"check": check, "flags_all_reduce": flags}


def _pct(a: list[float], b: list[float]) -> float:
    return 100 * statistics.median([x / y - 1 for x, y in zip(a, b)])


def measure(stage: int, args: argparse.Namespace, world: int) -> dict:
    runs = [make_run(name, stage, args) for name in NAMES]
    for _ in range(args.warmup):
        for r in runs:
            r.step(record=False)
    for i in range(args.rounds):
        order = runs[i % len(runs) :] + runs[: i % len(runs)]
        for r in order:
            r.step(record=True)
    times, cpu = {}, {}
    for r in runs:
        t = torch.tensor(r.step_s, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[r.name] = t.tolist()
        c = torch.tensor(r.cpu_s, dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.SUM)
        cpu[r.name] = (c / world).tolist()
    med = {k: statistics.median(v) for k, v in times.items()}
    parts = parts_us(runs[0])
    engine = runs[0].engine
    return {
        "stage": stage,
        "trainable_parameter_tensors": sum(len(fp.params) for fp in engine.flat_params),
        "flat_parameters": len(engine.flat_params),
        "gradient_shard_elements": sum(fp.layout.shard_numel for fp in engine.flat_params),
        "step_ms_median": {k: 1e3 * v for k, v in med.items()},
        "check_overhead_pct_median_of_paired_rounds": _pct(times["error"], times["ignore"]),
        "check_cpu_overhead_pct_median_of_paired_rounds": _pct(cpu["error"], cpu["ignore"]),
        "flags_all_reduce_overhead_pct_median_of_paired_rounds": _pct(times["ignore"], times["no_flags"]),
        "parts_us": parts,
        "check_pct_of_step": 100 * parts["check"] * 1e-6 / med["error"],
        "flags_all_reduce_pct_of_step": 100 * parts["flags_all_reduce"] * 1e-6 / med["error"],
    }


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    load_start = os.getloadavg()
    rows = [measure(int(s), args, world) for s in args.stages.split(",")]
    if rank == 0:
        result = {
            "benchmark": "bench_nonfinite",
            "command": " ".join([Path(sys.executable).name, *sys.argv]).replace(" --worker", ""),
            "machine": machine(),
            "versions": {**versions(), "zeroshard": zeroshard.__version__},
            "config": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
            "world_size": world,
            "backend": "gloo",
            "rows": rows,
            "load_average_at_start": load_start,
            "load_average_at_end": os.getloadavg(),
        }
        print(
            f"{'stage':>5} {'error ms':>8} {'ignore ms':>9} {'no_flags ms':>11} {'check %':>8} {'CPU %':>6} "
            f"{'flags %':>8} {'check us':>8} {'allred us':>9} {'check %step':>11} {'allred %step':>12}"
        )
        for r in rows:
            ms = r["step_ms_median"]
            print(
                f"{r['stage']:>5} {ms['error']:>8.2f} {ms['ignore']:>9.2f} {ms['no_flags']:>11.2f} "
                f"{r['check_overhead_pct_median_of_paired_rounds']:>+8.2f} "
                f"{r['check_cpu_overhead_pct_median_of_paired_rounds']:>+6.2f} "
                f"{r['flags_all_reduce_overhead_pct_median_of_paired_rounds']:>+8.2f} {r['parts_us']['check']:>8.1f} "
                f"{r['parts_us']['flags_all_reduce']:>9.1f} {r['check_pct_of_step']:>11.3f} "
                f"{r['flags_all_reduce_pct_of_step']:>12.3f}"
            )
        print(
            f"{args.rounds} rotating rounds; load average (1, 5, 15 min) at the start {load_start}, at the end "
            f"{result['load_average_at_end']}"
        )
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    dist.destroy_process_group()


def main() -> None:
    worker_or_two_ranks(Path(__file__), parse_args(), worker)


if __name__ == "__main__":
    main()

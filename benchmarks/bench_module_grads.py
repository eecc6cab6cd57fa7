"""What does exposing ``param.grad`` cost when nobody reads it, and what does a read cost? (CPU, gloo, 2 ranks)

After each backward the engine puts a :class:`~zeroshard.sharding.sharded_grad.ShardedGradient` in every trainable
parameter's ``.grad``, a gradient hook per parameter clears it before the next backward accumulates, and a step
pre-hook writes replaced gradients into the shards (:mod:`zeroshard.engine.module_grads`). This times full training
steps (forward, backward, AdamW step) of the example GPT (``examples/gpt.py``) at ZeRO stages 2 and 3 under two engines
built side by side over identical models: ``exposed`` (the default) and ``hidden`` (the same engine with those hooks
removed and the install a no-op: what the engine did before), one step of each per round in rotating order, so load
drifts hit both alike. The cost is the median over rounds of the per-round ratio ``exposed / hidden - 1`` (wall clock
of the slower rank, and CPU time of each rank's process). It also times the per-step parts alone (install, sync, clear)
and a read: Lightning's ``grad_norm(model)`` on every rank (it all-gathers each flat parameter's gradient once),
against the step.

    python benchmarks/bench_module_grads.py                    # launches 2 gloo ranks itself
    python benchmarks/bench_module_grads.py --n_layer 8 --rounds 30 --json PATH
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import grad_norm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

import zeroshard  # noqa: E402
from gpt import Block  # noqa: E402
from gpt_step_run import GptStepRun  # noqa: E402
from rank_launch import gpt_step_parser, machine, versions, worker_or_two_ranks  # noqa: E402
from zeroshard import ZeroConfig, ZeroEngine  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = gpt_step_parser(__doc__.split("\n")[0], REPO / "benchmarks" / "results" / "module_grads_cpu.json")
    p.add_argument("--stages", default="2,3")
    return p.parse_args(argv)


def make_run(name: str, stage: int, args: argparse.Namespace) -> GptStepRun:
    def make_engine(model, opt) -> ZeroEngine:
        engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, wrap_policy=Block if stage == 3 else None))
        if name == "hidden":  # the engine as it was before param.grad was exposed
            engine.module_grads.remove_hooks()
            engine.module_grads.install = lambda synced: None
        return engine

    return GptStepRun(name, args, make_engine)


def read_grad_norm(run: GptStepRun) -> Callable[[], None]:
    """Lightning's grad_norm on the model, as a callback reading every .grad between backward and the step would."""

    def read() -> None:
        assert grad_norm(run.model, norm_type=2), "grad_norm found no gradient"

    return read


def bookkeeping_us(run: GptStepRun, n: int = 200) -> dict[str, float]:
    """Microseconds of each per-step part alone, after a backward (so every flat parameter has a gradient to expose):
    ``install`` (placeholders into every trainable parameter's .grad), ``sync`` (the identity check before the step)
    and ``clear`` (back to None after it)."""
    engine, mg = run.engine, run.engine.module_grads
    engine.begin_step()
    logits = run.model(run.x)
    logits.float().mean().backward()
    engine.finish_backward()
    out = {"install": 0.0, "sync": 0.0, "clear": 0.0}
    for _ in range(n):
        for part, call in (("install", lambda: mg.install(True)), ("sync", mg.sync), ("clear", mg.clear)):
            t0 = time.perf_counter()
            call()
            out[part] += (time.perf_counter() - t0) / n * 1e6
    engine.optimizer.zero_grad()
    engine.after_step()
    return out


def measure(stage: int, args: argparse.Namespace, world: int) -> dict:
    runs = [make_run(name, stage, args) for name in ("exposed", "hidden")]
    for _ in range(args.warmup):
        for r in runs:
            r.step(record=False)
    for i in range(args.rounds):
        for r in runs if i % 2 == 0 else runs[::-1]:
            r.step(record=True)
    times, cpu = {}, {}
    for r in runs:
        t = torch.tensor(r.step_s, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[r.name] = t.tolist()
        c = torch.tensor(r.cpu_s, dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.SUM)
        cpu[r.name] = (c / world).tolist()
    exposed = runs[0]
    # a step that reads every gradient (the install under test; after a backward, so gradients exist)
    exposed.step(record=False, after_backward=read_grad_norm(exposed))
    reads = [exposed.step(record=False, after_backward=read_grad_norm(exposed)) for _ in range(5)]
    n_params = sum(len(fp.params) for fp in exposed.engine.flat_params)
    parts = bookkeeping_us(exposed)
    inst = sum(parts.values())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "stage": stage,
        "trainable_parameters_tensors": n_params,
        "flat_parameters": len(exposed.engine.flat_params),
        "step_ms_median": {k: 1e3 * v for k, v in med.items()},
        "overhead_pct_median_of_paired_rounds": 100
        * statistics.median([a / b - 1 for a, b in zip(times["exposed"], times["hidden"])]),
        "cpu_overhead_pct_median_of_paired_rounds": 100
        * statistics.median([a / b - 1 for a, b in zip(cpu["exposed"], cpu["hidden"])]),
        "bookkeeping_us": parts,
        "bookkeeping_us_total": inst,
        "bookkeeping_us_per_parameter": inst / n_params,
        "bookkeeping_pct_of_step": 100 * inst * 1e-6 / med["exposed"],
        "grad_norm_read_ms_median": 1e3 * statistics.median(reads),
        "grad_norm_read_pct_of_step": 100 * statistics.median(reads) / med["exposed"],
    }


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [measure(int(s), args, world) for s in args.stages.split(",")]
    if rank == 0:
        result = {
            "benchmark": "bench_module_grads",
            "command": " ".join([Path(sys.executable).name, *sys.argv]).replace(" --worker", ""),
            "machine": machine(),
            "versions": {**versions(), "zeroshard": zeroshard.__version__},
            "config": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
            "world_size": world,
            "backend": "gloo",
            "rows": rows,
            "load_average_1min_at_end": os.getloadavg()[0],
        }
        print(
            f"{'stage':>5} {'params':>6} {'exposed ms':>10} {'hidden ms':>9} {'overhead %':>10} {'CPU ovh %':>9} "
            f"{'bookkeep us':>11} {'us/param':>8} {'grad_norm ms':>12} {'% of step':>9}"
        )
        for r in rows:
            print(
                f"{r['stage']:>5} {r['trainable_parameters_tensors']:>6} {r['step_ms_median']['exposed']:>10.2f} "
                f"{r['step_ms_median']['hidden']:>9.2f} {r['overhead_pct_median_of_paired_rounds']:>+10.2f} "
                f"{r['cpu_overhead_pct_median_of_paired_rounds']:>+9.2f} {r['bookkeeping_us_total']:>11.1f} "
                f"{r['bookkeeping_us_per_parameter']:>8.2f} {r['grad_norm_read_ms_median']:>12.2f} "
                f"{r['grad_norm_read_pct_of_step']:>9.1f}"
            )
        print(f"{args.rounds} paired rounds; load average at the end {result['load_average_1min_at_end']:.1f}")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    dist.destroy_process_group()


def main() -> None:
    worker_or_two_ranks(Path(__file__), parse_args(), worker)


if __name__ == "__main__":
    main()

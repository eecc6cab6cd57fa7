"""Where does a ZeRO stage-3 step spend what DDP does not? A profile of both on CPU (2 gloo ranks).

Both train the examples' GPT (``examples/gpt.py``, fp32) with AdamW in two param groups (decay / no decay, as
``examples/lit_gpt.py``), one step of each per round on a fixed batch per rank, in rotating order so machine load hits
both alike: stage 3 is ``ZeroEngine(stage=3, wrap_policy=Block)``, DDP is ``torch.nn.parallel.DistributedDataParallel``.
Timed rounds give the median step (wall, the slower rank; CPU time of each rank's process, all threads) and the median
of the per-round ratios stage 3 / DDP. Then ``--profile_steps`` steps of each run under ``torch.profiler`` (CPU, memory
events) give, per step:

* per unit event (the runtime's profiler ranges ``zeroshard::pre_forward``, ``post_forward``, ``pre_backward``,
  ``post_backward``, ``root_pre_forward``, ``root_post_forward``): calls, mean microseconds of the range, of that the
  wait for an all-gather (``zeroshard::all_gather_wait``: time blocked on the collective, a wait a prefetch could
  hide), and the rest, the CPU time of the event itself (Python, tag check, buffer allocation, copies);
* allocations from torch's CPU allocator of at least 64 KiB (all of the step's, and those the size of a unit's gathered
  buffers: flat parameters' full buffers and the all-gather staging buffer), count and MiB, as the profiler attributes
  them to ops (several in one op count once); with the buffer cache (issue 22) its reuses and fresh blocks instead;
* collectives: the engine's count (``engine.comm_stats()``, last step) and the backend's (profiler ranges ``gloo:*``).

The profiler adds its own cost to every range and op (a few microseconds each), so the event times are upper bounds,
and its "CPU us per event (rest)" is wall time: the all-gather's own work and whatever the scheduler gives gloo's
threads meanwhile. The Python time per unit event is measured apart, without the profiler: ``--clock_steps`` more
stage-3 steps with an :class:`~zeroshard.sharding.event_clock.EventClock` attached
(``engine.sharded.time_events(clock)``). Each event's sample is the main thread's CPU time (``time.thread_time_ns``,
this thread only: gloo's worker threads and time spent descheduled are not in it) from the hook's entry to its exit,
minus the same clock's deltas around each all-gather launch and ``.wait()`` made inside it: what is left is our Python
and the small torch ops it calls (views, autograd function application, the tag check's host read). Samples of both
ranks are pooled; the table gives their count per step and rank, median and 90th percentile, with the clock's own
cost per sample (an empty timed call, median) alongside: it is inside every sample and not subtracted.
Writes one entry ``--label`` (e.g. ``before`` / ``after``) into ``--json`` (other labels kept) and the table of all
entries to the same path with ``.md``.

    PYTHONPATH=python python benchmarks/bench_stage3_profile.py --label after   # launches 2 gloo ranks itself
    python benchmarks/bench_stage3_profile.py --n_layer 16 --n_embd 64 --label after_16x64
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
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

from gpt import GPT, Block, GPTConfig  # noqa: E402
from rank_launch import gpt_step_parser, machine, versions, worker_or_two_ranks  # noqa: E402
from zeroshard import ZeroConfig, ZeroEngine  # noqa: E402

EVENTS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "root_pre_forward", "root_post_forward")
WAIT = "zeroshard::all_gather_wait"
BIG = 64 * 1024  # bytes: an allocation worth counting (a gathered block, a gradient, an activation)


def parse_args(argv=None) -> argparse.Namespace:
    p = gpt_step_parser(
        __doc__.split("\n")[0],
        REPO / "benchmarks" / "results" / "stage3_profile.json",
        n_embd=256,
        block_size=128,
        batch=4,
        rounds=20,
    )
    p.add_argument("--label", default="current", help="name of this entry in the JSON (before, after, ...)")
    p.add_argument("--profile_steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--clock_steps", type=int, default=10, help="stage-3 steps timed by the event clock")
    p.add_argument(
        "--prefetch_bucket_size",
        type=int,
        default=None,
        help="ZeroConfig.prefetch_bucket_size (elements); default: the engine's (not passed, so older checkouts run)",
    )
    return p.parse_args(argv)


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


class Run:
    """One model and its optimizer under ``kind`` ("stage3" or "ddp"), stepped on this rank's fixed batch."""

    def __init__(self, kind: str, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
        self.kind = kind
        model = GPT(cfg)
        self.engine = None
        if kind == "stage3":
            size = args.prefetch_bucket_size
            bucket = {} if size is None else {"prefetch_bucket_size": size}
            self.engine = ZeroEngine(
                model,
                torch.optim.AdamW(_groups(model), lr=1e-4),
                ZeroConfig(stage=3, wrap_policy=Block, **bucket),
            )
            self.model, self.opt = model, self.engine.optimizer
        else:
            self.model = torch.nn.parallel.DistributedDataParallel(model)
            self.opt = torch.optim.AdamW(_groups(model), lr=1e-4)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        self.x = torch.randint(0, cfg.vocab_size, (args.batch, args.block_size), generator=g)
        self.step_s: list[float] = []
        self.cpu_s: list[float] = []

    def step(self, record: bool = True) -> None:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if self.engine is not None:
            self.engine.begin_step()
        logits = self.model(self.x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), self.x[:, 1:].reshape(-1))
        loss.backward()
        if self.engine is not None:
            self.engine.finish_backward()
        self.opt.step()
        self.opt.zero_grad()
        if self.engine is not None:
            self.engine.after_step()
        if record:
            self.step_s.append(time.perf_counter() - t0)
            self.cpu_s.append(time.process_time() - c0)


def _waits_us(evt) -> float:
    """Microseconds of ``evt``'s descendants that are all-gather waits."""
    total = 0.0
    for child in evt.cpu_children:
        total += child.time_range.elapsed_us() if child.name == WAIT else _waits_us(child)
    return total


def gathered_sizes(run: Run) -> set[int]:
    """Byte sizes of the buffers a unit gather allocates: each flat parameter's full buffer and the staging buffer
    of a unit with several buffers in its all-gather (its flat parameters, and the tag when it rides along)."""
    if run.engine is None:
        return set()
    sizes = set()
    for unit in run.engine.sharded.units:
        fulls = [fp.full_nbytes for fp in unit.flat_params]
        sizes.update(fulls)
        elem = unit.flat_params[0].full.element_size()
        sizes.update({sum(fulls), sum(fulls) + 4 * elem * run.engine.world_size})
    return sizes


def _cache_stats() -> dict | None:
    from zeroshard import _C

    return _C.buffer_cache_stats() if hasattr(_C, "buffer_cache_stats") else None  # absent before issue 22


def clock_run(run: Run, steps: int) -> dict | None:
    """Python CPU time per unit event (EventClock, see the module docstring), both ranks' samples pooled; None for
    ``steps=0`` (also what a checkout from before the event clock can run)."""
    if steps == 0:
        return None
    from zeroshard.sharding.event_clock import EventClock

    clock = EventClock()
    run.engine.sharded.time_events(clock)
    try:
        for _ in range(steps):
            run.step(record=False)
    finally:
        run.engine.sharded.time_events(None)
    every: list[dict] = [None] * dist.get_world_size()
    dist.all_gather_object(every, clock.samples)
    table = {}
    for name in EVENTS:
        ns = sorted(x for samples in every for x in samples.get(name, []))
        if not ns:
            continue
        table[name] = {
            "per_step": len(ns) / steps / len(every),
            "us_median": ns[len(ns) // 2] / 1e3,
            "us_p90": ns[min(len(ns) - 1, int(0.9 * len(ns)))] / 1e3,
            "us_max": ns[-1] / 1e3,
        }
    return {"steps": steps, "clock_overhead_us": clock.overhead_ns() / 1e3, "events": table}


def profile_run(run: Run, steps: int) -> dict:
    cache0 = _cache_stats()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            run.step(record=False)
    cache1 = _cache_stats()
    events = prof.events()
    table = {}
    for name in EVENTS:
        hits = [e for e in events if e.name == f"zeroshard::{name}"]
        if not hits:
            continue
        total = sum(e.time_range.elapsed_us() for e in hits)
        wait = sum(_waits_us(e) for e in hits)
        table[name] = {
            "per_step": len(hits) / steps,
            "us_mean": total / len(hits),
            "wait_us_mean": wait / len(hits),
            "cpu_us_mean": (total - wait) / len(hits),
        }
    # bytes taken from torch's CPU allocator, attributed to the op that took them (or "[memory]" outside ops, e.g. a
    # storage resize_); the buffer cache's blocks are not reported to the profiler: its reuses are counted below
    allocs = [e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage >= BIG]
    sizes = gathered_sizes(run)
    gathered = [b for b in allocs if b in sizes]
    backend: dict[str, float] = {}
    for e in events:
        if e.name.startswith("gloo:"):
            backend[e.name] = backend.get(e.name, 0) + 1 / steps
    out = {
        "unit_events": table,
        "allocations_per_step": {
            "at_least_64KiB": len(allocs) / steps,
            "at_least_64KiB_MiB": sum(allocs) / steps / 2**20,
            "gathered_buffers": len(gathered) / steps,
            "gathered_buffers_MiB": sum(gathered) / steps / 2**20,
        },
        "backend_collectives_per_step": backend,
        "self_cpu_us_per_step": _self_cpu(prof, steps),
    }
    if cache0 is not None and run.engine is not None:
        out["buffer_cache_per_step"] = {
            "reused": (cache1["hits"] - cache0["hits"]) / steps,
            "fresh": (cache1["misses"] - cache0["misses"]) / steps,
            "cached_MiB_at_end": cache1["cached_bytes"] / 2**20,
        }
    if run.engine is not None:
        last = run.engine.comm_stats()["last_step"]
        out["engine_collectives_per_step"] = {k: v["calls"] for k, v in last.items()}
        out["units"] = len(run.engine.sharded.units)
    return out


def _self_cpu(prof, steps: int) -> dict[str, float]:
    """Self CPU microseconds per step of every op and range (main thread's view: an op's own time, its children's
    excluded), the largest first."""
    rows = {e.key: e.self_cpu_time_total / steps for e in prof.key_averages()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def _top_ops(p3: dict, pd: dict, n: int = 12) -> list[str]:
    """The ops where stage 3 spends the most self CPU beyond DDP, per step."""
    s3, sd = p3.get("self_cpu_us_per_step"), pd.get("self_cpu_us_per_step")
    if not s3 or not sd:
        return []
    diff = sorted(((k, v - sd.get(k, 0.0)) for k, v in s3.items()), key=lambda kv: -kv[1])[:n]
    lines = ["", "| op (self CPU, main thread) | stage 3 us/step | DDP us/step | more |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {s3[k]:.0f} | {sd.get(k, 0.0):.0f} | {d:.0f} |" for k, d in diff]
    return lines


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = [Run("stage3", args), Run("ddp", args)]
    for _ in range(args.warmup):
        for r in runs:
            r.step(record=False)
    for i in range(args.rounds):
        k = i % len(runs)
        for r in runs[k:] + runs[:k]:
            r.step()
    wall, cpu = {}, {}
    for r in runs:
        t = torch.tensor(r.step_s, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        c = torch.tensor(r.cpu_s, dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.SUM)
        wall[r.kind], cpu[r.kind] = t.tolist(), (c / world).tolist()
    python_us = clock_run(runs[0], args.clock_steps)
    profiles = {r.kind: profile_run(r, args.profile_steps) for r in runs}
    if rank == 0:
        entry = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]).replace(" --worker", ""),
            "machine": machine(),
            "versions": versions(),
            "config": {k: v for k, v in vars(args).items() if k not in ("worker", "json", "label")},
            "world_size": world,
            "load_average_1min_at_end": os.getloadavg()[0],
            "step_ms_median": {k: 1e3 * statistics.median(v) for k, v in wall.items()},
            "cpu_ms_median": {k: 1e3 * statistics.median(v) for k, v in cpu.items()},
            "ddp_over_stage3_median_of_rounds": statistics.median(d / s for s, d in zip(wall["stage3"], wall["ddp"])),
            "python_us_per_event": python_us,
            "profile": profiles,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[args.label] = entry
        path.write_text(json.dumps(data, indent=1) + "\n")
        path.with_suffix(".md").write_text(markdown(data))
        print(markdown({args.label: entry}))
        print(f"wrote {path} and {path.with_suffix('.md')}")
    dist.destroy_process_group()


def markdown(data: dict) -> str:
    """The table of every entry: step times, unit events, allocations, collectives."""
    lines = ["# Stage 3 against DDP: profile per step (bench_stage3_profile.py)", ""]
    for label, e in data.items():
        c = e["config"]
        p3, pd = e["profile"]["stage3"], e["profile"]["ddp"]
        lines += [
            f"## {label}: {c['n_layer']} layers x {c['n_embd']}, batch {c['batch']} x {c['block_size']}, "
            f"{e['world_size']} gloo ranks, load average {e['load_average_1min_at_end']:.1f}",
            "",
            f"`{e['command']}`",
            "",
            f"Median step: stage 3 {e['step_ms_median']['stage3']:.1f} ms, DDP {e['step_ms_median']['ddp']:.1f} ms; "
            f"stage 3 speed / DDP (median of paired rounds) {e['ddp_over_stage3_median_of_rounds']:.3f}. "
            f"CPU per rank: stage 3 {e['cpu_ms_median']['stage3']:.1f} ms, DDP {e['cpu_ms_median']['ddp']:.1f} ms: "
            f"{_beyond_ddp_us(e):.0f} us more per unit event (pre/post forward and backward of the blocks; "
            "all threads, gloo's included).",
            "",
            "| unit event | per step | us per event | of which all-gather wait | CPU us per event (rest) |",
            "|---|---|---|---|---|",
        ]
        for name, row in p3["unit_events"].items():
            lines.append(
                f"| {name} | {row['per_step']:.0f} | {row['us_mean']:.0f} | {row['wait_us_mean']:.0f} | "
                f"{row['cpu_us_mean']:.0f} |"
            )
        lines += _python_table(e.get("python_us_per_event"))
        a3, ad = p3["allocations_per_step"], pd["allocations_per_step"]
        lines += [
            "",
            "| per step | stage 3 | DDP |",
            "|---|---|---|",
            f"| allocations >= 64 KiB | {a3['at_least_64KiB']:.0f} ({a3['at_least_64KiB_MiB']:.1f} MiB) | "
            f"{ad['at_least_64KiB']:.0f} ({ad['at_least_64KiB_MiB']:.1f} MiB) |",
            f"| of which gathered buffers | {a3['gathered_buffers']:.0f} ({a3['gathered_buffers_MiB']:.1f} MiB) | - |",
            f"| buffer cache: reused, fresh | {_fmt_cache(p3.get('buffer_cache_per_step'))} | - |",
            f"| engine collectives | {_fmt(p3.get('engine_collectives_per_step', {}))} | - |",
            f"| backend collectives | {_fmt(p3['backend_collectives_per_step'])} | "
            f"{_fmt(pd['backend_collectives_per_step'])} |",
        ]
        lines += _top_ops(p3, pd) + [""]
    lines += _python_summary(data)
    return "\n".join(lines)


def _python_summary(data: dict) -> list[str]:
    """One table of every entry's Python us per unit event (median / p90), for before/after comparisons."""
    rows = [(label, e) for label, e in data.items() if e.get("python_us_per_event")]
    if not rows:
        return []
    names = EVENTS[:4]
    lines = [
        "## Python CPU us per unit event, every entry (median / p90; main thread, all-gathers excluded)",
        "",
        "| entry | model | load | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for label, e in rows:
        ev = e["python_us_per_event"]["events"]
        cells = [f"{ev[n]['us_median']:.0f} / {ev[n]['us_p90']:.0f}" if n in ev else "-" for n in names]
        c = e["config"]
        lines.append(
            f"| {label} | {c['n_layer']} x {c['n_embd']} | {e['load_average_1min_at_end']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines + [""]


def _python_table(py: dict | None) -> list[str]:
    """The event clock's table: main-thread CPU us per unit event, all-gathers excluded (absent in older entries)."""
    if py is None:
        return []
    lines = [
        "",
        f"Python (main-thread CPU, all-gather launch and wait excluded) per unit event, {py['steps']} steps, both "
        f"ranks pooled; the clock's own cost, inside every sample: {py['clock_overhead_us']:.1f} us.",
        "",
        "| unit event | per step | Python us median | p90 | max |",
        "|---|---|---|---|---|",
    ]
    for name, row in py["events"].items():
        lines.append(
            f"| {name} | {row['per_step']:.0f} | {row['us_median']:.1f} | {row['us_p90']:.1f} | {row['us_max']:.0f} |"
        )
    return lines


def _beyond_ddp_us(e: dict) -> float:
    """Median CPU time per rank and step that stage 3 adds to DDP, per unit event (4 per block and step)."""
    events = sum(e["profile"]["stage3"]["unit_events"].get(k, {}).get("per_step", 0) for k in EVENTS[:4])
    return 1e3 * (e["cpu_ms_median"]["stage3"] - e["cpu_ms_median"]["ddp"]) / max(events, 1)


def _fmt_cache(c: dict | None) -> str:
    return "no cache" if c is None else f"{c['reused']:.0f}, {c['fresh']:.0f}"


def _fmt(counts: dict) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in counts.items() if v) or "0"


def main() -> None:
    worker_or_two_ranks(Path(__file__), parse_args(), worker)


if __name__ == "__main__":
    main()

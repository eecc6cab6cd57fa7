"""What does the offloaded step cost, and how much of it does stepping buckets during backward hide? (CPU)

One process (gloo, world size 1), an MLP of ``--layers`` Linear(width, width) layers (one bucket each), fp32. Configs,
timed in interleaved rounds (one step of each per round, ratios paired within a round):
  ``no_offload``: ZeRO-2, torch AdamW(fused=True) on the master shards;
  ``offload``: ZeRO-2 + optimizer offload, the whole CPU step after backward;
  ``offload_overlap``: the same with ``overlap_step=True`` (buckets stepped on a host worker during backward);
  ``offload_clip``: offload + clipping at max_norm 1.0 (coefficient folded into the kernel; step after backward).
It also times, on one ``--numel`` buffer, the costs behind the choice between folding the clip coefficient into the
step and SuperOffload-style speculation: the fused step alone, the step plus a separate clip pass over the gradient
(``g.mul_``), and the step plus the backup of p, m, v that a bitwise rollback needs.

On this 2-core CPU backward and the CPU step share the cores, so overlap gains less than on a GPU host, where
backward runs on the GPU. GPU figures need bench_offload.py on a GPU.

Usage: python benchmarks/bench_overlap.py [--layers 8] [--width 1024] [--batch 512] [--rounds 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard import ZeroConfig, ZeroEngine, ops

CONFIGS = {
    "no_offload": dict(offload_optimizer=False),
    "offload": dict(offload_optimizer=True),
    "offload_overlap": dict(offload_optimizer=True, overlap_step=True),
    "offload_clip": dict(offload_optimizer=True),
}


class Run:
    def __init__(self, name: str, args) -> None:
        torch.manual_seed(0)
        self.name = name
        layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
        self.model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.Tanh())])
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=name == "no_offload")
        config = ZeroConfig(stage=2, reduce_bucket_size=args.width * (args.width + 1), max_inflight_buckets=1,
                            offload_chunk_size=args.chunk, **CONFIGS[name])  # fmt: skip
        self.engine = ZeroEngine(self.model, opt, config)
        if self.engine.offload is not None:
            self.engine.offload.global_scale_expected = name == "offload_clip"
        self.x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
        self.step_s: list[float] = []
        self.backward_s: list[float] = []

    def step(self) -> None:
        t0 = time.perf_counter()
        self.model(self.x).square().mean().backward()
        self.engine.finish_backward()
        t1 = time.perf_counter()
        if self.name == "offload_clip":
            self.engine.clip_grad_norm_(1.0)
        self.engine.optimizer.step()
        self.engine.optimizer.zero_grad(set_to_none=True)
        self.engine.after_step()
        t2 = time.perf_counter()
        self.backward_s.append(t1 - t0)
        self.step_s.append(t2 - t0)


def kernel_costs(numel: int, rounds: int) -> dict:
    """Seconds of: the step; the step + a clip pass (g.mul_); the step + a p, m, v backup (speculation's rollback)."""
    gen = torch.Generator().manual_seed(2)
    p, g, m, v = (
        torch.randn(numel, generator=gen),
        torch.randn(numel, generator=gen),
        torch.zeros(numel),
        torch.zeros(numel),
    )
    backup = [torch.empty(numel) for _ in range(3)]
    hyper = dict(
        step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True, bias_correction=True
    )

    def fused():
        ops.adam_step(p, g, m, v, grad_clip=0.5, **hyper)

    def clip_pass():
        g.mul_(0.5)
        ops.adam_step(p, g, m, v, **hyper)

    def speculate():
        for b, t in zip(backup, (p, m, v)):
            b.copy_(t)
        ops.adam_step(p, g, m, v, **hyper)

    fns = {"step_with_folded_clip": fused, "clip_pass_then_step": clip_pass, "backup_then_step": speculate}
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items()}
    for k in ("clip_pass_then_step", "backup_then_step"):
        out[f"{k}_vs_folded"] = statistics.median(a / b for a, b in zip(times[k], times["step_with_folded_clip"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--numel", type=int, default=25_000_000, help="elements for the kernel-cost rows")
    ap.add_argument("--json", default=f"benchmarks/results/overlap_{socket.gethostname()}.json")
    args = ap.parse_args(argv)
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    load_before = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    runs = [Run(name, args) for name in CONFIGS]
    for r in runs:  # warm-up
        r.step()
        r.step_s.clear()
        r.backward_s.clear()
    for k in range(args.rounds):
        for r in runs[k % len(runs) :] + runs[: k % len(runs)]:
            r.step()
    base = runs[0]
    rows = []
    print(f"\n| config | s/step | backward s | step / no_offload | loadavg {load_before}")
    for r in runs:
        row = dict(config=r.name, seconds_per_step=statistics.median(r.step_s),
                   backward_seconds=statistics.median(r.backward_s),
                   vs_no_offload=statistics.median(a / b for a, b in zip(r.step_s, base.step_s)))  # fmt: skip
        rows.append(row)
        print(
            f"| {r.name} | {row['seconds_per_step']:.4f} | {row['backward_seconds']:.4f} | {row['vs_no_offload']:.2f}x"
        )
    kernel = kernel_costs(args.numel, args.rounds)
    print(f"\nkernel costs at {args.numel:,} elements:", {k: round(v, 4) for k, v in kernel.items()})
    load_after = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"loadavg before {load_before}, after {load_after}")
    result = {
        "benchmark": "overlap",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "machine": {"hostname": socket.gethostname(), "logical_cpus": os.cpu_count(), "platform": platform.platform()},
        "torch_version": torch.__version__,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "rows": rows,
        "kernel_costs": kernel,
    }
    for r in runs:
        r.engine.remove_hooks()
    dist.destroy_process_group()
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

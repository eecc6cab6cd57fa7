"""What do the gradient hooks cost per parameter: moving each ``.grad`` into its flat parameter's buffer, counting it,
and launching each complete bucket's reduction? (CPU, one process, no communication)

Two identical stacks of transformer-MLP blocks (LayerNorm, Linear 64 -> 256, GELU, Linear 256 -> 64; 6 parameters
each) on a small batch, so backward's compute is small and the hooks' cost shows: ``plain`` is autograd alone (the
gradients stay in ``.grad``, set to None after each step), ``hooked`` puts one flat parameter per block under a
:class:`~zeroshard.sharding.grad_reducer.GradReducer` (stage 2) whose collectives are a stub that launches nothing.
One backward of each per round, in alternating order; the cost per parameter is the median over rounds of
``(hooked - plain) / parameters``, wall clock. What the ``hooked`` side runs is whatever ``zeroshard`` is imported:
run this file with ``PYTHONPATH`` pointing at another checkout's ``python/`` for a before/after (each run adds its
``--label`` to ``--json``, other labels kept, and prints every entry).

    PYTHONPATH=python python benchmarks/bench_grad_hooks.py --label after
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import zeroshard  # noqa: E402
from rank_launch import machine, versions  # noqa: E402
from zeroshard.sharding.flat_param import FlatParam  # noqa: E402
from zeroshard.sharding.grad_reducer import GradReducer  # noqa: E402


class _NoCollectives:
    """GradReducer's collectives for one rank, launching nothing: the hooks' and the reducer's own work is timed."""

    world_size, rank = 1, 0

    def reduce_scatter(self, fulls, shards, bucket, scale, accumulate):
        return types.SimpleNamespace(wait=lambda: None)


def _blocks(n: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(n)
        ]  # fmt: skip
    )


def _git_rev(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    plain, hooked = _blocks(args.blocks, args.width), _blocks(args.blocks, args.width)
    fps = []
    for i, block in enumerate(hooked):
        params = list(block.parameters())
        names = [f"{i}.{n}" for n, _ in block.named_parameters()]
        fps.append(FlatParam(names, params, rank=0, world_size=1, align_elems=16, master_device=torch.device("cpu")))
    reducer = GradReducer(fps, _NoCollectives(), stage=2, max_inflight=2)
    x = torch.randn(args.batch, args.width)

    def step_plain() -> None:
        plain(x).square().mean().backward()
        for p in plain.parameters():
            p.grad = None

    def step_hooked() -> None:
        hooked(x).square().mean().backward()
        reducer.finish_backward()
        reducer.consume()

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for _ in range(args.warmup):
        step_plain()
        step_hooked()
    rounds = []
    for r in range(args.rounds):
        first, second = (step_plain, step_hooked) if r % 2 == 0 else (step_hooked, step_plain)
        a, b = timed(first), timed(second)
        rounds.append((a, b) if r % 2 == 0 else (b, a))
    n_params = sum(len(fp.params) for fp in fps)
    reducer.remove_hooks()
    return {
        "command": "python " + " ".join(sys.argv),
        "zeroshard": str(Path(zeroshard.__file__).resolve().parent),
        "zeroshard_git": _git_rev(Path(zeroshard.__file__).resolve().parent),
        "machine": machine(),
        "versions": versions(),
        "config": vars(args),
        "parameters": n_params,
        "flat_parameters": len(fps),
        "plain_ms_median": 1e3 * statistics.median(p for p, _ in rounds),
        "hooked_ms_median": 1e3 * statistics.median(h for _, h in rounds),
        "us_per_parameter": 1e6 * statistics.median((h - p) / n_params for p, h in rounds),
    }


def markdown(data: dict) -> str:
    lines = [
        "# Gradient hooks: cost per parameter (bench_grad_hooks.py)",
        "",
        "| entry | zeroshard (git) | parameters / flat | plain ms | hooked ms | us per parameter (hooks, reductions) |",
        "|---|---|---|---|---|---|",
    ]
    for label, e in data.items():
        lines.append(
            f"| {label} | {e['zeroshard_git']} | {e['parameters']} / {e['flat_parameters']} | "
            f"{e['plain_ms_median']:.3f} | {e['hooked_ms_median']:.3f} | {e['us_per_parameter']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", default="current")
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="rows of the input: small, so the hooks' cost shows")
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "grad_hooks_cpu.json"))
    args = p.parse_args()
    entry = run(args)
    path = Path(args.json)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[args.label] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    md = markdown(data)
    path.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()

"""Does host memory stay flat over a long run, for ZeRO stage 2 + optimizer offload and stage 3, beside DDP?

Method: every config in CONFIGS trains the examples' small GPT (``examples/gpt.py`` through ``examples/lit_gpt.py``) on
the examples' byte data, fp32, same seed, for ``--steps`` optimizer steps (1,000 by default) with Lightning's
``Trainer`` on ``--devices`` gloo ranks on the CPU. Each config runs in its own processes, started the way torchrun
starts them, so each RSS series is that config's alone. Each rank reads its resident set size (``/proc/self/statm``,
a few microseconds) after every optimizer step. Reported per rank:

* RSS at step ``--early`` (after warm-up: allocator pools, autograd graph caches and the optimizer state exist by then)
  and at the last step; growth = last - early, in MiB and as a percent of the early RSS;
* the growth over the second half of that window (mid-point to last step): near zero once memory has levelled off,
  as large as the first half's for a steady leak;
* the least-squares slope of RSS over steps ``--early`` .. last, in MiB per 1,000 steps (robust to one late spike);
* the peak RSS over the run, and RSS when training starts.

DDP (Lightning's ``DDPStrategy``) is the reference: growth from Lightning, the data loader and the allocator, which
zeroshard's configs have too. A leak in zeroshard shows as growth well above DDP's.

Usage:
    PYTHONPATH=python:examples python benchmarks/soak_memory.py [--steps 1000] [--early 50]
        [--configs ddp,zeroshard_stage_2_offload,zeroshard_stage_3] [--n_layer 2 --n_embd 64 ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))  # gpt.py, data.py, lit_gpt.py

from rank_launch import launch, machine, versions  # noqa: E402

MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Config:
    """One strategy to soak: ``strategy`` builds it inside a rank (a registered name or a strategy object)."""

    name: str
    description: str
    strategy: Callable[[], object]


def _zero_stage3():
    from gpt import Block
    from zeroshard import ZeroStrategy

    return ZeroStrategy(stage=3, wrap_policy=Block)


CONFIGS = {
    c.name: c
    for c in [
        Config("ddp", "Lightning DDPStrategy (reference)", lambda: "ddp"),
        Config(
            "zeroshard_stage_2_offload",
            "ZeroStrategy(stage=2, offload_optimizer=True): master + Adam state on the host, pipelined CPU Adam",
            lambda: "zeroshard_stage_2_offload",
        ),
        Config(
            "zeroshard_stage_3",
            "ZeroStrategy(stage=3, wrap_policy=Block): one unit per Block, built on meta",
            _zero_stage3,
        ),
    ]
}


def rss_bytes() -> int:
    """This process's resident set size in bytes (second field of ``/proc/self/statm``, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


# -- one rank ---------------------------------------------------------------------------------------------------------


def run_rank(args: argparse.Namespace) -> None:
    """Trains one config on this rank (env from the launcher) and writes this rank's RSS series as JSON."""
    import lightning as L
    import torch

    from data import ByteTextDataModule
    from gpt import GPTConfig
    from lit_gpt import LitGPT

    config = CONFIGS[args.rank_of]
    world_size = int(os.environ["WORLD_SIZE"])
    if config.name.startswith("zeroshard"):
        import zeroshard  # noqa: F401  (registers the zeroshard_* strategy names)

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.rss: list[int] = []
            self.step_s: list[float] = []
            self.losses: list[float] = []

        def on_train_start(self, trainer, pl_module) -> None:
            self.rss_start = rss_bytes()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.rss.append(rss_bytes())
            self.losses.append(float(outputs["raw_loss"]))
            now = time.perf_counter()
            self.step_s.append(now - self.t)
            self.t = now

    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // world_size))
    L.seed_everything(args.seed, verbose=False)
    gpt_config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    datamodule = ByteTextDataModule(args.block_size, args.batch_size, max_bytes=args.max_bytes, seed=args.seed)
    module = LitGPT(gpt_config, lr=args.lr, warmup_steps=min(args.early, args.steps))
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=config.strategy(),
        precision="32-true",
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=datamodule)
    out = {
        "rank": trainer.global_rank,
        "threads": torch.get_num_threads(),
        "rss_start": recorder.rss_start,
        "rss": recorder.rss,
        "step_s": recorder.step_s,
        "losses": recorder.losses,
        "strategy": type(trainer.strategy).__name__,
    }
    Path(args.rank_out, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


# -- the launcher -----------------------------------------------------------------------------------------------------


RANK_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "steps", "early", "lr", "seed", "max_bytes",
             "threads")  # fmt: skip


def slope_per_1k(rss: list[int], start: int) -> float:
    """Least-squares slope of ``rss[start:]`` (bytes per step) as MiB per 1,000 steps."""
    ys = rss[start:]
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    cov = sum((i - mx) * (y - my) for i, y in enumerate(ys))
    var = sum((i - mx) ** 2 for i in range(n))
    return cov / var * 1000 / MIB


def summarize(name: str, ranks: list[dict], args: argparse.Namespace) -> dict:
    """One result row: per-rank RSS at step ``early`` and at the last step, growth in MiB and percent, slope."""
    early = min(args.early, len(ranks[0]["rss"])) - 1  # index of step `early` (steps count from 1)
    row = {"config": name, "description": CONFIGS[name].description, "strategy_class": ranks[0]["strategy"]}
    row["steps_run"] = len(ranks[0]["rss"])
    row["rss_train_start_mib"] = [r["rss_start"] / MIB for r in ranks]
    row["rss_early_mib"] = [r["rss"][early] / MIB for r in ranks]
    row["rss_last_mib"] = [r["rss"][-1] / MIB for r in ranks]
    row["rss_peak_mib"] = [max(r["rss"]) / MIB for r in ranks]
    row["growth_mib"] = [(r["rss"][-1] - r["rss"][early]) / MIB for r in ranks]
    row["growth_percent"] = [100 * (r["rss"][-1] - r["rss"][early]) / r["rss"][early] for r in ranks]
    half = (early + len(ranks[0]["rss"])) // 2  # growth over the second half: ~0 when memory has levelled off
    row["growth_second_half_mib"] = [(r["rss"][-1] - r["rss"][half]) / MIB for r in ranks]
    row["slope_mib_per_1k_steps"] = [slope_per_1k(r["rss"], early) for r in ranks]
    row["s_per_step"] = max(statistics.median(r["step_s"][early:]) for r in ranks)
    row["final_loss"] = sum(r["losses"][-1] for r in ranks) / len(ranks)
    every = max(1, len(ranks[0]["rss"]) // 100)  # about 100 samples of each series in the JSON
    row["rss_mib_every"] = every
    row["rss_mib_series"] = [[round(x / MIB, 2) for x in r["rss"][::every]] for r in ranks]
    return row


COLUMNS = [
    ("config", 25, lambda r: r["config"]),
    ("RSS@early MiB r0/r1", 19, lambda r: "/".join(f"{m:.1f}" for m in r["rss_early_mib"])),
    ("RSS@last MiB r0/r1", 18, lambda r: "/".join(f"{m:.1f}" for m in r["rss_last_mib"])),
    ("growth MiB r0/r1", 16, lambda r: "/".join(f"{m:+.2f}" for m in r["growth_mib"])),
    ("growth % r0/r1", 14, lambda r: "/".join(f"{m:+.2f}" for m in r["growth_percent"])),
    ("2nd half MiB r0/r1", 18, lambda r: "/".join(f"{m:+.2f}" for m in r["growth_second_half_mib"])),
    ("slope MiB/1k r0/r1", 18, lambda r: "/".join(f"{m:+.2f}" for m in r["slope_mib_per_1k_steps"])),
    ("s/step", 6, lambda r: f"{r['s_per_step']:.3f}"),
    ("final loss", 10, lambda r: f"{r['final_loss']:.4f}"),
]


def print_table(rows: list[dict]) -> None:
    align = ["<"] + [">"] * (len(COLUMNS) - 1)
    print("\n| " + " | ".join(f"{h:{a}{w}}" for a, (h, w, _) in zip(align, COLUMNS)) + " |")
    print("|" + "|".join("-" * (w + 2) for _, w, _ in COLUMNS) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']:<25} | failed: {r['error'].strip().splitlines()[-1][:100]}")
        else:
            print("| " + " | ".join(f"{cell(r):{a}{w}}" for a, (_, w, cell) in zip(align, COLUMNS)) + " |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list from {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps per config")
    p.add_argument("--early", type=int, default=50, help="the step growth is measured from (after warm-up)")
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_head", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=64)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=4, help="per rank")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--max_bytes", type=int, default=MIB, help="corpus size (stdlib sources)")
    p.add_argument("--devices", type=int, default=2, help="ranks")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank; 0 = cores / ranks")
    p.add_argument("--timeout", type=float, default=900, help="seconds per config before its ranks are killed")
    p.add_argument("--json", default="benchmarks/results/soak_memory_cpu.json")
    p.add_argument("--rank_of", default=None, help=argparse.SUPPRESS)  # internal: run one rank of this config
    p.add_argument("--rank_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 2 or not 1 <= args.early < args.steps:
        p.error(f"need --steps >= 2 and 1 <= --early < --steps (got --steps {args.steps}, --early {args.early})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_of:
        run_rank(args)
        return 0
    names = [s.strip() for s in args.configs.split(",") if s.strip()]
    unknown = [s for s in names if s not in CONFIGS]
    if unknown:
        raise SystemExit(f"error: unknown --configs {unknown}; choose from {', '.join(CONFIGS)}")
    load_start = os.getloadavg()
    print(f"GPT {args.n_layer} layers x {args.n_embd}, block {args.block_size}, batch {args.batch_size}/rank, "
          f"{args.devices} gloo ranks on the CPU, {args.steps} steps, growth from step {args.early}; load average "
          f"{load_start[0]:.2f}", flush=True)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="soak_memory_") as tmp:
        for name in names:
            ranks, wall, error = launch(__file__, name, args, RANK_ARGS, Path(tmp))
            if ranks is None:
                print(f"  {name}: FAILED after {wall:.0f} s\n{error}", flush=True)
                rows.append({"config": name, "error": error, "wall_s": wall})
                continue
            rows.append(summarize(name, ranks, args) | {"wall_s": wall, "load_average_after": os.getloadavg()})
            print(f"  {name}: growth {'/'.join(f'{m:+.2f}' for m in rows[-1]['growth_mib'])} MiB "
                  f"({wall:.0f} s wall)", flush=True)  # fmt: skip
    load_end = os.getloadavg()
    print_table(rows)
    ref = next((r for r in rows if r["config"] == "ddp" and "error" not in r), None)
    if ref is not None:
        for r in rows:
            if r is not ref and "error" not in r:
                extra = max(r["growth_mib"]) - max(ref["growth_mib"])
                print(f"{r['config']}: worst rank grew {extra:+.2f} MiB more than DDP's worst rank")
    result = {
        "benchmark": "soak_memory",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("rank_")},
        "machine": machine() | {"load_average_start": load_start, "load_average_end": load_end},
        "versions": versions(),
        "device": "cpu",
        "rows": rows,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What do Lightning's DDP, PyTorch FSDP2 and zeroshard ZeRO stages 1 and 2 (+ optimizer offload) cost in training
throughput and memory per rank, for the same GPT and the same data?

Method: every config in CONFIGS trains the examples' GPT (``examples/gpt.py`` through ``examples/lit_gpt.py``) on the
examples' byte data (this Python's stdlib sources), fp32, same seed, for ``--warmup + --steps`` optimizer steps with
Lightning's ``Trainer``. Each config runs in its own processes: the script starts ``--devices`` ranks of itself the way
torchrun does (MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK; Lightning sees them and launches nothing), so peak
memory is per config. Each rank reports:

* wall time of every step (from the end of one step to the end of the next, data loading included); the median of the
  steps after warm-up, the slowest rank's, gives s/step and tokens/s = ranks * batch * block / (s/step); the fastest
  step ("best") shows how much load from other processes slowed the median;
* peak host RSS (``ru_maxrss``) and RSS when training starts (the imports dominate RSS on a small model: the difference
  is what training added); peak GPU memory on CUDA;
* the loss of every step (the final loss is the last step's, averaged over ranks);
* model-state bytes per rank: theoretical from the parameter count (fp32 params + grads + master + Adam m, v; see
  CONFIGS) and measured: ``ZeroEngine.memory_summary()`` (plus the full gradient buffer stage 1 keeps) for zeroshard,
  the local parts of parameters, gradients and optimizer state for DDP and FSDP2.

FSDP2 is Lightning's ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` with ``fully_shard``
applied to every Block and then to the GPT in ``configure_model``; it runs on CPU (gloo) as well as CUDA.
Same seed and data means the final losses should agree closely; a config more than 1e-3 (relative) from the first
one is flagged, not failed.

Usage:
    PYTHONPATH=python:examples python benchmarks/bench_train.py [--stages ddp,fsdp2,...] [--steps 20] [--warmup 3]
        [--n_layer 4 --n_head 4 --n_embd 256 --block_size 128 --batch_size 4] [--accelerator cpu|cuda] [--json PATH]
        [--plot]   # also a PNG of the table (tokens/s, model-state MiB, loss curves) beside the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
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
LOSS_RTOL = 1e-3


# -- the configs ------------------------------------------------------------------------------------------------------


def state_bytes(params: float, grads: float, master: float, optimizer_state: float) -> dict[str, float]:
    """Model state per rank, in bytes per model parameter (fp32 everywhere)."""
    return {"params": params, "grads": grads, "master": master, "optimizer_state": optimizer_state}


@dataclass(frozen=True)
class Config:
    """One strategy to benchmark.

    strategy: builds the Lightning strategy inside a rank (a registered name or a strategy object).
    theory: (world_size, on_cuda) -> model-state bytes per parameter per rank, by kind (see ``state_bytes``).
    fsdp2: the LightningModule applies ``fully_shard`` in ``configure_model``.
    muon: ``torch.optim.Muon`` (lr 0.02) on the blocks' 2-D weights and AdamW on the rest, two optimizers stepped
        under manual optimization; its tokens/s is printed against the same stage with AdamW alone.
    """

    name: str
    description: str
    strategy: Callable[[int], object]
    theory: Callable[[int, bool], dict[str, float]]
    fsdp2: bool = False
    muon: bool = False  # Muon on the blocks' 2-D weights + AdamW on the rest, manual optimization


def _zero_stage3():
    from gpt import Block
    from zeroshard import ZeroStrategy

    return ZeroStrategy(stage=3, wrap_policy=Block)


def init_timing(args: argparse.Namespace) -> dict:
    """Seconds to build the GPT eagerly, on the meta device, and on meta then materialised (one process, CPU)."""
    import torch

    from gpt import GPT, GPTConfig
    from zeroshard.meta_init import init_meta_context, materialize_module_

    cfg = GPTConfig(n_layer=args.init_layers, n_head=args.init_heads, n_embd=args.init_embd, block_size=args.block_size)
    out = {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head}
    t = time.perf_counter()
    torch.manual_seed(0)
    eager = GPT(cfg)
    out["eager_s"] = time.perf_counter() - t
    out["num_params"] = sum(p.numel() for p in eager.parameters())
    del eager
    t = time.perf_counter()
    with init_meta_context():
        meta = GPT(cfg)
    out["meta_build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    torch.manual_seed(0)
    materialize_module_(meta, torch.device("cpu"))
    out["materialize_s"] = time.perf_counter() - t
    return out


def _model_parallel(world_size: int):
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)


# Adam keeps m and v: 8 bytes per parameter. fp32 training needs no separate master copy (zeroshard's master shard
# aliases the parameter shard), except with optimizer offload on CUDA, where the master shard lives in host memory.
# Transient buffers are not counted: DDP's gradient buckets, zeroshard stage 2's full-size gradient bucket before its
# reduce-scatter, FSDP2's unsharded parameters of the unit being computed.
CONFIGS = {
    c.name: c
    for c in [
        Config("ddp", "Lightning DDPStrategy", lambda n: "ddp", lambda n, cuda: state_bytes(4, 4, 0, 8)),
        Config(
            "fsdp2",
            "Lightning ModelParallelStrategy + fully_shard per Block and root",
            _model_parallel,
            lambda n, cuda: state_bytes(4 / n, 4 / n, 0, 8 / n),
            fsdp2=True,
        ),
        Config(
            "zeroshard_stage_1",
            "ZeroStrategy(stage=1)",
            lambda n: "zeroshard_stage_1",
            lambda n, cuda: state_bytes(4, 4, 0, 8 / n),
        ),
        Config(
            "zeroshard_stage_2",
            "ZeroStrategy(stage=2)",
            lambda n: "zeroshard_stage_2",
            lambda n, cuda: state_bytes(4, 4 / n, 0, 8 / n),
        ),
        Config(
            "zeroshard_stage_2_offload",
            "ZeroStrategy(stage=2, offload_optimizer=True): master + Adam state on the host, CPUAdam",
            lambda n: "zeroshard_stage_2_offload",
            lambda n, cuda: state_bytes(4, 4 / n, 4 / n if cuda else 0, 8 / n),
        ),
        Config(
            "zeroshard_stage_3",
            "ZeroStrategy(stage=3, wrap_policy=Block): parameters sharded too, one unit per Block, built on meta",
            lambda n: _zero_stage3(),
            lambda n, cuda: state_bytes(4 / n, 4 / n, 0, 8 / n),
        ),
        # Muon's momentum is 4 bytes per element (sharded like SGD's), AdamW's 8: the theory counts 8 for every
        # parameter (an upper bound; the measured column shows the difference)
        Config(
            "zeroshard_stage_2_muon",
            "ZeroStrategy(stage=2), Muon on the blocks' matrices + AdamW on the rest",
            lambda n: "zeroshard_stage_2",
            lambda n, cuda: state_bytes(4, 4 / n, 0, 8 / n),
            muon=True,
        ),
        Config(
            "zeroshard_stage_3_muon",
            "ZeroStrategy(stage=3, wrap_policy=Block), Muon on the blocks' matrices + AdamW on the rest",
            lambda n: _zero_stage3(),
            lambda n, cuda: state_bytes(4 / n, 4 / n, 0, 8 / n),
            muon=True,
        ),
    ]
}


# -- one rank ---------------------------------------------------------------------------------------------------------


def run_rank(args: argparse.Namespace) -> None:
    """Trains one config on this rank (env from the launcher) and writes this rank's measurements as JSON."""
    import lightning as L
    import psutil
    import torch

    from data import ByteTextDataModule
    from gpt import GPTConfig
    from lit_gpt import LitGPT

    config = CONFIGS[args.rank_of]
    world_size = int(os.environ["WORLD_SIZE"])
    cuda = args.accelerator == "cuda"
    if config.name.startswith("zeroshard"):
        import zeroshard  # noqa: F401  (registers the zeroshard_* strategy names)

    class FSDP2LitGPT(LitGPT):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            from torch.distributed.fsdp import fully_shard

            super().configure_model()
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    class MuonLitGPT(LitGPT):
        """Muon (lr 0.02, torch's defaults otherwise) on the blocks' 2-D weights, AdamW on the rest, stepped by hand
        (Lightning 2 takes two optimizers only under manual optimization); no LR schedule."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False

        def configure_optimizers(self):
            hp = self.hparams
            hidden = [p for n, p in self.named_parameters() if ".blocks." in n and p.dim() == 2]
            ids = {id(p) for p in hidden}
            rest = [p for p in self.parameters() if id(p) not in ids]
            adamw = torch.optim.AdamW(rest, lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay)
            return [torch.optim.Muon(hidden, lr=0.02), adamw]

        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.manual_backward(out["loss"])
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()
            return out

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.losses: list[float] = []

        def on_train_start(self, trainer, pl_module) -> None:
            self.rss_start = psutil.Process().memory_info().rss
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["raw_loss"]))  # float() waits for the device
            now = time.perf_counter()
            self.step_s.append(now - self.t)
            self.t = now

    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // world_size))
    L.seed_everything(args.seed, verbose=False)
    gpt_config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    datamodule = ByteTextDataModule(args.block_size, args.batch_size, max_bytes=args.max_bytes, seed=args.seed)
    module_class = FSDP2LitGPT if config.fsdp2 else MuonLitGPT if config.muon else LitGPT
    module = module_class(gpt_config, lr=args.lr, warmup_steps=args.warmup)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=world_size,
        strategy=config.strategy(world_size),
        precision="32-true",
        max_steps=(args.warmup + args.steps) * (2 if config.muon else 1),  # manual: each optimizer's step counts
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
        "step_s": recorder.step_s,
        "losses": recorder.losses,
        "host_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "host_start_mib": recorder.rss_start / MIB,
        "gpu_peak_mib": torch.cuda.max_memory_allocated() / MIB if cuda else None,
        "strategy": type(trainer.strategy).__name__,
    }
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        summary = engine.memory_summary()
        out["memory_summary"] = summary
        out["measured"] = summary
    else:
        out["measured"] = held_state(module, trainer.strategy.optimizers[0])
    Path(args.rank_out, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def held_state(module, optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (a DTensor counts its local shard)."""

    def nbytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(module.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel") and v.dim() > 0]
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "master": 0,
        "optimizer_state": sum(nbytes(v) for v in state),
    }


# -- the launcher -----------------------------------------------------------------------------------------------------


RANK_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "steps", "warmup", "lr", "seed", "max_bytes",
             "accelerator", "threads")  # fmt: skip


def summarize(name: str, ranks: list[dict], args: argparse.Namespace, num_params: int) -> dict:
    """One result row from the ranks' measurements."""
    n, cuda = args.devices, args.accelerator == "cuda"
    medians = [statistics.median(r["step_s"][args.warmup :]) for r in ranks]
    s_per_step = max(medians)  # ranks move in lock step; the slowest one sets the pace
    theory = {k: v * num_params for k, v in CONFIGS[name].theory(n, cuda).items()}
    measured = ranks[0]["measured"]
    final = [r["losses"][-1] for r in ranks]
    return {
        "config": name,
        "description": CONFIGS[name].description,
        "strategy_class": ranks[0]["strategy"],
        "tokens_per_s": n * args.batch_size * args.block_size / s_per_step,
        "s_per_step": s_per_step,
        "s_per_step_median_per_rank": medians,
        "s_per_step_best": max(min(r["step_s"][args.warmup :]) for r in ranks),  # least disturbed by other load
        "host_peak_mib": [r["host_peak_mib"] for r in ranks],
        "host_at_train_start_mib": [r["host_start_mib"] for r in ranks],
        "gpu_peak_mib": [r["gpu_peak_mib"] for r in ranks] if cuda else None,
        "model_state_theory_bytes": theory | {"total": sum(theory.values())},
        "model_state_measured_bytes_rank0": measured | {"total": sum(measured.values())},
        "memory_summary_rank0": ranks[0].get("memory_summary"),
        "final_loss": sum(final) / len(final),
        "final_loss_per_rank": final,
        "loss_curve": [sum(r["losses"][i] for r in ranks) / n for i in range(len(ranks[0]["losses"]))],
        "step_s_per_rank": [r["step_s"] for r in ranks],
        "threads_per_rank": ranks[0]["threads"],
    }


# (header, width, cell) for the printed table; widths fit the headers
COLUMNS = [
    ("config", 25, lambda r: r["config"]),
    ("tokens/s", 8, lambda r: f"{r['tokens_per_s']:.0f}"),
    ("s/step", 6, lambda r: f"{r['s_per_step']:.3f}"),
    ("best", 5, lambda r: f"{r['s_per_step_best']:.3f}"),
    ("peak host MiB r0/r1", 19, lambda r: "/".join(f"{m:.0f}" for m in r["host_peak_mib"])),
    ("+train MiB r0", 13, lambda r: f"{r['host_peak_mib'][0] - r['host_at_train_start_mib'][0]:.0f}"),
    ("state MiB/rank theory", 21, lambda r: f"{r['model_state_theory_bytes']['total'] / MIB:.1f}"),
    ("measured", 8, lambda r: f"{r['model_state_measured_bytes_rank0']['total'] / MIB:.1f}"),
    ("final loss", 10, lambda r: f"{r['final_loss']:.5f}"),
]


def print_table(rows: list[dict]) -> None:
    align = ["<"] + [">"] * (len(COLUMNS) - 1)  # config names left, numbers right
    print("\n| " + " | ".join(f"{h:{a}{w}}" for a, (h, w, _) in zip(align, COLUMNS)) + " |")
    print("|" + "|".join("-" * (w + 2) for _, w, _ in COLUMNS) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']:<25} | failed: {r['error'].strip().splitlines()[-1][:100]}")
        else:
            print("| " + " | ".join(f"{cell(r):{a}{w}}" for a, (_, w, cell) in zip(align, COLUMNS)) + " |")
    for r in rows:
        if r.get("gpu_peak_mib"):
            print(f"GPU peak MiB {r['config']}: " + "/".join(f"{m:.0f}" for m in r["gpu_peak_mib"]))


def check_losses(rows: list[dict]) -> list[str]:
    """Flags configs whose final loss is more than LOSS_RTOL (relative) from the first config's."""
    done = [r for r in rows if "final_loss" in r]
    if len(done) < 2:
        return []
    ref = done[0]
    flags = []
    for r in done[1:]:
        rel = abs(r["final_loss"] - ref["final_loss"]) / abs(ref["final_loss"])
        r["final_loss_rel_diff"] = rel
        if rel > LOSS_RTOL:
            flags.append(f"{r['config']}: final loss {r['final_loss']:.6f} differs from {ref['config']}'s "
                         f"{ref['final_loss']:.6f} by {rel:.2e} relative (> {LOSS_RTOL:g})")  # fmt: skip
    return flags


def count_params(args: argparse.Namespace) -> int:
    import torch

    from gpt import GPT, GPTConfig

    with torch.device("meta"):
        gpt = GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size))
    return gpt.num_params()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    default = ",".join(n for n, c in CONFIGS.items() if not c.muon)  # Muon rows on request: slow bf16 NS on CPUs
    p.add_argument("--stages", default=default, help=f"comma list of configs from {', '.join(CONFIGS)}")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=4, help="per rank")
    p.add_argument("--steps", type=int, default=20, help="timed steps, after the warm-up ones")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (also the LR warm-up length)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--max_bytes", type=int, default=2 * MIB, help="corpus size (stdlib sources)")
    p.add_argument("--devices", type=int, default=2, help="ranks")
    p.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank; 0 = cores / ranks")
    p.add_argument("--timeout", type=float, default=600, help="seconds per config before its ranks are killed")
    p.add_argument("--json", default=f"benchmarks/results/train_{socket.gethostname()}.json")
    p.add_argument("--plot", action="store_true", help="also write a PNG of the table beside the JSON")
    p.add_argument("--rank_of", default=None, help=argparse.SUPPRESS)  # internal: run one rank of this config
    p.add_argument("--rank_out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--init_layers", type=int, default=12, help="GPT size for the init timing (0 skips it)")
    p.add_argument("--init_embd", type=int, default=768)
    p.add_argument("--init_heads", type=int, default=12)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_of:
        run_rank(args)
        return 0
    names = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in names if s not in CONFIGS]
    if unknown:
        raise SystemExit(f"error: unknown --stages {unknown}; choose from {', '.join(CONFIGS)}")

    load_start = os.getloadavg()
    num_params = count_params(args)
    print(f"GPT {num_params:,} params ({args.n_layer} layers x {args.n_embd}, block {args.block_size}), batch "
          f"{args.batch_size}/rank, {args.devices} ranks on {args.accelerator}, {args.warmup} + {args.steps} steps; "
          f"load average {load_start[0]:.2f}", flush=True)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for name in names:
            ranks, wall, error = launch(__file__, name, args, RANK_ARGS, Path(tmp))
            if ranks is None:
                print(f"  {name}: FAILED after {wall:.0f} s\n{error}", flush=True)
                rows.append({"config": name, "error": error, "wall_s": wall})
                continue
            rows.append(
                summarize(name, ranks, args, num_params) | {"wall_s": wall, "load_average_after": os.getloadavg()}
            )
            print(f"  {name}: {rows[-1]['s_per_step']:.3f} s/step, final loss {rows[-1]['final_loss']:.5f} "
                  f"({wall:.0f} s wall, load {rows[-1]['load_average_after'][0]:.2f})", flush=True)  # fmt: skip
    init = init_timing(args) if args.init_layers > 0 else None
    load_end = os.getloadavg()

    print_table(rows)
    if init:
        print(
            f"\ninit of a {init['num_params'] / 1e6:.0f}M-parameter GPT ({init['n_layer']} x {init['n_embd']}): eager "
            f"{init['eager_s']:.2f} s; meta build {init['meta_build_s']:.3f} s; meta build + materialise "
            f"{init['meta_build_s'] + init['materialize_s']:.2f} s (ZeRO-3 materialises only each rank's units' shards)"
        )
    for r in rows:
        base = next((b for b in rows if b["config"] == r["config"].removesuffix("_muon") and "tokens_per_s" in b), None)
        if r["config"].endswith("_muon") and base is not None and "tokens_per_s" in r:
            r["tokens_per_s_vs_adamw"] = r["tokens_per_s"] / base["tokens_per_s"]
            print(f"{r['config']}: tokens/s / {base['config']} (AdamW) = {r['tokens_per_s_vs_adamw']:.3f}")
    flags = check_losses([r for r in rows if not r["config"].endswith("_muon")])  # Muon trains another trajectory
    print("final losses: " + ", ".join(f"{r['config']} {r['final_loss']:.6f}" for r in rows if "final_loss" in r))
    for f in flags:
        print("FLAG " + f)
    if not flags and len(rows) > 1:
        print(f"final losses agree within {LOSS_RTOL:g} relative")
    print(f"load average (1/5/15 min): start {'/'.join(f'{x:.2f}' for x in load_start)}, "
          f"end {'/'.join(f'{x:.2f}' for x in load_end)}")  # fmt: skip

    result = {
        "benchmark": "train",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("rank_")},
        "num_params": num_params,
        "machine": machine() | {"load_average_start": load_start, "load_average_end": load_end},
        "versions": versions(),
        "device": args.accelerator,
        "loss_rtol": LOSS_RTOL,
        "loss_flags": flags,
        "rows": rows,
        "init": init,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    if args.plot:
        from plot_table import plot_result  # matplotlib only when asked

        print(f"wrote {plot_result(path)}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

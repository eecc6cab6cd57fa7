"""Train a minGPT-style byte-level GPT with a Lightning Trainer and the zeroshard ZeRO strategy.

    python examples/train_gpt.py                       # 2 CPU processes (gloo), ZeRO stage 2, a few minutes
    python examples/train_gpt.py --strategy ddp        # the same run under plain DDP, for comparison
    python examples/train_gpt.py --accelerator gpu --devices 8 --n_layer 24 --n_embd 2048 --n_head 16 \\
        --precision bf16-mixed --stage 3 --offload_optimizer
    python examples/train_gpt.py --timeout 600         # a rank silent for 10 minutes ends the job, naming where

Logs go to ``runs/train_gpt/version_N/`` under the current directory (Lightning's CSVLogger: metrics.csv with the
train loss per step, the validation loss per validation and each rank's tokens/s); at the end rank 0 draws them into
``loss.png`` beside it (examples/plot_run.py, matplotlib) and prints its path. ``--logger tensorboard`` or ``none``
instead. The summary ends with the largest GPT of this width the machine could train at this batch under DDP and each
ZeRO stage, from ``zeroshard.plan``.

The defaults (4 x 128, 0.83M parameters, 64-byte context, 8 windows per rank, 1000 steps at lr 3e-3 with warmup and
cosine decay) were chosen on 2 CPU cores for the most learning in about two minutes: at this budget many small steps
beat fewer large ones (validation loss 1.7 after 1000 steps of 16 x 64 bytes, against 2.3 after 300 steps of
32 x 128 bytes, which is more bytes in all), and at that loss the sample reads as Python. The sample continues the first
function signature of the held-out split, at temperature 0.8 among the 10 likeliest bytes.

Lightning's launcher re-runs this script once per extra rank, so everything happens under ``main()``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt.py, data.py, ... sit beside this file, any cwd

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from data import DEFAULT_MAX_BYTES, ByteTextDataModule  # noqa: E402
from gpt import Block, GPTConfig  # noqa: E402
from lit_gpt import LitGPT  # noqa: E402
from train_stats import TrainStats, engine_of  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    m = p.add_argument_group("model")
    m.add_argument("--n_layer", type=int, default=4)
    m.add_argument("--n_head", type=int, default=4)
    m.add_argument("--n_embd", type=int, default=128)
    m.add_argument("--block_size", type=int, default=64)
    m.add_argument("--dropout", type=float, default=0.0)
    t = p.add_argument_group("training")
    t.add_argument("--batch_size", type=int, default=8, help="per rank")
    t.add_argument("--max_steps", type=int, default=1000)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--weight_decay", type=float, default=0.1)
    t.add_argument("--warmup_steps", type=int, default=50)
    t.add_argument("--lr_schedule", choices=["cosine", "constant"], default="cosine")
    t.add_argument("--accumulate_grad_batches", type=int, default=1)
    t.add_argument("--gradient_clip_val", type=float, default=1.0, help="clip grad norm; 0 disables")
    t.add_argument("--val_check_interval", type=int, default=250, help="validate every N training batches")
    t.add_argument("--limit_val_batches", type=int, default=20)
    t.add_argument("--seed", type=int, default=1337)
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, help="a text file; default: this Python's stdlib sources")
    d.add_argument("--max_bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus cap in bytes; 0 = no cap")
    s = p.add_argument_group("hardware and strategy")
    s.add_argument("--accelerator", default="cpu")
    s.add_argument("--devices", type=int, default=2)
    s.add_argument("--precision", default="32-true", help="any Lightning precision: 32-true, bf16-mixed, 16-mixed, ...")
    s.add_argument("--strategy", choices=["zeroshard", "ddp"], default="zeroshard")
    s.add_argument("--stage", type=int, choices=[1, 2, 3], default=2, help="ZeRO stage (zeroshard only)")
    s.add_argument("--offload_optimizer", action="store_true", help="optimizer state + step on the CPU (zeroshard)")
    s.add_argument("--threads", type=int, default=0, help="torch threads per rank; 0 = cores / devices")
    s.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="collective timeout in seconds: a rank that stops answering this long ends the job with an error naming "
        "the collective, bucket or unit, step and rank (default: Lightning's 30 minutes; README: Faults)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--summary_json", default=None, help="write the run summary here (rank 0)")
    o.add_argument("--save_ckpt", default=None, help="trainer.save_checkpoint here at the end (zeroshard: a directory)")
    o.add_argument(
        "--init_from",
        default=None,
        help="start from these weights (safetensors, e.g. from `python -m zeroshard.consolidate CKPT OUT`)",
    )
    o.add_argument("--sample_tokens", type=int, default=200, help="bytes to generate after training; 0 = none")
    o.add_argument(
        "--prompt",
        default=None,
        help="text to continue; default: the first function signature in the held-out split (a line the model "
        "never trained on), with its indentation",
    )
    o.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    o.add_argument("--top_k", type=int, default=10, help="sample among the k most likely bytes; 0 = all")
    o.add_argument(
        "--logger",
        choices=["csv", "tensorboard", "none"],
        default="csv",
        help="Lightning logger: csv writes LOG_DIR/train_gpt/version_N/metrics.csv and a loss.png beside it",
    )
    o.add_argument("--log_dir", default="runs", help="the logger's directory (relative to the current directory)")
    o.add_argument("--log_every_n_steps", type=int, default=1, help="log train loss every N steps")
    args = p.parse_args(argv)
    if args.timeout is not None and not args.timeout > 0:
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    return args


def make_strategy(args: argparse.Namespace):
    """The one place the training strategy is chosen."""
    if args.strategy == "ddp":
        if args.offload_optimizer or args.stage != 2:
            warnings.warn("--stage/--offload_optimizer only apply to --strategy zeroshard; ignored", stacklevel=2)
        if args.timeout is None:
            return "ddp"
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(timeout=timedelta(seconds=args.timeout))
    try:
        from zeroshard import ZeroStrategy
    except ImportError as e:
        raise SystemExit(
            f"error: --strategy zeroshard needs the zeroshard package, but importing it failed ({e}).\n"
            "Build it from the repository root with `make build` (creates .venv, compiles zeroshard._C and puts "
            "python/ on the venv's path), run with that venv's python, or pass --strategy ddp."
        ) from e
    # stage 3 units: one per transformer block; embeddings, final norm and head form the root unit
    wrap_policy = Block if args.stage == 3 else None
    timeout = {} if args.timeout is None else {"timeout": timedelta(seconds=args.timeout)}
    return ZeroStrategy(stage=args.stage, offload_optimizer=args.offload_optimizer, wrap_policy=wrap_policy, **timeout)


def full_parameters(module: LitGPT):
    """zeroshard.gathered_parameters under --strategy zeroshard (whole parameters at stage 3); nothing under ddp."""
    if engine_of(module) is None:
        return contextlib.nullcontext()
    from zeroshard import gathered_parameters

    return gathered_parameters(module)


def generate_sample(module: LitGPT, prompt: str, n: int, temperature: float = 0.8, top_k: int | None = 10) -> str:
    """Decode n bytes after prompt with module's GPT; returns prompt + continuation as text (bad UTF-8 replaced).

    Needs the full parameters on this rank (true for DDP and ZeRO 1/2; stage 3 must gather around this call).
    """
    model = module.model
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    idx = torch.tensor([list(prompt.encode() or b"\n")], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    out = model.generate(idx, n, temperature=temperature, top_k=top_k, generator=generator)
    model.train(was_training)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def make_logger(args: argparse.Namespace):
    """Lightning's CSVLogger or TensorBoardLogger under --log_dir, or False (no logger, nothing written)."""
    if args.logger == "none":
        return False
    if args.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(args.log_dir, name="train_gpt")
    return CSVLogger(args.log_dir, name="train_gpt")


def write_plot(trainer: L.Trainer) -> Path | None:
    """loss.png beside the metrics.csv the CSVLogger wrote (read back from the file); None without a CSV logger."""
    if not isinstance(trainer.logger, CSVLogger):
        return None
    metrics_csv = Path(trainer.logger.log_dir) / "metrics.csv"
    if not metrics_csv.is_file():
        return None
    from plot_run import plot_metrics  # matplotlib only when there is something to draw

    return plot_metrics(metrics_csv, metrics_csv.with_name("loss.png"))


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype forward and backward run in under a Lightning precision string."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def largest_models(args: argparse.Namespace, trainer: L.Trainer, config: GPTConfig) -> tuple[str, dict]:
    """The largest GPT of this run's width, context and micro-batch that ``zeroshard.plan`` says fits this machine's
    ranks with DDP and each ZeRO stage (more blocks, same width): one line, and the parameter counts by layout."""
    from zeroshard.plan import DEFAULT_MARGIN, Layout, Training, largest_gpt
    from zeroshard.plan.cluster import GIB, from_environment

    device = "cuda" if args.accelerator in ("gpu", "cuda") and torch.cuda.is_available() else "cpu"
    cluster = from_environment(trainer.world_size, trainer.num_devices, device)
    train = Training(
        micro_batch=args.batch_size,
        seq_len=args.block_size,
        grad_accum=args.accumulate_grad_batches,
        compute_dtype=compute_dtype(args.precision),
    )
    layouts = {"DDP": Layout("ddp"), "stage 1": Layout(1), "stage 2": Layout(2), "stage 3": Layout(3)}
    layouts["stage 3 + offload"] = Layout(3, offload_optimizer=True, offload_params=True) if device == "cuda" else None
    params: dict[str, int] = {}
    capped: set[int] = set()
    max_layers = 1 << 16
    for name, layout in layouts.items():
        if layout is None:  # on CPU ranks offloading moves nothing off the device
            continue
        n_layer, spec = largest_gpt(
            layout, train, cluster, config.n_embd, config.n_head, config.vocab_size, config.block_size,
            tied_head=True, max_layers=max_layers,
        )  # fmt: skip
        params[name] = spec.num_params if spec else 0
        if n_layer == max_layers:  # the search stopped at its cap: at least this much
            capped.add(params[name])

    def size(n: int) -> str:
        at_least = ">=" if n in capped else ""
        return at_least + (f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n else "none")

    ddp = params.pop("DDP")
    where = f"{cluster.gpu_mem / GIB:.0f} GiB per GPU" if device == "cuda" else "host memory available now"
    line = (
        f"largest GPT this machine could train at batch {args.batch_size} x {args.block_size} tokens per rank "
        f"(width {config.n_embd}, {trainer.world_size} ranks, {where} "
        f"{cluster.host_mem / GIB:.1f} GiB{' per node' if device == 'cuda' else ''}; zeroshard.plan, margin "
        f"{DEFAULT_MARGIN:.0%}): DDP {size(ddp)}, "
        + ", ".join(f"{k} {size(v)} ({v / max(1, ddp):.1f}x)" for k, v in params.items())
    )
    return line, {"DDP": ddp, **params}


def load_average() -> str:
    """The 1-minute load average (other processes slow a shared machine down), or "n/a" off Linux."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "n/a"


def versions() -> dict[str, str]:
    v = {"python": platform.python_version(), "torch": torch.__version__, "lightning": L.__version__}
    try:
        import zeroshard

        v["zeroshard"] = getattr(zeroshard, "__version__", "unknown")
    except ImportError:
        pass
    return v


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # one rank per core share: N processes each using every core would oversubscribe the machine
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads or max(1, cores // max(1, args.devices)))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # num_workers=0 is deliberate: data is in RAM
    # Lightning 2.6 asks torch >= 2.13 a deprecated pytree question: noise for the user, nothing to act on
    warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")
    L.seed_everything(args.seed, verbose=False)

    config = GPTConfig(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size, dropout=args.dropout
    )
    datamodule = ByteTextDataModule(
        args.block_size, args.batch_size, data_path=args.data, max_bytes=args.max_bytes, seed=args.seed
    )
    try:  # load now, before any process is launched, so a bad --data fails with one clear line
        datamodule.setup("fit")
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from e
    module = LitGPT(
        config,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_schedule=args.lr_schedule,
        init_from=args.init_from,
    )
    stats = TrainStats(tokens_window=args.log_every_n_steps * max(1, 10 // args.log_every_n_steps))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=make_strategy(args),
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=args.val_check_interval,
        check_val_every_n_epoch=None,  # count val_check_interval in steps across epochs (small --data files)
        limit_val_batches=args.limit_val_batches,
        accumulate_grad_batches=args.accumulate_grad_batches,
        gradient_clip_val=args.gradient_clip_val or None,
        callbacks=[stats],
        logger=make_logger(args),
        log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=False,
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    wall_s = time.perf_counter() - t0
    if args.save_ckpt:
        trainer.save_checkpoint(args.save_ckpt)
    # ZeRO stage 3 keeps only shards: gather the whole model for generation (a collective, so every rank enters)
    prompt = datamodule.prompt if args.prompt is None else args.prompt
    with full_parameters(module):
        sample = (
            generate_sample(module, prompt, args.sample_tokens, args.temperature, args.top_k or None)
            if trainer.is_global_zero and args.sample_tokens > 0
            else ""
        )
    if not trainer.is_global_zero:
        return

    curve = stats.loss_curve
    print(
        f"\nGPT {module.model.num_params() / 1e6:.2f}M params, {trainer.world_size} ranks, "
        f"strategy {args.strategy}{f' stage {args.stage}' if args.strategy == 'zeroshard' else ''}, "
        f"precision {args.precision}, corpus {datamodule.corpus_bytes / 2**20:.1f} MiB"
    )
    print(stats.table())
    val = f"{stats.val_losses[-1][1]:.4f} (step {stats.val_losses[-1][0]})" if stats.val_losses else "n/a"
    if curve:
        print(
            f"train loss (mean over ranks): step {curve[0][0]} {curve[0][1]:.4f} -> step {curve[-1][0]} "
            f"{curve[-1][1]:.4f}; last val loss {val}; fit wall time {wall_s:.1f} s "
            f"(CPU time per rank: {max(r['fit_cpu_s'] for r in stats.ranks):.0f} s, load average {load_average()})"
        )
    try:  # the planner's answer, beside the measured per-rank figures above
        largest_line, largest = largest_models(args, trainer, config)
        print(largest_line)
    except ImportError:  # --strategy ddp without zeroshard installed
        largest = None
    if sample:
        where = " (held-out split)" if args.prompt is None else ""
        print(f"\n--- sample ({args.sample_tokens} bytes after {prompt!r}{where}) ---\n{sample}\n---")

    png = write_plot(trainer)
    if png is not None:
        print(f"loss curves: {png} (data: {png.with_name('metrics.csv')})")
    elif trainer.logger:
        print(f"logs: {trainer.logger.log_dir}")

    if args.summary_json:
        summary = {
            "args": vars(args),
            "config": vars(config),
            "num_params": module.model.num_params(),
            "world_size": trainer.world_size,
            "corpus_bytes": datamodule.corpus_bytes,
            "first_train_loss": curve[0][1] if curve else None,
            "last_train_loss": curve[-1][1] if curve else None,
            "loss_curve": curve,
            "val_losses": stats.val_losses,
            "ranks": stats.ranks,
            "tokens_per_s": sum(r["tokens_per_s"] for r in stats.ranks),
            "train_s": max(r["train_s"] for r in stats.ranks),
            "fit_wall_s": wall_s,
            "prompt": prompt,
            "sample": sample,
            "largest_params": largest,
            "log_dir": str(Path(trainer.logger.log_dir).resolve()) if trainer.logger else None,
            "plot": str(png.resolve()) if png else None,
            "versions": versions(),
        }
        path = Path(args.summary_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary written to {path}")


if __name__ == "__main__":
    main()

"""LitGPT's own pretraining entry point, ``litgpt.pretrain.main``, unchanged, with zeroshard's Fabric strategy.

LitGPT (Lightning's LLM trainer) builds its ``GPT`` under ``fabric.init_module(empty_init=True)``, overrides each
layer's ``reset_parameters`` in ``initialize_weights``, calls ``fabric.setup(model)``, creates the optimizer over the
set-up model's parameters and calls ``fabric.setup_optimizers``. With ``ZeroFabricStrategy`` the model is built on the
meta device, materialised by those ``reset_parameters`` at setup (at stage 3 unit by unit, each rank keeping only its
shards) and trained by LitGPT's own loop, checkpoints included (``out_dir/final/lit_model.pth`` is a sharded
checkpoint directory, readable with ``python -m zeroshard.consolidate``).

    python examples/litgpt_pretrain.py                       # 2 CPU processes (gloo), ZeRO stage 3, a tiny GPT
    python examples/litgpt_pretrain.py --accelerator cuda --devices 8 --stage 3 --config pythia-160m

The data is Python's own standard-library source as bytes (``examples/data.py``: real text, no download; vocabulary
256). LitGPT is installed without its dependencies (its pins conflict with transformers 5.x):
``pip install --no-deps litgpt==0.5.13 && pip install "jsonargparse[signatures]>=4.37,<=4.41"``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.strategies import DDPStrategy
from litgpt import pretrain
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import DataModule
from litgpt.model import Block
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import VOCAB_SIZE, split_bytes, stdlib_corpus  # noqa: E402
from zeroshard import ZeroFabricStrategy  # noqa: E402


class _Windows(Dataset):
    """Windows of ``seq + 1`` bytes (LitGPT's batches hold the input and the shifted target together)."""

    def __init__(self, tokens: torch.Tensor, seq: int, stride: int) -> None:
        self.tokens, self.seq = tokens, seq
        self.starts = range(0, len(tokens) - seq - 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = self.starts[i]
        return self.tokens[start : start + self.seq + 1].long()


class StdlibBytes(DataModule):
    """A LitGPT ``DataModule`` over this Python's standard-library sources, byte-level (``tokenizer`` unused)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.batch_size, self.seq = 1, 64

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
        self.batch_size, self.seq = batch_size, max_seq_length or self.seq

    def setup(self, stage: str = "") -> None:
        self.train_tokens, self.val_tokens = split_bytes(stdlib_corpus(self.max_bytes), self.seq)

    def train_dataloader(self) -> DataLoader:
        data = _Windows(self.train_tokens, self.seq, stride=self.seq // 2)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Windows(self.val_tokens, self.seq, stride=self.seq), batch_size=self.batch_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--stage", type=int, default=3, help="ZeRO stage (1, 2, 3)")
    p.add_argument(
        "--strategy", choices=["zeroshard", "ddp"], default="zeroshard", help="ddp: Fabric's own, to compare"
    )
    p.add_argument("--config", default="pythia-14m", help="a LitGPT config name, made byte-level (vocabulary 256)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--seq", type=int, default=64, help="context length (tokens)")
    p.add_argument("--max-tokens", type=int, default=64 * 64 * 8, help="tokens to train on, every rank together")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-bytes", type=int, default=1 << 20, help="corpus size (bytes of stdlib source)")
    p.add_argument("--out-dir", default="runs/litgpt_pretrain")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = Config.from_name(
        args.config,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        block_size=args.seq,
        vocab_size=VOCAB_SIZE,
        padded_vocab_size=VOCAB_SIZE,
    )
    global_batch = args.micro_batch_size * args.devices  # no gradient accumulation
    train = TrainArgs(
        save_interval=None,
        log_interval=1,
        global_batch_size=global_batch,
        micro_batch_size=args.micro_batch_size,
        max_tokens=args.max_tokens,
        max_norm=1.0,
        min_lr=args.lr / 10,
        lr_warmup_steps=2,
        tie_embeddings=False,
    )
    evaluation = EvalArgs(interval=1000, max_iters=4, initial_validation=False, final_validation=True)
    out_dir = Path(args.out_dir)
    if args.strategy == "ddp":
        strategy = DDPStrategy(process_group_backend="gloo" if args.accelerator == "cpu" else None)
    else:
        strategy = ZeroFabricStrategy(stage=args.stage, wrap_policy=Block if args.stage == 3 else None)
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision="bf16-mixed" if args.accelerator == "cuda" else "32-true",
        loggers=CSVLogger(out_dir, name="logs"),  # LitGPT logs its metrics through fabric.log_dict
    )
    fabric.launch()
    # LitGPT's checkpoint code re-parses sys.argv as `litgpt pretrain`'s own command line to save hyperparameters.yaml:
    # hand it one that command accepts (this script's options are not litgpt's; the yaml records the config name only)
    sys.argv = [sys.argv[0], args.config]
    pretrain.main(
        fabric,
        args.devices,
        args.seed,
        None,  # initial_checkpoint_dir
        False,  # resume
        config,
        StdlibBytes(args.max_bytes),
        out_dir,
        None,  # tokenizer_dir
        None,  # tokenizer
        train,
        evaluation,
        {"class_path": "torch.optim.AdamW", "init_args": {"lr": args.lr, "weight_decay": 0.1}},
    )
    fabric.logger.finalize("success")  # CSVLogger writes metrics.csv on finalize (pretrain.main leaves it to us)
    fabric.print(f"metrics: {Path(fabric.logger.log_dir) / 'metrics.csv'}")
    fabric.print(f"final checkpoint: {out_dir / 'final' / 'lit_model.pth'}")


if __name__ == "__main__":
    main()

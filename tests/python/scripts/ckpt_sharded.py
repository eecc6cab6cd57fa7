"""Rank worker for sharded checkpoints.

Usage:
    ckpt_sharded.py save OUT_DIR STAGE      2 ranks: fit, then write OUT_DIR/sharded (sharded) and OUT_DIR/full.ckpt
    ckpt_sharded.py load OUT_DIR STAGE      any world size: load OUT_DIR/sharded into a fresh engine at STAGE and
                                            write rank 0's full parameters and optimizer state to OUT_DIR/loaded_W.pt
    ckpt_sharded.py crash OUT_DIR STAGE     2 ranks: rank 1 fails while writing a new checkpoint over OUT_DIR/sharded
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from tiny_lm import Block, TinyLM, token_dataset

import zeroshard
from zeroshard.checkpoint import sharded_checkpoint
from zeroshard.checkpoint.sharded_checkpoint import load_sharded, save_sharded


def fit(out: Path, stage: int) -> None:
    L.seed_everything(3, verbose=False)
    strategy = zeroshard.ZeroStrategy(
        stage=stage, wrap_policy=Block if stage == 3 else None, reduce_bucket_size=3000, state_dict_type="full"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyLM()
    trainer.fit(model, torch.utils.data.DataLoader(token_dataset(), batch_size=4))
    trainer.save_checkpoint(out / "full.ckpt")  # consolidated: the reference
    save_sharded(trainer.strategy.engine, out / "sharded", {"note": "test"})


def load(out: Path, stage: int) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    model = TinyLM()
    groups = model.configure_optimizers()
    engine = zeroshard.ZeroEngine(
        model, groups, zeroshard.ZeroConfig(stage=stage, wrap_policy=Block if stage == 3 else None)
    )
    state = load_sharded(engine, out / "sharded")
    assert state == {"note": "test"}, state
    params, optim = engine.full_state_dict(), engine.optimizer_state_dict()
    if dist.get_rank() == 0:
        torch.save({"state_dict": params, "optimizer": optim}, out / f"loaded_{dist.get_world_size()}_{stage}.pt")
    dist.barrier()


def crash(out: Path, stage: int) -> None:
    dist.init_process_group("gloo")
    model = TinyLM()
    engine = zeroshard.ZeroEngine(model, model.configure_optimizers(), zeroshard.ZeroConfig(stage=stage))
    if dist.get_rank() == 1:

        def broken(*args, **kwargs):
            raise OSError("disk full (injected)")

        sharded_checkpoint.save_file = broken
    save_sharded(engine, out / "sharded", {})


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out, stage = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    {"save": fit, "load": load, "crash": crash}[mode](out, stage)
    if dist.is_initialized():  # torch asks for it; a gloo group alive at exit can abort it (pytorch/pytorch#190489)
        dist.destroy_process_group()

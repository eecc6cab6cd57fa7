"""Rank worker: fp16 with dynamic loss scaling; at step 3 rank 1's loss becomes inf.

Usage: fp16_overflow.py OUT_DIR RUN [RUN ...], each RUN a stage with ``+offload`` for optimizer (and at stage 3
parameter) offload, e.g. ``2 3 3+offload``: one fit per RUN, in turn over one process group. For each, rank 0 writes
OUT_DIR/<RUN>.json: whether the master shards and optimizer state of every rank were bit-for-bit unchanged by the
overflowing step, and the scaler's count of skipped steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from tiny_lm import Block, TinyLM, token_dataset

import zeroshard
from zeroshard.engine.loss_scaler import ShardedLossScaler
from zeroshard.strategies.precision import ZeroPrecision

OVERFLOW_STEP = 3


class Overflowing(TinyLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == OVERFLOW_STEP and self.global_rank == 1:
            loss = loss * float("inf")
        return loss


class Snapshot(L.Callback):
    """Copies of every master shard and its optimizer state before and after the overflowing step."""

    def __init__(self) -> None:
        self.before = self.after = None

    @staticmethod
    def _take(trainer):
        engine = trainer.strategy.engine
        out = []
        for fp in engine.flat_params:
            state = engine.optimizer.state.get(fp.master, {})
            out.append([fp.master.detach().clone()] + [torch.as_tensor(v).clone() for _, v in sorted(state.items())])
        return out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == OVERFLOW_STEP:
            self.before = self._take(trainer)
        elif trainer.global_step == OVERFLOW_STEP + 1 and self.after is None:
            self.after = self._take(trainer)


def fit(out: str, stage: int, offload: bool) -> None:
    L.seed_everything(0, verbose=False)
    snap = Snapshot()
    strategy = zeroshard.ZeroStrategy(
        stage=stage,
        wrap_policy=Block if stage == 3 else None,
        offload_optimizer=offload,
        offload_params=offload and stage == 3,
        offload_chunk_size=1000,
        precision_plugin=ZeroPrecision(
            "16-mixed", device="cpu", scaler=ShardedLossScaler(init_scale=256.0, hysteresis=1)
        ),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=OVERFLOW_STEP + 3,
        callbacks=[snap],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Overflowing()
    trainer.fit(model, torch.utils.data.DataLoader(token_dataset(), batch_size=4))
    unchanged = all(all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(snap.before, snap.after)) and len(
        snap.before
    ) == len(snap.after)
    flags = [None] * trainer.world_size
    torch.distributed.all_gather_object(flags, unchanged)
    scaler = trainer.strategy.precision_plugin.scaler
    if trainer.global_rank == 0:
        result = {
            "unchanged_on_every_rank": flags,
            "skipped_steps": scaler.skipped_steps,
            "scale": scaler.scale,
            "losses": model.losses,
        }
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for run in sys.argv[2:]:
        stage, _, offload = run.partition("+")
        fit(str(Path(sys.argv[1]) / f"{run}.json"), int(stage), offload == "offload")

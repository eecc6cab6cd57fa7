"""Rank worker: at step 3, rank 1 skips the first Block (a rank-dependent code path) under ZeRO stage 3: rank 0
gathers blocks.0 where rank 1 gathers blocks.1. (Skipping the last block is not a divergence: every rank still
gathers it, through the prefetch, and backward starts with it gathered; see test_faults_collectives.py.)

Usage: diverge.py CHECK_GATHER_ORDER(0|1). The job must end with an error that names a unit, never hang.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import lightning as L
import torch
from tiny_lm import Block, TinyLM, token_dataset

import zeroshard


class Divergent(TinyLM):
    def forward(self, idx):
        x = self.embed(idx) * (1 + self.frozen_scale)
        if not (self.global_rank == 1 and self.global_step == 3):
            x = self.blocks[0](x)
        x = self.blocks[1](x)
        return self.head(self.norm(x))


def main() -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    strategy = zeroshard.ZeroStrategy(
        stage=3, wrap_policy=Block, check_gather_order=sys.argv[1] == "1", timeout=timedelta(seconds=20)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Divergent(), torch.utils.data.DataLoader(token_dataset(), batch_size=4))


if __name__ == "__main__":
    main()

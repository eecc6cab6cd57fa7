"""Rank worker for the ``load_from_checkpoint`` tests: fits ``HParamsLM`` at stage 2 and saves a sharded checkpoint.

Usage (one process per rank, started by ``launch.run_ranks``):
    hparams_fit.py OUT_DIR

Fits ``HParamsLM(lr=0.02, tag="trained", widths=(3, 4))`` for 6 steps under ``ZeroStrategy(stage=2)`` (2 gloo
ranks), then writes ``OUT_DIR/sharded`` (``trainer.save_checkpoint``, the default sharded directory) and, on rank 0,
``OUT_DIR/sharded.pt`` (the module's state dict after fit: the fp32 master weights, as at stages 1-2). The same again
with ``state_dict_type="full"``: ``OUT_DIR/full.ckpt`` (one file) and ``OUT_DIR/full.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from hparams_lm import HParamsLM
from tiny_lm import token_dataset

import zeroshard


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    for kind in ("sharded", "full"):
        L.seed_everything(5, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=zeroshard.ZeroStrategy(stage=2, state_dict_type=kind),
            max_steps=6,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = HParamsLM(lr=0.02, tag="trained", widths=(3, 4))
        trainer.fit(model, torch.utils.data.DataLoader(token_dataset(), batch_size=4))
        trainer.save_checkpoint(out / ("sharded" if kind == "sharded" else "full.ckpt"))
        if trainer.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{kind}.pt")
        trainer.strategy.barrier()


if __name__ == "__main__":
    main()

"""Stage 3 under Lightning's spawn and fork launchers (``ddp_spawn``, ``ddp_notebook``): run as the main process.

Usage: launcher_runs.py START_METHOD OUT_DIR [prune]

``fit`` then ``predict`` (spawn) or ``validate`` and ``test`` (fork) on 2 CPU processes with
``ZeroStrategy(stage=3)``. Every rank writes its whole parameters at the end of fit (gathered on every rank) to
``OUT_DIR/rank{r}.pt``; the main process, which gets the weights back through the launcher, writes its own to
``OUT_DIR/main.pt``. With ``prune``: the same fit with Lightning's ``ModelPruning`` callback, which must fail naming
pruning and stage 3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelPruning
from lightning.pytorch.demos.boring_classes import BoringModel

import zeroshard


class LoggedModel(BoringModel):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.step(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.step(batch), sync_dist=True)


class SaveGathered(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        with zeroshard.gathered_parameters(pl_module):  # collective: every rank
            state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


def main() -> None:
    method, out = sys.argv[1], Path(sys.argv[2])
    prune = len(sys.argv) > 3 and sys.argv[3] == "prune"
    L.seed_everything(3, verbose=False)
    model = LoggedModel()
    callbacks = [ModelPruning("l1_unstructured", amount=0.5)] if prune else [SaveGathered(out)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=zeroshard.ZeroStrategy(stage=3, start_method=method),
        max_steps=4,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "main.pt")
    # each entry point launches the processes again: spawn (slow to start) runs predict, fork validate and test
    if method == "spawn":
        trainer.predict(model)  # returns None under spawn (Lightning does not send predictions back)
        results = {"predict": "done"}
    else:
        results = {"validate": trainer.validate(model, verbose=False), "test": trainer.test(model, verbose=False)}
    torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main()

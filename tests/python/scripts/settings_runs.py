"""Rank worker for test_faults_settings.py: settings judged at setup, through ``Trainer.fit`` on 2 gloo ranks.

1. ``activation_checkpointing=nn.GRU`` (a class TinyLM lacks) with ``timeout=20`` (seconds, an int): the process group
   starts with the int timeout, then ``fit`` raises at setup, naming the class, before any training step.
2. ``stage=3`` without ``wrap_policy``, twice (two Trainers): trains, and warns once, on rank 0 only.

Writes ``rank<r>.json`` into the directory given as the first argument.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from tiny_lm import Block, TinyLM, token_dataset
from torch import nn

import zeroshard

WORLD = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it from the environment


def trainer(strategy) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(token_dataset(n=32), batch_size=4)
    result = {}

    model = TinyLM()
    try:
        trainer(zeroshard.ZeroStrategy(stage=3, wrap_policy=Block, activation_checkpointing=nn.GRU, timeout=20)).fit(
            model, loader
        )
        result["checkpointing_error"] = None
    except ValueError as error:
        result["checkpointing_error"] = str(error)
    result["steps_before_error"] = len(model.losses)
    result["group_started"] = dist.is_initialized()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model = TinyLM()
            fit = trainer(zeroshard.ZeroStrategy(stage=3))
            fit.fit(model, loader)
    result["single_unit_warnings"] = [str(w.message) for w in caught if "without wrap_policy" in str(w.message)]
    result["steps_trained"] = len(model.losses)
    result["rank"] = fit.global_rank
    (out / f"rank{fit.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

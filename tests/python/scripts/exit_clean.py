"""Rank worker: a short fit (Trainer or Fabric) through a zeroshard strategy that creates the process group; at exit,
records whether the group was still alive when the interpreter began shutting down.

Usage: exit_clean.py OUT_DIR trainer|fabric. Writes ``exit_rank{r}.json``: ``{"alive_at_exit": bool}`` from an atexit
handler registered before the strategy's (atexit runs handlers last-in first-out, so this one runs after it).
"""

from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from tiny_lm import TinyLM, token_dataset

import zeroshard


def main() -> None:
    out, loop = Path(sys.argv[1]), sys.argv[2]
    rank = int(__import__("os").environ["RANK"])
    atexit.register(
        lambda: (out / f"exit_rank{rank}.json").write_text(json.dumps({"alive_at_exit": dist.is_initialized()}))
    )
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    data = torch.utils.data.DataLoader(token_dataset(), batch_size=4)
    if loop == "trainer":
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=zeroshard.ZeroStrategy(stage=2),
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(TinyLM(), data)
    else:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=zeroshard.ZeroFabricStrategy(stage=2))
        fabric.launch()
        model = TinyLM()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for i, batch in zip(range(2), data):
            loss = model.training_step(batch, i)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    assert dist.is_initialized()  # code after the loop can still use the group, as under Lightning's DDP


if __name__ == "__main__":
    main()

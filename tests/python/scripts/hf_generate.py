"""Rank worker: ``model.generate(do_sample=True)`` at ZeRO stage 3 where ranks stop at different lengths.

Usage: hf_generate.py OUT_DIR   (2 ranks)

A tiny GPT-2 (decoder blocks as units, built on the meta device in configure_model) trains 2 steps; validation
generates in ``validation_step`` (inside the strategy's eval step) with ``max_new_tokens`` 2 on rank 0 and 9 on rank 1,
and again in ``on_validation_epoch_end`` (outside any step). Without lockstep, rank 1's extra forwards would wait for
all-gathers rank 0 never joins. Writes ``rank{r}.json`` with the generated lengths and whether the logits of a plain
forward outside any step are finite and equal to those under ``gathered_parameters``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from hf_lm import BLOCKS, HFLM
from tiny_lm import token_dataset

import zeroshard


class Generating(HFLM):
    def __init__(self) -> None:
        super().__init__("gpt2", in_configure_model=True)
        self.lengths: list[int] = []

    def _generate(self, prompt: torch.Tensor) -> None:
        new = 2 if self.global_rank == 0 else 9
        out = self.model.generate(
            prompt, do_sample=True, max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None
        )
        self.lengths.append(out.shape[1] - prompt.shape[1])

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self._generate(batch[0][:, :4])

    def on_validation_epoch_end(self) -> None:
        self._generate(torch.zeros(1, 3, dtype=torch.long))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=zeroshard.ZeroStrategy(stage=3, wrap_policy=BLOCKS["gpt2"]),
        max_steps=2,
        limit_val_batches=2,
        val_check_interval=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Generating()
    data = torch.utils.data.DataLoader(token_dataset(n=32), batch_size=4)
    trainer.fit(model, data, torch.utils.data.DataLoader(token_dataset(n=16, seed=9), batch_size=4))
    x = token_dataset(n=2, seed=3)[:][0]
    model.eval()
    with torch.no_grad():
        outside = model(x)
        with zeroshard.gathered_parameters(model):
            whole = model(x)
    result = {
        "lengths": model.lengths,
        "finite": bool(torch.isfinite(outside).all()),
        "equal": bool(torch.equal(outside, whole)),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

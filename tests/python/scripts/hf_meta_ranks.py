"""Rank worker: Hugging Face models built on the meta device and materialised by ZeRO stage 3, unit by unit.

Usage: hf_meta_ranks.py OUT_DIR   (2 ranks)

1. For tiny GPT-2 and Llama: an eager build and a meta build with the same seed; ZeroEngine(stage=3, blocks as
   units) materialises the meta one. Writes per rank whether every parameter and buffer equals the eager build
   (gathered), and the names of those that differ.
2. Through the Trainer: ``configure_model`` builds, on meta, an HF model next to two custom modules nobody can
   initialise; ``fit`` must fail with our error naming both, and nothing else on top (no teardown error).
Writes ``rank{r}.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from hf_lm import BLOCKS, HFLM, build
from tiny_lm import token_dataset
from torch import nn

import zeroshard
from zeroshard.meta_init import init_meta_context


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)


class Broken(HFLM):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = build("llama")
            self.extra = nn.ModuleList([NoInit(), NoInit()])


def compare_with_eager(kind: str) -> dict:
    torch.manual_seed(5)
    ref = build(kind)
    with init_meta_context():
        model = build(kind)
    torch.manual_seed(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zeroshard.ZeroEngine(model, opt, zeroshard.ZeroConfig(stage=3, wrap_policy=BLOCKS[kind]))
    differ = []
    with zeroshard.gathered_parameters(model):
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            if not torch.equal(a, b):
                differ.append(n)
        for (n, a), b in zip(ref.named_buffers(), model.buffers()):
            if not torch.equal(a, b):
                differ.append(n)
    return {"differ": differ, "n_params": len(list(ref.parameters())), "n_buffers": len(list(ref.buffers()))}


def failing_fit() -> dict:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=zeroshard.ZeroStrategy(stage=3, wrap_policy=BLOCKS["llama"]),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Broken("llama", in_configure_model=True)
    try:
        trainer.fit(model, torch.utils.data.DataLoader(token_dataset(n=16), batch_size=4))
    except Exception as e:  # noqa: BLE001 - the test inspects exactly what the user would see
        still_meta = all(p.is_meta for p in model.parameters())
        return {"type": type(e).__name__, "message": str(e), "trace": traceback.format_exc(), "meta": still_meta}
    return {"type": None}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = {kind: compare_with_eager(kind) for kind in ("gpt2", "llama")}
    result["failing_fit"] = failing_fit()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # torch asks for it; a gloo group alive at exit can abort it (pytorch/pytorch#190489)
        dist.destroy_process_group()

"""Rank worker for the export and load-path tests (tests/python/test_export.py): tiny Hugging Face causal LMs through
Lightning's Trainer with ZeroStrategy, then every way a user takes the checkpoint elsewhere.

Usage (2 ranks, started by ``launch.run_ranks``):
    export_runs.py OUT_DIR PRETRAINED_DIR

For each run (GPT-2 at stage 3, Llama at stage 2, GPT-2 + LoRA at stage 2), under ``OUT_DIR/<name>/``:

1. fit 8 steps with ``ModelCheckpoint(save_last="link")``, then ``trainer.save_checkpoint`` to ``ckpt`` and over the
   ``last.ckpt`` link; ``ref.pt`` (rank 0): the trained model's logits on a fixed batch and its validation loss;
2. a fresh Trainer: ``validate``, ``test`` and ``predict`` with ``ckpt_path=ckpt``;
3. a fresh Trainer: the module built under ``init_module(empty_init=True)``, then ``validate`` with no fit (and
   ``ckpt_path``); the results go to ``loads_rank{r}.json``.

Then ``PRETRAINED_DIR`` (a ``save_pretrained`` GPT-2, made by the test) is loaded with ``zeroshard.load_pretrained``
in ``configure_model`` at stage 3, once through ``fit`` (one step at lr 0: the engine reads each rank's shards) and once
through ``predict`` alone; the logits go to ``PRETRAINED_DIR/pretrained_rank{r}.pt``.

HF models have no ``reset_parameters()``; until stage-3 meta init knows HF's own ``_init_weights``, the strategy gets
``param_init_fn`` = a throwaway eager model's ``_init_weights``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from hf_causal_lm import FIXED_BATCH, HFCausalLM, block_class, build_hf_model
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_lm import token_dataset

import zeroshard

RUNS = [("gpt2_s3", "gpt2", 3, False), ("llama_s2", "llama", 2, False), ("gpt2_lora_s2", "gpt2", 2, True)]


def trainer(arch: str, stage: int, **kwargs) -> L.Trainer:
    init = build_hf_model(arch)._init_weights  # see the module docstring
    strategy = zeroshard.ZeroStrategy(
        stage=stage, wrap_policy=block_class(arch) if stage == 3 else None, param_init_fn=init
    )
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def loader(n: int = 64):
    return torch.utils.data.DataLoader(token_dataset(n), batch_size=4)


def fixed_loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(FIXED_BATCH), batch_size=2)


def run(out: Path, arch: str, stage: int, lora: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(5, verbose=False)
    ckpts = ModelCheckpoint(dirpath=out / "ckpts", save_last="link", every_n_train_steps=4, save_top_k=1)
    t = trainer(arch, stage, max_steps=8, callbacks=[ckpts])
    module = HFCausalLM(arch, lora=lora)
    t.fit(module, loader())
    t.save_checkpoint(out / "ckpt")
    t.save_checkpoint(out / "ckpts" / "last.ckpt")  # over the link save_last="link" made
    with zeroshard.gathered_parameters(module), torch.no_grad():
        logits = module(FIXED_BATCH)
    val = t.validate(module, loader(16), verbose=False)[0]["val_loss"]
    if t.is_global_zero:
        torch.save({"logits": logits, "val_loss": val}, out / "ref.pt")

    got = {"val_loss": val}
    fresh = trainer(arch, stage)
    got["validate_ckpt"] = fresh.validate(
        HFCausalLM(arch, lora=lora), loader(16), ckpt_path=out / "ckpt", verbose=False
    )[0]["val_loss"]
    got["test_ckpt"] = trainer(arch, stage).test(
        HFCausalLM(arch, lora=lora), loader(16), ckpt_path=out / "ckpt", verbose=False
    )[0]["test_loss"]
    predicted = trainer(arch, stage).predict(HFCausalLM(arch, lora=lora), fixed_loader(), ckpt_path=out / "ckpt")
    mine = logits[dist.get_rank() :: dist.get_world_size()]  # the distributed sampler's share of FIXED_BATCH
    got["predict_ckpt_max_diff"] = (torch.cat(predicted) - mine).abs().max().item()

    t = trainer(arch, stage)
    with t.init_module(empty_init=True):
        meta = HFCausalLM(arch, lora=lora)
    got["built_on_meta"] = all(p.is_meta for p in meta.parameters())
    got["validate_meta"] = t.validate(meta, loader(16), verbose=False)[0]["val_loss"]
    t = trainer(arch, stage)
    with t.init_module(empty_init=True):
        meta = HFCausalLM(arch, lora=lora)
    got["validate_meta_ckpt"] = t.validate(meta, loader(16), ckpt_path=out / "ckpt", verbose=False)[0]["val_loss"]
    (out / f"loads_rank{dist.get_rank()}.json").write_text(json.dumps(got))


def pretrained(path: Path) -> None:
    got = {}
    L.seed_everything(9, verbose=False)  # a different seed: every value must come from the file
    t = trainer("gpt2", 3, max_steps=1)
    module = HFCausalLM("gpt2", build="configure", lr=0.0, pretrained=str(path))
    t.fit(module, loader(8))
    reports = zeroshard.engine_of(module).pretrained_reports
    got["fit"] = torch.cat(t.predict(module, fixed_loader()))  # FIXED_BATCH[rank::2]
    module = HFCausalLM("gpt2", build="configure", pretrained=str(path))
    got["predict"] = torch.cat(trainer("gpt2", 3).predict(module, fixed_loader()))
    got["report"] = [(r.mode, r.bytes_read, r.bytes_total, r.missing, r.unexpected) for r in reports]
    torch.save(got, path / f"pretrained_rank{dist.get_rank()}.pt")


def main() -> None:
    out, pretrained_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    for name, arch, stage, lora in RUNS:
        run(out / name, arch, stage, lora)
    pretrained(pretrained_dir)


if __name__ == "__main__":
    main()

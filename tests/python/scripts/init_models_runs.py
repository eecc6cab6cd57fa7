"""Rank worker for issue 16's tests: models no one here wrote, built on the meta device, trained with Fabric.

Usage (one process per rank, started by ``launch.run_ranks``):
    init_models_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``strategy`` ("ddp" or "zeroshard"), ``model``, and optional ``stage`` (default 3),
``build`` ("eager": plain construction, default; "empty_init": ``fabric.init_module(empty_init=True)``; "meta":
``zeroshard.init_meta_context()``), ``setup`` ("separate": ``fabric.setup(model)``, then the optimizer over the set-up
model's parameters and ``fabric.setup_optimizers``, LitGPT's order, default; "joint": ``fabric.setup(model, opt)``),
``steps`` (default 5), ``offload`` (``offload_optimizer``), ``groups`` (two param groups: decay on matrices only),
``gathered`` (``zeroshard.gathered_parameters`` between forward and backward).

Models: "litgpt" (LitGPT's ``GPT``, a 2-layer pythia-14m-style config, initialised by LitGPT's own
``pretrain.initialize_weights`` after the build, as ``litgpt.pretrain.main`` does), "lora_qwen2" / "lora_llama"
(peft LoRA on ``q_proj``, ``v_proj``, ``down_proj`` of a tiny Hugging Face model; only the adapters train), and
"vision", "timm", "rope" (:mod:`init_styles`).

Writes ``{name}_rank{r}.json`` (losses) and, on rank 0, ``{name}_init.pt`` (every parameter and buffer before the
first step) and ``{name}.pt`` (after the last).
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from init_styles import Block, Rope, TimmStyle, VisionNet
from lightning.fabric.strategies import DDPStrategy
from torch import nn

import zeroshard

VOCAB, SEQ = 64, 16


def litgpt_config():
    from litgpt.config import Config

    return Config.from_name(
        "pythia-14m", n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB
    )


def build(run: dict, fabric: L.Fabric) -> nn.Module:
    kind, how = run["model"], run.get("build", "eager")
    context = {
        "eager": nullcontext,
        "empty_init": lambda: fabric.init_module(empty_init=True),
        "meta": zeroshard.init_meta_context,
    }[how]()
    if kind == "litgpt":
        from litgpt.model import GPT
        from litgpt.pretrain import initialize_weights

        config = litgpt_config()
        with context:
            model = GPT(config)
        initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)  # LitGPT's own, unchanged
        return model
    if kind.startswith("lora_"):
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
        with context:
            if kind == "lora_qwen2":
                base = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
            else:
                base = LlamaForCausalLM(LlamaConfig(**common))
            return get_peft_model(base, lora)
    cls = {"vision": VisionNet, "timm": TimmStyle, "rope": Rope}[kind]
    with context:
        return cls()


def wrap_policy(kind: str):
    if kind == "litgpt":
        from litgpt.model import Block as LitBlock

        return LitBlock
    if kind.startswith("lora_"):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        return {Qwen2DecoderLayer, LlamaDecoderLayer}
    return {"vision": nn.Sequential, "timm": Block, "rope": nn.Linear}[kind]


def make_strategy(run: dict):
    if run["strategy"] == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    stage = run.get("stage", 3)
    return zeroshard.ZeroFabricStrategy(
        stage=stage,
        wrap_policy=wrap_policy(run["model"]) if stage == 3 else None,
        offload_optimizer=run.get("offload", False),
    )


def batch_for(kind: str, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    if kind == "litgpt" or kind.startswith("lora_"):
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen)
        return (tokens[:, :-1],), tokens[:, 1:]
    return {"vision": VisionNet, "timm": TimmStyle, "rope": Rope}[kind].example(4, gen)


def loss_of(kind: str, model: nn.Module, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
    out = model(*inputs)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def make_optimizer(model: nn.Module, run: dict) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; with ``groups``, weight decay on the matrices only (two param groups that
    split every unit: the separate set-up at stage 3 then re-shards by them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not run.get("groups"):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    decay, rest = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    with zeroshard.gathered_parameters(module):
        out = dict(module.named_parameters(remove_duplicate=False))
        out.update(module.named_buffers(remove_duplicate=False))
        return {k: v.detach().clone() for k, v in out.items()}


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    for run in runs:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=make_strategy(run))
        fabric.launch()
        fabric.seed_everything(7)  # as litgpt.pretrain.main: the same seed on every rank, no re-seed before setup
        model = build(run, fabric)
        meta = run.get("build", "eager") != "eager" and run["strategy"] != "ddp"  # DDP's empty init is on the CPU
        assert all(p.is_meta for p in model.parameters()) == meta, "the model was not built on the meta device"
        kind = run["model"]
        if run.get("setup", "separate") == "separate":
            model = fabric.setup(model)
            optimizer = fabric.setup_optimizers(make_optimizer(model, run))
        else:
            model, optimizer = fabric.setup(model, make_optimizer(model, run))
        inner = model.module
        init = full_state(inner)
        if fabric.global_rank == 0:
            torch.save(init, out / f"{run['name']}_init.pt")
        gen = torch.Generator().manual_seed(100 + fabric.global_rank)  # each rank its own batches, as DDP's sampler
        losses = []
        for _ in range(run.get("steps", 5)):
            inputs, target = batch_for(kind, gen)
            loss = loss_of(kind, model, inputs, target)
            if run.get("gathered"):
                with zeroshard.gathered_parameters(inner):
                    assert all(p.numel() > 0 and not p.is_meta for p in inner.parameters())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        (out / f"{run['name']}_rank{fabric.global_rank}.json").write_text(json.dumps({"losses": losses}))
        final = full_state(inner)
        if fabric.global_rank == 0:
            torch.save(final, out / f"{run['name']}.pt")
        fabric.barrier()


if __name__ == "__main__":
    main()

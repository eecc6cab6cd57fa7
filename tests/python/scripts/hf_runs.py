"""Rank worker for the Hugging Face parity, LoRA and compile tests: several Trainer.fit calls over one process group.

Usage (one process per rank, started by ``launch.run_ranks``):
    hf_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``kind`` ("gpt2", "llama", or "tiny_frozen_first": tiny_lm's TinyLM whose blocks start
with frozen layers), ``strategy`` ("ddp" or "zeroshard") and optional ``stage`` (units: the decoder blocks),
``lora`` (peft LoRA r=4), ``meta`` (built in configure_model: on the meta device at stage 3), ``compile`` (True: each
block compiled with torch.compile; "model": the whole HF model), ``max_steps`` (20) or ``max_epochs``, ``save_ckpt``
(sharded checkpoint after fit), ``resume_from``, ``samples`` (dataset size; 80 makes an epoch 10 steps, so a
checkpoint after epoch 1 resumes on the same batches).
Writes ``{name}_rank{r}.json`` (losses, and for LoRA runs what the optimizer holds) and, on rank 0, ``{name}.pt``
(final parameters, whole) and ``{name}_init.pt`` (parameters before training).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from hf_lm import BLOCKS, HFLM
from lightning.pytorch.strategies import DDPStrategy
from tiny_lm import Block, TinyLM, token_dataset

import zeroshard


class FrozenFirst(TinyLM):
    """TinyLM whose blocks begin with frozen layers (norm and up projection): a unit's first operations need their
    weights in backward to pass the gradient on, though no gradient of theirs is reduced."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            for p in list(block.norm.parameters()) + list(block.up.parameters()):
                p.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class Compiled(HFLM):
    """``whole=False``: each decoder block compiled (``module.compile()``); ``whole=True``: the HF model."""

    def __init__(self, kind: str, whole: bool = False, **kwargs) -> None:
        self.whole = whole
        super().__init__(kind, **kwargs)

    def configure_model(self) -> None:
        super().configure_model()
        targets = [self.model] if self.whole else [m for m in self.modules() if isinstance(m, BLOCKS[self.kind])]
        for m in targets:
            if getattr(m, "_compiled_call_impl", None) is None:
                m.compile()


def make_model(run: dict):
    if run["kind"] == "tiny_frozen_first":
        return FrozenFirst()
    kwargs = {"in_configure_model": run.get("meta", False), "lora": run.get("lora", False)}
    if run.get("compile"):
        return Compiled(run["kind"], whole=run["compile"] == "model", **kwargs)
    return HFLM(run["kind"], **kwargs)


def make_strategy(run: dict):
    if run["strategy"] == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    stage = run.get("stage", 2)
    block = Block if run["kind"] == "tiny_frozen_first" else BLOCKS[run["kind"]]
    return zeroshard.ZeroStrategy(stage=stage, wrap_policy=block if stage == 3 else None, state_dict_type="sharded")


def whole_state(model) -> dict[str, torch.Tensor]:
    with zeroshard.gathered_parameters(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def optimizer_report(trainer, model) -> dict:
    """Which parameters the optimizer holds state for, and how many elements on this rank."""
    engine = trainer.strategy.engine if run_is_zero(trainer) else None
    opt = trainer.optimizers[0]
    if engine is None:
        names = {id(p): n for n, p in model.named_parameters()}
        held = [names[id(p)] for g in opt.param_groups for p in g["params"] if p in opt.state]
        elems = sum(p.numel() for g in opt.param_groups for p in g["params"] if p in opt.state)
    else:
        held = [n for fp in engine.flat_params for n in fp.names if fp.master in opt.state]
        elems = sum(fp.master.numel() for fp in engine.flat_params if fp.master in opt.state)
    return {"held": sorted(held), "elems": elems}


def dynamo_report() -> dict:
    """What torch.compile did in this run (then reset, so runs do not share compiled code): graphs compiled and the
    reasons of graph breaks."""
    from torch._dynamo.utils import counters

    report = {
        "graphs": counters["stats"].get("unique_graphs", 0),
        "breaks": sorted({str(reason).split("\n")[0][:200] for reason in counters["graph_break"]}),
    }
    torch._dynamo.reset()
    counters.clear()
    return report


def run_is_zero(trainer) -> bool:
    return isinstance(trainer.strategy, zeroshard.ZeroStrategy)


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    for run in runs:
        L.seed_everything(run.get("seed", 7), verbose=False)
        loader = torch.utils.data.DataLoader(token_dataset(n=run.get("samples", 256)), batch_size=4)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=make_strategy(run),
            max_steps=run.get("max_steps", -1 if "max_epochs" in run else 20),
            max_epochs=run.get("max_epochs", -1),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=not run.get("compile"),
        )
        model = make_model(run)
        rank = trainer.global_rank
        if rank == 0 and not run.get("meta"):
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{run['name']}_init.pt")
        trainer.fit(model, loader, ckpt_path=run.get("resume_from"))
        if run.get("save_ckpt"):
            trainer.save_checkpoint(run["save_ckpt"])
        result = {"losses": model.losses}
        if run.get("lora") or run["kind"] == "tiny_frozen_first":
            result["optimizer"] = optimizer_report(trainer, model)
        if run.get("compile"):
            result["dynamo"] = dynamo_report()
        (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps(result))
        state = whole_state(model)
        if rank == 0:
            torch.save(state, out / f"{run['name']}.pt")
        trainer.strategy.barrier()


if __name__ == "__main__":
    main()

"""Rank worker for the gradient-visibility tests: ``param.grad`` on the model after backward, ZeRO vs Lightning's DDP.

Usage (one process per rank, started by ``launch.run_ranks``):
    grad_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``strategy`` ("ddp" or "zeroshard"), ``stage``, ``offload``, ``accumulate``, ``manual``
(manual optimization that also writes gradients before the step: through a view, in place, and a replacement
``p.grad = t``), ``surgery`` (the same writes in ``on_before_optimizer_step``, automatic optimization), ``clip``
(gradient_clip_val), ``fabric`` (the model under ``lightning.Fabric`` instead, see :func:`fabric_run`). Every run
records, per optimizer step, Lightning's ``grad_norm(self, 2)`` and the first elements of one gradient, read in
``on_before_optimizer_step`` (automatic) or after ``manual_backward`` (manual), and per backward in
``on_after_backward`` the norm of one gradient (local during gradient accumulation, as DDP's ``no_sync`` leaves it).
Writes ``{name}_rank{r}.json``.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm
from tiny_lm import VOCAB, Block, TinyLM, token_dataset

import zeroshard


class GradLM(TinyLM):
    def __init__(self, manual: bool = False, surgery: bool = False) -> None:
        super().__init__()
        self.surgery = surgery
        self.automatic_optimization = not manual
        self.norms: list[dict[str, float]] = []
        self.peeks: list[list[float]] = []
        self.after_backward: list[float] = []

    def _record(self) -> None:
        self.norms.append({k: float(v) for k, v in grad_norm(self, norm_type=2).items()})
        self.peeks.append(self.blocks[0].up.weight.grad[0, :4].tolist())

    def on_after_backward(self) -> None:
        self.after_backward.append(float(self.blocks[1].up.weight.grad.norm()))

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.automatic_optimization:
            self._record()
            if self.surgery:  # before Lightning's clipping, which must see them
                self._surgery()

    def _surgery(self) -> None:
        """Gradient writes before the step; each must reach it (AdamW is blind to a uniform scale: none is one)."""
        self.blocks[0].up.weight.grad[0].zero_()  # through a view
        self.norm.weight.grad.add_(0.01)  # in place
        down = self.blocks[1].down.weight
        down.grad = down.grad.clamp(-1e-3, 1e-3)  # a replacement

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.losses.append(loss.item())
        self.manual_backward(loss)
        self._record()
        self._surgery()
        opt.step()
        opt.zero_grad()
        return loss


def fabric_run(run: dict, world: int) -> tuple[int, dict]:
    """The same model under Fabric: ``p.grad`` read after ``fabric.backward``, an in-place write, then
    ``fabric.clip_gradients`` (global norm) and the step."""
    if run["strategy"] == "ddp":
        strategy = FabricDDP(process_group_backend="gloo")
    else:
        strategy = zeroshard.ZeroFabricStrategy(stage=run["stage"], wrap_policy=Block if run["stage"] == 3 else None)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(7, verbose=False)
    model = TinyLM()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = token_dataset(n=8 * world)[fabric.global_rank * 8 : (fabric.global_rank + 1) * 8]
    record = {"losses": [], "peeks": [], "norms": []}
    for _ in range(4):
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        fabric.backward(loss)
        record["peeks"].append(model.blocks[0].up.weight.grad[0, :4].tolist())
        record["norms"].append(float(model.blocks[1].down.weight.grad.norm()))
        model.norm.weight.grad.add_(0.01)  # must reach the clipping and the step
        fabric.clip_gradients(model, opt, max_norm=0.05)
        opt.step()
        opt.zero_grad()
        record["losses"].append(loss.item())
    return fabric.global_rank, record


def make_strategy(run: dict):
    if run["strategy"] == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    stage = run["stage"]
    return zeroshard.ZeroStrategy(
        stage=stage,
        wrap_policy=Block if stage == 3 else None,
        offload_optimizer=run.get("offload", False),
        reduce_bucket_size=3000,
    )


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "2"))
    for run in runs:
        if run.get("fabric"):
            rank, record = fabric_run(run, world)
            (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps(record))
            continue
        L.seed_everything(7, verbose=False)
        loader = torch.utils.data.DataLoader(token_dataset(n=64), batch_size=4)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=make_strategy(run),
            max_steps=6,
            accumulate_grad_batches=run.get("accumulate", 1),
            gradient_clip_val=run.get("clip"),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
        )
        model = GradLM(manual=run.get("manual", False), surgery=run.get("surgery", False))
        trainer.fit(model, loader)
        record = {"losses": model.losses, "norms": model.norms, "peeks": model.peeks, "after": model.after_backward}
        strategy, rank = trainer.strategy, trainer.global_rank
        # the trained module pickles as under DDP (a callback may send it to another process): no engine, no process
        # group travels with it; at stage 3 every rank pickles (its placeholders gather), as every rank must read
        # (and a deep copy, e.g. an EMA's): the copies are plain modules whose forward equals the original's
        model.trainer = None
        x = token_dataset(n=4)[:][0]
        copies = [pickle.loads(pickle.dumps(model)), copy.deepcopy(model)]  # with autograd on, as a callback would
        with torch.no_grad():
            expected = model(x)
            record["copies_equal"] = [torch.equal(c(x), expected) for c in copies]
        (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps(record))
        strategy.barrier()


if __name__ == "__main__":
    main()

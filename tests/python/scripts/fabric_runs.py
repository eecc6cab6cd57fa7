"""Rank worker for the Fabric tests: several Fabric training loops in one process group.

Usage (one process per rank, started by ``launch.run_ranks``):
    fabric_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``strategy`` ("ddp", "zeroshard" or a registered name such as "zeroshard_stage_2"), and
optional ``stage``, ``offload`` (offload_optimizer), ``model`` ("torch": ``nn.TransformerEncoderLayer`` blocks,
default; "tiny": tiny_lm Blocks, which meta init can materialise), ``meta`` (build under
``fabric.init_module(empty_init=True)``), ``setup`` ("joint": ``fabric.setup(model, opt)``, default; "separate":
``setup_module`` then ``setup_optimizers``), ``accumulate`` (micro-batches per step, under ``no_backward_sync``),
``clip`` (max norm), ``two_optimizers`` (AdamW over the blocks, SGD with momentum over the rest), ``precision``,
``steps`` (default 20), ``save_at`` (``fabric.save`` after that many steps, to OUT_DIR/NAME.ckpt), ``resume_from``
(``fabric.load`` a checkpoint written by an earlier run, then continue from its step), ``state_dict_type``.
Writes ``{name}_rank{r}.json`` (losses of the steps this run trained) and, on rank 0, ``{name}.pt`` (final parameters,
fp32) and ``{name}_meta.json`` (parameter dtypes while set up).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import DDPStrategy
from tiny_lm import DIM, SEQ, VOCAB, Block, token_dataset
from torch import nn

import zeroshard


class FabricLM(nn.Module):
    """Embedding -> 2 blocks -> LayerNorm -> head tied to the embedding (a plain ``nn.Module``)."""

    def __init__(self, blocks: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        if blocks == "torch":
            # no biases: the attention's key bias gets an exactly-zero gradient in theory and rounding noise in
            # practice, which Adam's normalisation turns into O(lr) steps that differ with any change of summation order
            layer = {"d_model": DIM, "nhead": 4, "dim_feedforward": 4 * DIM, "dropout": 0.0, "batch_first": True}
            layer["bias"] = False
            self.blocks = nn.Sequential(*[nn.TransformerEncoderLayer(**layer) for _ in range(2)])
        else:
            self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(idx))))


def make_strategy(run: dict):
    if run["strategy"] == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if run["strategy"] != "zeroshard":
        return run["strategy"]  # a registered name
    stage = run.get("stage", 2)
    wrap = (nn.TransformerEncoderLayer if run.get("model", "torch") == "torch" else Block) if stage == 3 else None
    return zeroshard.ZeroFabricStrategy(
        stage=stage,
        offload_optimizer=run.get("offload", False),
        wrap_policy=wrap,
        reduce_bucket_size=3000,
        allgather_bucket_size=7000,
        state_dict_type=run.get("state_dict_type", "sharded"),
    )


def optimizers_for(model: nn.Module, two: bool) -> list[torch.optim.Optimizer]:
    if not two:
        return [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)]
    blocks = list(model.blocks.parameters())
    ids = {id(p) for p in blocks}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.AdamW(blocks, lr=1e-2, weight_decay=0.1), torch.optim.SGD(rest, lr=0.1, momentum=0.9)]


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    for run in runs:
        fabric = L.Fabric(
            accelerator="cpu", devices=2, strategy=make_strategy(run), precision=run.get("precision", "32-true")
        )
        fabric.launch()
        seed = 11 if run.get("resume_from") else 7  # a resumed run must take every value from the checkpoint
        L.seed_everything(seed, verbose=False)
        with fabric.init_module(empty_init=run.get("meta", False)):
            model = FabricLM(run.get("model", "torch"))
        assert all(p.is_meta for p in model.parameters()) == bool(run.get("meta")), "init_module did not build on meta"
        L.seed_everything(seed, verbose=False)  # meta models are initialised at setup: the same random stream
        if run.get("setup") == "separate":
            model = fabric.setup_module(model)
            optimizers = list(optimizers_for(model, run.get("two_optimizers", False)))
            opts = fabric.setup_optimizers(*optimizers)
            optimizers = [opts] if not isinstance(opts, tuple) else list(opts)
        else:
            model, *optimizers = fabric.setup(model, *optimizers_for(model, run.get("two_optimizers", False)))
        dtypes = {n: str(p.dtype) for n, p in model.named_parameters()}

        start = 0
        if run.get("resume_from"):
            state = {"model": model, "step": 0, **{f"opt{i}": o for i, o in enumerate(optimizers)}}
            remainder = fabric.load(out / f"{run['resume_from']}.ckpt", state)
            assert remainder == {}, remainder
            start = state["step"]
        loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(token_dataset(), batch_size=4))
        batches = (batch for _ in range(100) for batch in loader)  # epochs in a row (the same order each epoch)
        accumulate = run.get("accumulate", 1)
        losses = []
        for _ in range(start * accumulate):
            next(batches)
        for step in range(start, run.get("steps", 20)):
            for micro in range(accumulate):
                x, y = next(batches)
                with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                    loss = F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))
                    fabric.backward(loss / accumulate)
                losses.append(loss.item())
            if run.get("clip"):
                for opt in optimizers:
                    fabric.clip_gradients(model, opt, max_norm=run["clip"])
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
            if run.get("save_at") == step + 1:
                state = {"model": model, "step": step + 1, **{f"opt{i}": o for i, o in enumerate(optimizers)}}
                fabric.save(out / f"{run['name']}.ckpt", state)

        rank = fabric.global_rank
        (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps({"losses": losses}))
        inner = model.module  # the user's module inside Fabric's wrapper
        with zeroshard.gathered_parameters(inner):
            if rank == 0:
                params = {k: v.detach().float().clone() for k, v in inner.state_dict().items()}
                torch.save(params, out / f"{run['name']}.pt")
                (out / f"{run['name']}_meta.json").write_text(json.dumps({"dtypes": dtypes, "seq": SEQ}))
        fabric.barrier()


if __name__ == "__main__":
    main()

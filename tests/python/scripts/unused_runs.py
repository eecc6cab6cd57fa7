"""Rank worker for the unused-parameter tests: parameters no rank uses, and one only rank 0 uses, ZeRO vs DDP.

Usage (one process per rank, started by ``launch.run_ranks``):
    unused_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``strategy`` ("ddp": torch's DistributedDataParallel(find_unused_parameters=True);
"zeroshard": the engine), ``stage``, ``offload``. The model is the tiny LM's blocks plus ``never_block`` (a whole Block,
a stage-3 unit of its own, never used), ``never`` (a Linear that shares its bucket with used parameters, never used)
and ``rank0_only`` (a Linear only rank 0 uses). AdamW with weight decay 0.1 on every parameter, 5 steps. Writes
``initial.pt`` (the initial state dict), ``{name}.pt`` (rank 0: the full state dict after training) and
``{name}_rank{r}.json`` (losses).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_lm import DIM, VOCAB, Block, token_dataset
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zeroshard import ZeroConfig, ZeroEngine

STEPS = 5
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")


class UnusedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.never_block = Block()  # no rank uses it: a bucket / unit with no gradient anywhere
        self.never = nn.Linear(DIM, DIM)  # no rank uses it; shares a bucket with used parameters
        self.rank0_only = nn.Linear(DIM, DIM)  # used on rank 0 only: DDP averages in rank 1's zeros
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embed(idx))
        if dist.get_rank() == 0:
            x = x + self.rank0_only(x)
        return self.head(self.norm(x))


def train(run: dict, rank: int) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    model = UnusedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = token_dataset(n=16)[rank * 8 : (rank + 1) * 8]
    losses = []
    if run["strategy"] == "ddp":
        if rank == 0:
            torch.save(model.state_dict(), OUT / "initial.pt")
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        for _ in range(STEPS):
            loss = F.cross_entropy(ddp(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
    stage = run["stage"]
    config = ZeroConfig(
        stage=stage,
        offload_optimizer=run.get("offload", False),
        wrap_policy=Block if stage == 3 else None,
        reduce_bucket_size=3000,
        offload_chunk_size=1000,
    )
    engine = ZeroEngine(model, opt, config)
    for _ in range(STEPS):
        engine.begin_step()
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        engine.finish_backward()
        engine.optimizer.step()
        engine.after_step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    engine.remove_hooks()
    return state, losses


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for run in runs:
        state, losses = train(run, rank)
        if rank == 0:
            torch.save(state, out / f"{run['name']}.pt")
        (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps({"losses": losses}))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""Rank worker: the engine's no-offload swap of torch's AdamW (bf16 state) for the fused Adam keeps an LR scheduler.

Usage: ``device_adam_scheduler.py OUT``. A StepLR built on the user's AdamW before the engine, pointed at the engine's
optimizer by ``replace_optimizers`` (what ZeroStrategy / ZeroFabricStrategy do at setup), drives 4 steps of a stage-2
engine over CPU masters (AdamW with ``optimizer_state_dtype=torch.bfloat16`` becomes ``CPUAdam``). Rank 0 also steps a
single-process ``CPUAdam(state_dtype=torch.bfloat16)`` with the same schedule and the ranks' mean gradients, and writes
``OUT/result.pt``: both parameter sets, the optimizer's class and the learning rates seen at each step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from state_format_runs import batches, groups, loss_of, mean_grads
from tiny_lm import TinyLM

import zeroshard
from zeroshard import CPUAdam
from zeroshard.strategies.strategy_core import replace_optimizers


def schedule(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def main(out: Path) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    data = batches(world)
    torch.manual_seed(0)
    model = TinyLM()
    user_opt = torch.optim.AdamW(groups(model), lr=1e-2)
    sched = schedule(user_opt)
    config = zeroshard.ZeroConfig(stage=2, optimizer_state_dtype=torch.bfloat16, reduce_bucket_size=5000)
    engine = zeroshard.ZeroEngine(model, user_opt, config)
    replace_optimizers([user_opt], engine.optimizers, [sched])
    lrs = []
    for per_rank in data:
        engine.begin_step()
        loss_of(engine.module, per_rank[rank]).backward()
        engine.finish_backward()
        lrs.append([g["lr"] for g in engine.optimizer.param_groups])
        engine.optimizer.step()
        engine.after_step()
        sched.step()
    got = engine.full_state_dict()
    if rank == 0:
        torch.manual_seed(0)
        ref_model = TinyLM()
        ref = CPUAdam(groups(ref_model), lr=1e-2, state_dtype=torch.bfloat16)
        ref_sched = schedule(ref)
        params = dict(ref_model.named_parameters())
        for per_rank in data:
            grads = mean_grads(ref_model, per_rank)
            ref.step(grads={params[n]: g for n, g in grads.items()})
            ref_sched.step()
        follows = sched.optimizer is engine.optimizer
        torch.save({"engine": got, "reference": ref_model.state_dict(), "lrs": lrs,
                    "optimizer": type(engine.optimizer).__name__, "scheduler_follows": follows},
                   out / "result.pt")  # fmt: skip
    engine.remove_hooks()


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    main(Path(sys.argv[1]))
    dist.barrier()
    dist.destroy_process_group()

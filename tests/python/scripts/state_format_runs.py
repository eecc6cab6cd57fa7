"""Rank worker for ``optimizer_state_dtype`` (bf16 / int8 Adam moments) in the ZeRO engine against single-process
CPUAdam references.

Usage: ``state_format_runs.py OUT_DIR CASES_JSON``. Each case: ``{"name", "stage", "fmt" ("bf16" | "int8"),
"offload" (bool), "bucket" (reduce_bucket_size), optional "overlap_step" / "offload_params" (bool),
"shard_group_size" (hybrid sharding), "optimizer" ("adamw" | "cpu_adam" | "device_adam")}``. Every rank
runs every case (a fresh engine over a fresh TinyLM, ``STEPS`` steps, each rank its own batches); rank 0 also computes
the references, in process, from the same batches:

* ``per_param``: ``CPUAdam(state_dtype=fmt)`` over the model's parameters (what a user gets without zeroshard; under
  int8 the parameters below ``min_8bit_size`` = 4096 elements keep fp32 moments);
* ``same_shards``: ``CPUAdam(state_dtype=fmt)`` over tensors cut like the engine's flat shards (each flat parameter's
  padded buffer, split into ``world_size`` contiguous shards): int8 blocks of 2048 then start where the engine's do.
  Under int8 the shards of a flat parameter whose parameters all have fewer than 4096 elements keep fp32 moments
  (``fp32_state_params``), decided here from the parameters' shapes.

Gradients of the references: each rank's batch through the unsharded model, summed over ranks and divided by the world
size (the engine's SUM then / world_size). Rank 0 computes the references and writes ``OUT_DIR/{name}.pt``: the
engine's full parameters, both references' parameters, and facts about the engine's state (moment dtype,
optimizer-state bytes).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_lm import SEQ, VOCAB, Block, TinyLM

import zeroshard
from zeroshard import CPUAdam
from zeroshard.optim.device_adam import DeviceAdam

STEPS = 4
MIN_8BIT_SIZE = 4096  # bitsandbytes' default, CPUAdam's
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": "int8"}


def groups(model: torch.nn.Module) -> list[dict]:
    """Two param groups: matrices with weight decay, vectors without."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0},
    ]


def batches(world: int) -> list[list[torch.Tensor]]:
    """``STEPS`` lists of one batch per rank."""
    g = torch.Generator().manual_seed(7)
    return [[torch.randint(0, VOCAB, (4, SEQ + 1), generator=g) for _ in range(world)] for _ in range(STEPS)]


def loss_of(model, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def mean_grads(model, per_rank: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each rank's gradient of the unsharded model, summed in rank order and divided by the world size."""
    total: dict[str, torch.Tensor] = {}
    for batch in per_rank:
        model.zero_grad(set_to_none=True)
        loss_of(model, batch).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                total[n] = p.grad.clone() if n not in total else total[n] + p.grad
    model.zero_grad(set_to_none=True)
    return {n: g / len(per_rank) for n, g in total.items()}


def reference_per_param(fmt, data) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyLM()
    opt = CPUAdam(groups(model), lr=1e-2, state_dtype=fmt)
    params = dict(model.named_parameters())
    for per_rank in data:
        grads = mean_grads(model, per_rank)
        opt.step(grads={params[n]: g for n, g in grads.items()})
    return {k: v.clone() for k, v in model.state_dict().items()}


def reference_same_shards(fmt, data, engine) -> dict[str, torch.Tensor]:
    """CPUAdam over the engine's shard boundaries: per flat parameter a padded fp32 buffer laid out as the engine lays
    it out (``fp.layout.views``), cut into ``world_size`` contiguous shards, each one CPUAdam parameter."""
    torch.manual_seed(0)
    model = TinyLM()
    params = dict(model.named_parameters())
    world = engine.world_size
    flats, opt_groups = [], [{"params": [], "weight_decay": g["weight_decay"]} for g in groups(model)]
    fp32_state = []
    for fp in engine.flat_params:
        full = torch.zeros(fp.layout.padded_numel)
        views = fp.layout.views(full)
        names = [n.removeprefix("_forward_module.") for n in fp.names]
        for name, view in zip(names, views):
            view.copy_(params[name].detach().reshape(view.shape))
        shards = list(full.view(world, -1))
        if all(params[n].numel() < MIN_8BIT_SIZE for n in names):
            fp32_state += shards
        flats.append((names, full, fp.layout, shards))
        opt_groups[engine.optim.group_index_of(fp)]["params"].extend(shards)
    opt = CPUAdam(opt_groups, lr=1e-2, state_dtype=fmt, fp32_state_params=fp32_state if fmt == "int8" else None)
    for per_rank in data:
        grads = mean_grads(model, per_rank)
        step_grads = {}
        for names, full, layout, shards in flats:
            gfull = torch.zeros_like(full)
            for name, view in zip(names, layout.views(gfull)):
                view.copy_(grads[name].reshape(view.shape))
            step_grads.update(dict(zip(shards, gfull.view(world, -1))))
        opt.step(grads=step_grads)
        with torch.no_grad():
            for names, full, layout, _ in flats:
                for name, view in zip(names, layout.views(full)):
                    params[name].copy_(view.reshape(params[name].shape))
    return {k: v.clone() for k, v in model.state_dict().items()}


def run_case(out: Path, case: dict) -> None:
    fmt = FORMATS[case["fmt"]]
    stage = case["stage"]
    world, rank = dist.get_world_size(), dist.get_rank()
    data = batches(world)
    torch.manual_seed(0)
    model = TinyLM()
    # without offload the engine steps a CPUAdam (whose format comes from the setting); with offload it converts AdamW.
    # "optimizer": "adamw" / "device_adam" gives that one instead (without offload the engine swaps an AdamW for
    # CPUAdam on these CPU masters; a DeviceAdam is kept and steps them with torch ops)
    kind = case.get("optimizer", "adamw" if case["offload"] else "cpu_adam")
    opt = {"adamw": torch.optim.AdamW, "cpu_adam": CPUAdam, "device_adam": DeviceAdam}[kind](groups(model), lr=1e-2)
    config = zeroshard.ZeroConfig(
        stage=stage,
        offload_optimizer=case["offload"],
        optimizer_state_dtype=fmt,
        reduce_bucket_size=case.get("bucket", 25_000_000),
        wrap_policy=Block if stage == 3 else None,
        overlap_step=case.get("overlap_step", False),
        offload_params=case.get("offload_params", False),
        shard_group_size=case.get("shard_group_size"),
    )
    engine = zeroshard.ZeroEngine(model, opt, config)
    for per_rank in data:
        engine.begin_step()
        loss_of(engine.module, per_rank[rank]).backward()
        engine.finish_backward()
        engine.optimizer.step()
        engine.after_step()
    got = engine.full_state_dict()
    states = [engine.optimizer.state[fp.master] for fp in engine.flat_params]
    facts = {
        "optimizer": type(engine.optimizer).__name__,
        "moment_dtypes": [str(st["exp_avg"].dtype) for st in states],  # per flat parameter
        "absmax": ["exp_avg_absmax" in st for st in states],
        "param_numels": [[math.prod(s) for s in fp.shapes] for fp in engine.flat_params],
        "optimizer_state_bytes": engine.memory_summary()["optimizer_state"],
        "shard_numels": [fp.layout.shard_numel for fp in engine.flat_params],
    }
    if rank == 0:  # the references need no other rank
        refs = {"per_param": reference_per_param(fmt, data), "same_shards": reference_same_shards(fmt, data, engine)}
        torch.save({"engine": got, **refs, "facts": facts}, out / f"{case['name']}.pt")
    engine.remove_hooks()


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    for c in cases:
        run_case(out_dir, c)
    dist.barrier()
    dist.destroy_process_group()

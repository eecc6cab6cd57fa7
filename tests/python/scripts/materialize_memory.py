"""Rank worker: peak host memory while ZeRO-3 materialises a meta model, against the layout's own numbers.

Usage: materialize_memory.py OUT_JSON. Builds an 8-block model (about 134 MB of fp32 parameters) on the meta device,
then lets ZeroEngine(stage=3) materialise it unit by unit. Peak RSS (ru_maxrss) growth during that is compared with
what the layout says must be alive at once: this rank's shards of every unit, plus the largest unit and the root
unit whole while they are flattened, plus the flat buffer's one transient copy.
"""

from __future__ import annotations

import json
import resource
import sys

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import ZeroConfig, ZeroEngine
from zeroshard.meta_init import init_meta_context

DIM, LAYERS = 1024, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])

    def forward(self, x):
        return self.blocks(self.inp(x))


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    with init_meta_context():
        model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.zeros(1)  # touch the allocator before the baseline
    before = rss_peak_bytes()
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3, wrap_policy=Block))
    growth = rss_peak_bytes() - before

    units = engine.sharded.units
    shard_bytes = sum(fp.shard.numel() * fp.shard.element_size() for u in units for fp in u.flat_params)
    full_bytes = [sum(fp.full_nbytes for fp in u.flat_params) for u in units]
    # alive at once: all shards, the root unit (done last) and one block unit whole, and one flatten's source copy
    bound = shard_bytes + full_bytes[0] + 2 * max(full_bytes[1:])
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    out = {"rank": dist.get_rank(), "growth": growth, "bound": bound, "model_bytes": model_bytes}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(gathered, f)
    dist.barrier()


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # torch asks for it; a gloo group alive at exit can abort it (pytorch/pytorch#190489)
        dist.destroy_process_group()

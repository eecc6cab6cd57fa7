"""Rank worker: collectives per ZeRO stage-3 step, counted by the C++ layer (``engine.comm_stats()``).

Usage: collective_count_runs.py OUT_DIR   (2 ranks)

Runs, each a ZeroEngine(stage=3) stepped 3 times on a fixed batch with ``begin_step / backward / finish_backward /
step / after_step``, against a whole copy of the model trained alone on the concatenation of both ranks' batches (the
data-parallel reference, written here, not zeroshard's):

* ``gpt``: the examples' GPT, 2 blocks, units = blocks; AdamW with two param groups (decay / no decay), so every unit
  has two trainable flat parameters;
* ``odd``: a model whose unit sizes divide by neither 2 nor the alignment (37 x 53 and 53 x 29 linears, a 3-element
  gain), one param group, one frozen parameter in a block (a unit with a frozen flat parameter), prefetch off;
* ``gpt6``: the GPT with 6 blocks and the default prefetch bucket (2M elements): every prefetch takes all the
  blocks left in one all-gather;
* ``gpt6_pairs``: the same with a prefetch bucket of 2.5 blocks: prefetches take two blocks at a time.

Writes ``{name}_rank{r}.json``: the last step's counts per kind, each unit's number of trainable flat parameters and
whether it is the root, and the largest difference from the reference's losses and parameters.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import zeroshard  # noqa: E402
from gpt import GPT, Block, GPTConfig  # noqa: E402

STEPS = 3


class OddBlock(nn.Module):
    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(37, 53)
        self.down = nn.Linear(53, 37, bias=False)
        self.scale = nn.Parameter(torch.full((37,), 0.9), requires_grad=not frozen)

    def forward(self, x):
        return x + self.scale * self.down(torch.tanh(self.up(x)))


class OddModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(29, 37)
        self.blocks = nn.Sequential(OddBlock(), OddBlock(frozen=True), OddBlock())
        self.gain = nn.Parameter(torch.ones(3))
        self.head = nn.Linear(37, 29)

    def forward(self, x):
        h = self.blocks(self.embed(x))
        return self.head(h) * self.gain.mean()


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def _groups(model: nn.Module, two_groups: bool) -> list[dict]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not two_groups:
        return [{"params": trainable}]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]


def run(
    name: str, model: nn.Module, vocab: int, wrap, two_groups: bool, prefetch: bool, bucket_units: float = 0.0
) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(_groups(ref, two_groups), lr=1e-2)
    engine = zeroshard.ZeroEngine(
        model,
        torch.optim.AdamW(_groups(model, two_groups), lr=1e-2),
        zeroshard.ZeroConfig(stage=3, wrap_policy=wrap, prefetch=prefetch),
    )
    if bucket_units:  # in units of one block's gathered size (its flat parameters and every rank's tag)
        block = engine.sharded.units[1]
        size = sum(fp.layout.padded_numel for fp in block.flat_params) + world * 4
        engine.sharded.prefetch_bucket_size = int(bucket_units * size)
    batches = [torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    loss_diff = 0.0
    for _ in range(STEPS):
        with torch.no_grad():
            ref_rank_loss = _loss(ref, batches[rank]).item()  # what this rank's loss must be before the step
        engine.begin_step()
        loss = _loss(model, batches[rank])
        loss.backward()
        engine.finish_backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        engine.after_step()
        loss_diff = max(loss_diff, abs(loss.item() - ref_rank_loss))
        # reference step: the mean of the ranks' losses (equal-size batches) is the data-parallel loss
        (sum(_loss(ref, b) for b in batches) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with zeroshard.gathered_parameters(model):
        got = {k: v.detach().clone() for k, v in model.named_parameters()}
    param_diff = max((got[k] - v.detach()).abs().max().item() for k, v in ref.named_parameters())
    comm = engine.comm_stats()
    return {
        "name": name,
        "last_step": {k: comm["last_step"][k]["calls"] for k in ("all_gather", "reduce_scatter", "all_reduce")},
        "steps": comm["steps"],
        "units": [{"root": u.is_root, "trainable": len(u.trainable)} for u in engine.sharded.units],
        "param_diff": param_diff,
        "loss_diff": loss_diff,
    }


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    results = [run("gpt", GPT(cfg), cfg.vocab_size, Block, two_groups=True, prefetch=True)]
    torch.manual_seed(0)
    results.append(run("odd", OddModel(), 29, OddBlock, two_groups=False, prefetch=False))
    cfg6 = GPTConfig(n_layer=6, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    results.append(run("gpt6", GPT(cfg6), cfg6.vocab_size, Block, two_groups=True, prefetch=True))
    torch.manual_seed(0)
    results.append(
        run("gpt6_pairs", GPT(cfg6), cfg6.vocab_size, Block, two_groups=True, prefetch=True, bucket_units=2.5)
    )
    for r in results:
        (out / f"{r['name']}_rank{rank}.json").write_text(json.dumps(r))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

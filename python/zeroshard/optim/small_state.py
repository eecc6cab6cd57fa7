"""Which of the ZeRO engine's flat parameters keep fp32 Adam moments under int8 optimizer state.

bitsandbytes keeps 32-bit state for every tensor of fewer than ``min_8bit_size`` elements (4096 by default;
``Optimizer2State.init_state`` in ``bitsandbytes/optim/optimizer.py``), and ``CPUAdam(state_dtype="int8")`` follows it
per parameter (:meth:`~zeroshard.optim.cpu_adam.CPUAdam.state_format`). The engine's optimizer steps flat master
shards instead, one per bucket (stages 1-2) or per unit and group (stage 3), each covering many parameters, so the
size rule cannot be applied to them as tensors: a shard of large parameters may be small, a flat parameter of many
norm weights large. Instead, under int8:

1. the parameters below the threshold go into flat parameters of their own (:func:`apart_rule`, given to
   :func:`~zeroshard.sharding.buckets.plan_buckets` / :func:`~zeroshard.sharding.units.plan_units`; buckets and units
   never mix param groups, so this is per group, and per unit at stage 3);
2. the optimizer keeps fp32 moments for exactly those flat parameters' master shards (:func:`fp32_state_masters`,
   ``CPUAdam(fp32_state_params=...)`` / :meth:`~zeroshard.optim.cpu_adam.CPUAdam.keep_fp32_state`), int8 for the rest.

Each parameter's moments are then in the format the single-process ``CPUAdam`` would keep them in. With fp32 or bf16
state nothing changes: no parameter is set apart, the flat parameters are the ones of before.

The threshold is the optimizer's ``min_8bit_size`` (a ``CPUAdam``'s own), or :data:`MIN_8BIT_SIZE` (4096) for
torch's Adam/AdamW converted under ``offload_optimizer``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.optim.state_format import MIN_8BIT_SIZE
from zeroshard.sharding.buckets import Apart
from zeroshard.sharding.flat_param import FlatParam

__all__ = ["apart_rule", "fp32_state_masters", "min_8bit_size_of"]


def min_8bit_size_of(optimizer: Any) -> int:
    """The threshold ``optimizer`` keeps int8 moments from: its ``min_8bit_size`` (a ``CPUAdam``), else 4096."""
    return int(getattr(optimizer, "min_8bit_size", MIN_8BIT_SIZE))


def apart_rule(thresholds: Sequence[int | None]) -> Apart | None:
    """``apart(group_index, param)`` for the planners: True for a parameter of fewer elements than its group's
    threshold. ``thresholds``: per global param group, ``min_8bit_size`` where the group's moments are int8, else
    ``None`` (no parameter set apart). Returns ``None`` when no group is int8 (the layouts of before)."""
    if all(t is None for t in thresholds):
        return None

    def apart(group_index: int, p: nn.Parameter) -> bool:
        t = thresholds[group_index]
        return t is not None and p.numel() < t

    return apart


def keeps_fp32_state(fp: FlatParam, threshold: int) -> bool:
    """Whether flat parameter ``fp``'s master keeps fp32 moments: every parameter in it is below ``threshold``
    elements (so a flat parameter built without the split, holding a large parameter too, keeps int8)."""
    return all(math.prod(shape) < threshold for shape in fp.shapes)


def fp32_state_masters(flat_params: Sequence[FlatParam], thresholds: Sequence[int | None]) -> list[torch.Tensor]:
    """The master shards that keep fp32 moments: of each trainable flat parameter whose group (``thresholds``, indexed
    by the flat parameter's position's group as :func:`apart_rule`) is int8 and whose parameters are all below its
    threshold. ``thresholds`` here: one per flat parameter."""
    return [
        fp.master
        for fp, t in zip(flat_params, thresholds)
        if fp.master is not None and t is not None and keeps_fp32_state(fp, t)
    ]

"""Bucket assignment for ZeRO stages 1-2: which parameters share a flat parameter.

Parameters are taken in reverse registration order, which is close to the order in which backward produces their
gradients (the same heuristic as DDP's first-iteration buckets), and cut into buckets of at most ``bucket_elems``
elements. A bucket never mixes optimizer param groups (each group keeps its own hyperparameters on its master shards),
dtypes or devices, nor parameters the caller asks to keep apart (``apart``: under int8 optimizer state, the small
parameters whose moments stay fp32, so each flat parameter's master shard has one state format). Frozen parameters and
parameters the optimizer does not hold are not bucketed: they get no gradient communication and no optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn


@dataclass
class BucketPlan:
    """Parameters of one future flat parameter."""

    group_index: int
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)
    numel: int = 0
    apart: bool = False  # holds only parameters ``apart`` picked (the engine: fp32 optimizer state under int8)


Apart = Callable[[int, nn.Parameter], bool]


def plan_buckets(
    module: nn.Module, param_groups: list[list[nn.Parameter]], bucket_elems: int, apart: Apart | None = None
) -> tuple[list[BucketPlan], list[str]]:
    """Cuts the trainable parameters of ``module`` into buckets.

    Args:
        module: the model; ``named_parameters()`` gives names (tied parameters appear once, under their first name).
        param_groups: the optimizer's parameter lists, one per param group.
        bucket_elems: the most elements in one bucket; a larger parameter gets a bucket of its own.
        apart: ``apart(group_index, param)``: True puts the parameter in buckets of such parameters only (default:
            none apart, the buckets of before).

    Returns:
        ``(buckets, skipped)``: buckets in expected backward order, and the names of trainable parameters that no
        optimizer group holds (left unsharded).

    Raises:
        ValueError: if a parameter appears in two param groups, or an optimizer parameter is not in the module.
    """
    group_of: dict[int, int] = {}
    for gi, params in enumerate(param_groups):
        for p in params:
            if id(p) in group_of:
                raise ValueError("a parameter appears in more than one optimizer param group; list it once")
            group_of[id(p)] = gi

    named = list(module.named_parameters())
    in_module = {id(p) for _, p in named}
    missing = [gi for gi, params in enumerate(param_groups) for p in params if id(p) not in in_module]
    if missing:
        raise ValueError(
            f"the optimizer holds parameters that are not in the LightningModule (param groups {sorted(set(missing))});"
            " build the optimizer from self.parameters() in configure_optimizers"
        )

    buckets: list[BucketPlan] = []
    open_bucket: dict[tuple, BucketPlan] = {}
    skipped: list[str] = []
    for name, p in reversed(named):
        if not p.requires_grad:
            continue
        if id(p) not in group_of:
            skipped.append(name)
            continue
        gi = group_of[id(p)]
        key = (gi, p.dtype, p.device, apart is not None and apart(gi, p))
        bucket = open_bucket.get(key)
        if bucket is not None and bucket.numel + p.numel() > bucket_elems:
            bucket = None
        if bucket is None:
            bucket = BucketPlan(group_index=gi, apart=key[3])
            buckets.append(bucket)
            open_bucket[key] = bucket
        bucket.names.append(name)
        bucket.params.append(p)
        bucket.numel += p.numel()
    return buckets, skipped

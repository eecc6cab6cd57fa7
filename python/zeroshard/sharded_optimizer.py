"""Points a user's torch optimizer at the fp32 master shards instead of the module's parameters.

The optimizer object is kept (so LR schedulers built on it in ``configure_optimizers`` keep working): each param group's
``params`` list is replaced by the master shards of the buckets built from that group. The step then runs on this rank's
shard only, which is ZeRO stage 1's saving (Rajbhandari et al. 2020, section 5.1): any torch optimizer works unchanged
because every per-element state tensor it creates has the master shard's shape.

With ``offload_optimizer=True``, ``torch.optim.Adam``/``AdamW`` are swapped for
:class:`zeroshard.offload.OffloadedAdam` (a :class:`zeroshard.cpu_adam.CPUAdam`) with the same hyperparameters
(DeepSpeed's ZeRO-Offload does the same swap); any other optimizer runs as it is on the host copies.
"""

from __future__ import annotations

import warnings

import torch
from torch.optim import Optimizer

from zeroshard.flat_param import FlatParam


def original_param_groups(optimizer: Optimizer) -> list[list[torch.nn.Parameter]]:
    """The parameter lists of each param group, before rewiring (kept for checkpoints in torch's format)."""
    return [list(group["params"]) for group in optimizer.param_groups]


def rewire(optimizer: Optimizer, flat_params: list[FlatParam], group_of_flat: list[int]) -> None:
    """Replaces each param group's parameters by the master shards of its buckets.

    Raises:
        RuntimeError: if the optimizer already holds state (it must be fresh, as returned by ``configure_optimizers``).
    """
    if optimizer.state:
        raise RuntimeError(
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameters; zeroshard must "
            "shard a fresh optimizer. Restore optimizer state through the Trainer's checkpoint instead."
        )
    for gi, group in enumerate(optimizer.param_groups):
        group["params"] = [fp.master for fp, g in zip(flat_params, group_of_flat) if g == gi]


def to_cpu_adam(optimizer: Optimizer, cls: type | None = None, **extra) -> Optimizer:
    """Returns a :class:`~zeroshard.cpu_adam.CPUAdam` (or subclass ``cls``, built with ``extra`` keyword arguments)
    equivalent to ``optimizer`` if it is Adam or AdamW, else ``optimizer`` itself.

    Param group entries are copied as they are (``initial_lr`` and others that LR schedulers added included), so a
    scheduler can be pointed at the returned optimizer.
    """
    from zeroshard.cpu_adam import CPUAdam

    cls = cls or CPUAdam

    if type(optimizer) is torch.optim.AdamW:
        adamw_mode = True
    elif type(optimizer) is torch.optim.Adam:
        adamw_mode = bool(optimizer.defaults.get("decoupled_weight_decay", False))
    else:
        warnings.warn(
            f"offload_optimizer=True with {type(optimizer).__name__}: it runs unfused on the host copies of the master "
            "weights. Return torch.optim.Adam or AdamW from configure_optimizers to get the fused CPUAdam.",
            stacklevel=2,
        )
        return optimizer
    unsupported = [k for k in ("amsgrad", "maximize") if optimizer.defaults.get(k)]
    if unsupported:
        warnings.warn(
            f"offload_optimizer=True: CPUAdam has no {unsupported}; keeping {type(optimizer).__name__} on the host.",
            stacklevel=2,
        )
        return optimizer
    d = optimizer.defaults
    cpu_adam = cls(
        [dict(group) for group in optimizer.param_groups],
        lr=d["lr"],
        betas=d["betas"],
        eps=d["eps"],
        weight_decay=d["weight_decay"],
        adamw_mode=adamw_mode,
        **extra,
    )
    return cpu_adam

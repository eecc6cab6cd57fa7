"""Which state format each of the ZeRO engine's optimizers keeps its Adam moments in, decided before training.

``ZeroConfig.optimizer_state_dtype`` (``torch.float32``, ``torch.bfloat16`` or ``"int8"``:
:mod:`zeroshard.optim.state_format`) is honoured by the fused CPU Adam only:

* a :class:`~zeroshard.optim.cpu_adam.CPUAdam`, on every path: without offload it steps the master shards where it
  is (CPU masters), with ``offload_optimizer=True`` it becomes an ``OffloadedAdam`` in the same format;
* torch's ``Adam`` / ``AdamW`` with ``offload_optimizer=True`` (replaced by ``OffloadedAdam``,
  :func:`~zeroshard.optim.sharded_optimizer.to_cpu_adam`).

Any other optimizer keeps its own state (fp32 for torch's Adam), so a non-fp32 setting with it is refused here, before
any shard is allocated. The format: the setting when it is not fp32; with the fp32 default, a ``CPUAdam``'s own
``state_dtype`` (so ``CPUAdam(..., state_dtype="int8")`` alone is enough). A ``CPUAdam`` built with another non-fp32
format than a non-fp32 setting is refused (two different answers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from zeroshard.optim.cpu_adam import CPUAdam
from zeroshard.optim.sharded_optimizer import PendingOptimizer, fused_adam_kind
from zeroshard.optim.state_format import check_state_dtype

__all__ = ["apply_state_dtype", "resolve_state_dtype"]


def resolve_state_dtype(setting: Any, optimizer: Optimizer, offload: bool, index: int = 0) -> torch.dtype | str:
    """The format optimizer ``index`` keeps its moments in under ``optimizer_state_dtype=setting``.

    Args:
        setting: ``ZeroConfig.optimizer_state_dtype``.
        optimizer: the user's optimizer, before the engine rewires or converts it.
        offload: ``ZeroConfig.offload_optimizer``.
        index: the optimizer's position, named in errors.

    Returns:
        ``torch.float32``, ``torch.bfloat16`` or ``"int8"``.

    Raises:
        ValueError: the setting is not a state format (naming the accepted ones); a non-fp32 format for an optimizer
            that cannot keep it (naming the optimizer and the two fixes); a ``CPUAdam`` whose own non-fp32
            ``state_dtype`` differs from a non-fp32 setting.
    """
    setting = check_state_dtype(setting)
    own = optimizer.state_dtype if isinstance(optimizer, CPUAdam) else None
    if own is not None and own != torch.float32 and setting != torch.float32 and own != setting:
        raise ValueError(
            f"zeroshard: optimizer {index} is CPUAdam(state_dtype={own!r}) but optimizer_state_dtype={setting!r}; "
            "give the format once (either setting alone is enough) or give both the same"
        )
    chosen = setting if setting != torch.float32 else (own or torch.float32)
    if chosen == torch.float32 or isinstance(optimizer, PendingOptimizer):
        return chosen  # a pending optimizer is resolved again when the real one is set up
    kind = fused_adam_kind(optimizer)
    if kind == "cpu_adam" or (offload and kind is not None):
        return chosen
    why = (
        "without offload_optimizer=True the engine steps it as it is, in its own fp32 state"
        if kind is not None
        else "only the fused Adam (zeroshard.optim.CPUAdam, or torch's Adam/AdamW without amsgrad/maximize under "
        "offload_optimizer=True) keeps bf16 or int8 moments"
    )
    raise ValueError(
        f"zeroshard: optimizer_state_dtype={chosen!r} cannot apply to optimizer {index} "
        f"({type(optimizer).__module__}.{type(optimizer).__name__}): {why}. Use zeroshard.optim.CPUAdam (CPU master "
        "weights), or torch.optim.Adam/AdamW with offload_optimizer=True, or optimizer_state_dtype=torch.float32."
    )


def apply_state_dtype(optimizer: Optimizer, state_dtype: torch.dtype | str) -> None:
    """Without offload: a fresh ``CPUAdam`` takes ``state_dtype`` (:meth:`CPUAdam.use_state_dtype`); any other
    optimizer is left as it is (:func:`resolve_state_dtype` allowed only fp32 for it)."""
    if isinstance(optimizer, CPUAdam) and optimizer.state_dtype != state_dtype:
        optimizer.use_state_dtype(state_dtype)

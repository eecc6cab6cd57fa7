"""Which state format each of the ZeRO engine's optimizers keeps its Adam moments in, and which Adam steps them.

``ZeroConfig.optimizer_state_dtype`` (``torch.float32``, ``torch.bfloat16`` or ``"int8"``:
:mod:`zeroshard.optim.state_format`) is honoured by the fused Adam in its three forms, over the same state:

* with ``offload_optimizer=True``: ``OffloadedAdam`` (the C++ kernel on host master shards), which replaces a
  ``CPUAdam`` or torch's ``Adam`` / ``AdamW`` (:func:`~zeroshard.optim.sharded_optimizer.to_cpu_adam`);
* without offload, master shards on the CPU: :class:`~zeroshard.optim.cpu_adam.CPUAdam` (the same kernel); torch's
  ``Adam`` / ``AdamW`` are replaced by one when the format is not fp32;
* without offload, master shards on the GPU: :class:`~zeroshard.optim.device_adam.DeviceAdam` (torch ops, the
  kernel's bits), which replaces a ``CPUAdam`` (whatever its format: the kernel steps CPU tensors only) and torch's
  ``Adam`` / ``AdamW`` when the format is not fp32 (with fp32 moments torch's own fused step is kept).

A ``DeviceAdam`` given by the user is kept on any device (this is how the engine path is tested on CPU). Torch's
Adam / AdamW with ``amsgrad`` or ``maximize``, and any other optimizer, keep their own fp32 state: a non-fp32 setting
with them is refused here, before any shard is allocated. The format: the setting when it is not fp32; with the fp32
default, a ``CPUAdam``'s own ``state_dtype`` (so ``CPUAdam(..., state_dtype="int8")`` alone is enough). A ``CPUAdam``
built with another non-fp32 format than a non-fp32 setting is refused (two different answers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from zeroshard.optim.cpu_adam import CPUAdam
from zeroshard.optim.device_adam import DeviceAdam
from zeroshard.optim.sharded_optimizer import PendingOptimizer, fused_adam_kind
from zeroshard.optim.state_format import check_state_dtype

__all__ = ["adam_class_without_offload", "apply_state_dtype", "resolve_state_dtype"]


def resolve_state_dtype(setting: Any, optimizer: Optimizer, offload: bool, index: int = 0) -> torch.dtype | str:
    """The format optimizer ``index`` keeps its moments in under ``optimizer_state_dtype=setting``.

    Args:
        setting: ``ZeroConfig.optimizer_state_dtype``.
        optimizer: the user's optimizer, before the engine rewires or converts it.
        offload: ``ZeroConfig.offload_optimizer`` (every fused Adam keeps every format, with or without it).
        index: the optimizer's position, named in errors.

    Returns:
        ``torch.float32``, ``torch.bfloat16`` or ``"int8"``.

    Raises:
        ValueError: the setting is not a state format (naming the accepted ones); a non-fp32 format for an optimizer
            that cannot keep it (naming the optimizer and the fixes); a ``CPUAdam`` whose own non-fp32
            ``state_dtype`` differs from a non-fp32 setting.
    """
    del offload  # kept in the signature: callers pass it, and the rule may depend on it again
    setting = check_state_dtype(setting)
    own = optimizer.state_dtype if isinstance(optimizer, CPUAdam) else None
    if own is not None and own != torch.float32 and setting != torch.float32 and own != setting:
        raise ValueError(
            f"zeroshard: optimizer {index} is {type(optimizer).__name__}(state_dtype={own!r}) but "
            f"optimizer_state_dtype={setting!r}; give the format once (either setting alone is enough) or give both "
            "the same"
        )
    chosen = setting if setting != torch.float32 else (own or torch.float32)
    if chosen == torch.float32 or isinstance(optimizer, PendingOptimizer):
        return chosen  # a pending optimizer is resolved again when the real one is set up
    if fused_adam_kind(optimizer) is not None:
        return chosen
    raise ValueError(
        f"zeroshard: optimizer_state_dtype={chosen!r} cannot apply to optimizer {index} "
        f"({type(optimizer).__module__}.{type(optimizer).__name__}): only the fused Adam keeps bf16 or int8 moments "
        "(zeroshard.optim.CPUAdam / DeviceAdam, or torch.optim.Adam/AdamW without amsgrad/maximize, which the engine "
        "replaces by one). Use one of those, or optimizer_state_dtype=torch.float32."
    )


def adam_class_without_offload(
    optimizer: Optimizer, state_dtype: torch.dtype | str, master_device: torch.device | None
) -> type | None:
    """Without offload: the fused Adam class that replaces ``optimizer`` over master shards on ``master_device``
    (see the module docstring), or ``None`` to keep it as it is (``master_device`` None: it steps no shard).

    CUDA (any non-CPU) masters: ``DeviceAdam`` for a ``CPUAdam`` that is not one already, and for torch's Adam/AdamW
    with a non-fp32 format. CPU masters: ``CPUAdam`` for torch's Adam/AdamW with a non-fp32 format."""
    if master_device is None or isinstance(optimizer, DeviceAdam):
        return None
    kind = fused_adam_kind(optimizer)
    on_cpu = master_device.type == "cpu"
    if kind == "cpu_adam":
        return None if on_cpu else DeviceAdam
    if kind is not None and state_dtype != torch.float32:
        return CPUAdam if on_cpu else DeviceAdam
    return None


def apply_state_dtype(optimizer: Optimizer, state_dtype: torch.dtype | str) -> None:
    """A fresh ``CPUAdam`` (or ``DeviceAdam``) takes ``state_dtype`` (:meth:`CPUAdam.use_state_dtype`); any other
    optimizer is left as it is (:func:`resolve_state_dtype` allowed only fp32 for it, or it is replaced)."""
    if isinstance(optimizer, CPUAdam) and optimizer.state_dtype != state_dtype:
        optimizer.use_state_dtype(state_dtype)

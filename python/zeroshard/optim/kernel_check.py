"""A native Adam kernel is trusted on a device only after it gave the torch-ops step's bits there once.

:class:`~zeroshard.optim.device_adam.DeviceAdam` steps CUDA parameters with zeroshard's CUDA kernel
(``csrc/adam/adam_kernel_cuda.cu``), which is written to give the CPU kernel's bits, as
:func:`~zeroshard.optim.torch_state_step.adam_step_torch` does. Before the first step of each (device, state format,
param dtype, grad dtype) both run on copies of the first chunk of the parameter being stepped; if any bit differs
(a GPU, driver or compiler that rounds otherwise; any NaN equals any NaN), a warning says so and that combination keeps
the torch-ops step: slower, never silently different. The check costs one chunk's step, once per combination and
process.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from zeroshard.ops import QUANT_BLOCK
from zeroshard.optim.state_format import ABSMAX_KEYS, format_of
from zeroshard.optim.torch_state_step import CHUNK, adam_step_torch

__all__ = ["kernel_agrees"]

_VERDICTS: dict[tuple, bool] = {}

KernelStep = Callable[..., Any]  # (param, grad, exp_avg, exp_avg_sq, *, step, lr, ..., exp_avg_absmax=...) in place


def _first_chunk(p: torch.Tensor, g: torch.Tensor, st: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Copies of the first :data:`CHUNK` elements of ``p``, ``g`` and the moments (with their blocks' absmax)."""
    n = min(p.numel(), CHUNK)
    blocks = -(-n // QUANT_BLOCK)
    state = {k: st[k].reshape(-1)[:n].clone() for k in ("exp_avg", "exp_avg_sq")}
    state |= {k: st[k][:blocks].clone() for k in ABSMAX_KEYS if k in st}
    return p.detach().reshape(-1)[:n].clone(), g.detach().reshape(-1)[:n].clone(), state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ, any NaN equal to any NaN: a CUDA operation that makes a NaN writes 0x7FFFFFFF,
    where x86 passes on its operand's NaN (the kernels' 0x7FC00000), and a NaN's payload carries nothing."""
    differ = _bits(a) != _bits(b)
    if a.is_floating_point():
        differ &= ~(a.isnan() & b.isnan())
    return int(differ.sum())


def kernel_agrees(kernel: KernelStep, p: torch.Tensor, g: torch.Tensor, st: dict[str, Any], **step_args: Any) -> bool:
    """Whether ``kernel`` gives :func:`adam_step_torch`'s bits for this parameter's device and formats (decided on
    the first call for each, then remembered). Nothing of ``p``, ``g`` or ``st`` is modified.

    Args:
        kernel: a step with :func:`zeroshard.ops.adam_step`'s signature (in place; absmax as keywords).
        p, g, st: the parameter, its gradient and its state (``exp_avg``, ``exp_avg_sq``, int8 absmax) about to be
            stepped, all on one device.
        step_args: ``step``, ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``, ``adamw_mode``,
            ``bias_correction`` of that step.

    Warns:
        RuntimeWarning: the first time a combination disagrees, naming it and how many elements differed.
    """
    key = (p.device, format_of(st), p.dtype, g.dtype)
    if key not in _VERDICTS:
        p_ref, g_ref, st_ref = _first_chunk(p, g, st)
        p_k, g_k, st_k = _first_chunk(p, g, st)
        adam_step_torch(p_ref, g_ref, st_ref, **step_args)
        absmax = {k: st_k[k] for k in ABSMAX_KEYS if k in st_k}
        kernel(p_k, g_k, st_k["exp_avg"], st_k["exp_avg_sq"], **step_args, **absmax)
        differ = _differ(p_k, p_ref) + sum(_differ(st_k[k], st_ref[k]) for k in st_ref)
        _VERDICTS[key] = differ == 0
        if differ:
            warnings.warn(
                f"zeroshard's Adam kernel on {p.device} differs from the reference step in {differ} elements of the "
                f"first {p_k.numel()} (state {key[1]}, param {p.dtype}, grad {g.dtype}); stepping these parameters "
                "with torch ops instead (slower, the same bits as the CPU kernel). Please report it with your GPU, "
                "driver and torch versions",
                RuntimeWarning,
                stacklevel=3,
            )
    return _VERDICTS[key]

"""State formats of the fused CPU Adam: how ``exp_avg`` / ``exp_avg_sq`` are kept (see ``zeroshard.ops.adam_step``).

- ``torch.float32``: fp32 moments, torch's own keys and dtypes (8 bytes per parameter).
- ``torch.bfloat16``: bf16 moments, rounded to nearest even on every store (4 bytes).
- ``"int8"``: block-wise dynamic 8-bit moments (Dettmers et al. 2022; bitsandbytes' blockwise 8-bit Adam):
  ``exp_avg`` / ``exp_avg_sq`` hold uint8 codes shaped like the parameter, ``exp_avg_absmax`` /
  ``exp_avg_sq_absmax`` one fp32 scale per block of 2048 elements (2 + 8/2048 bytes).

Under ``"int8"`` a tensor of fewer than :data:`MIN_8BIT_SIZE` (4096) elements keeps fp32 moments, as bitsandbytes
does (``min_8bit_size=4096``; ``Optimizer2State.init_state`` in ``bitsandbytes/optim/optimizer.py``, commit 06029dd):
norm weights and biases. A state's format is read from its own tensors (:func:`format_of`), so one optimizer may hold
both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from zeroshard.ops import QUANT_BLOCK, dequantize_state, quantize_state

__all__ = [
    "ABSMAX_KEYS",
    "MIN_8BIT_SIZE",
    "STATE_DTYPES",
    "check_min_8bit_size",
    "check_state_dtype",
    "convert_moments",
    "format_of",
    "moment_bytes",
    "moments_fp32",
]

STATE_DTYPES = (torch.float32, torch.bfloat16, "int8")
ABSMAX_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")
_MOMENTS = ("exp_avg", "exp_avg_sq")
# bitsandbytes' default min_8bit_size: tensors with fewer elements keep 32-bit state under its 8-bit optimizers
MIN_8BIT_SIZE = 4096


def check_state_dtype(state_dtype: Any) -> torch.dtype | str:
    """``state_dtype`` as one of :data:`STATE_DTYPES`; raises ValueError naming the accepted values otherwise."""
    for accepted in STATE_DTYPES:
        if type(state_dtype) is type(accepted) and state_dtype == accepted:
            return accepted
    raise ValueError(
        f"state_dtype={state_dtype!r} is not supported; use torch.float32 (default), torch.bfloat16 or 'int8' "
        f"(block-wise 8-bit moments)"
    )


def check_min_8bit_size(min_8bit_size: Any) -> int:
    """``min_8bit_size`` as an int >= 0; raises ValueError naming the value and the fix otherwise."""
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(
            f"min_8bit_size={min_8bit_size!r}: give an int >= 0, the fewest elements a tensor needs for int8 moments "
            f"(default {MIN_8BIT_SIZE}, bitsandbytes'; 0 quantises every tensor)"
        )
    return min_8bit_size


def moment_bytes(numel: int, state_dtype: torch.dtype | str) -> int:
    """Bytes of both moments of ``numel`` elements kept as one tensor in ``state_dtype``: fp32 8 per element, bf16
    4, int8 2 per element plus 2 fp32 absmax per started block of 2048 (``8 * ceil(numel / 2048)``)."""
    if state_dtype == "int8":
        return 2 * numel + 8 * ((numel + QUANT_BLOCK - 1) // QUANT_BLOCK)
    return 2 * numel * state_dtype.itemsize


def format_of(st: dict[str, Any]) -> torch.dtype | str:
    """The format a state dict's moments are in, by their dtype (uint8 codes: ``"int8"``)."""
    m = st["exp_avg"]
    return "int8" if m.dtype == torch.uint8 else m.dtype


def new_moments(
    shape: torch.Size, state_dtype: torch.dtype | str, zeros: Callable[..., torch.Tensor] = torch.zeros
) -> dict[str, torch.Tensor]:
    """Zero moments of a parameter of ``shape`` in ``state_dtype`` (int8: zero codes with zero absmax, i.e. 0.0).
    ``zeros(shape, dtype=...)`` allocates each tensor (default ``torch.zeros``; the offload passes counted host
    buffers)."""
    if state_dtype == "int8":
        blocks = (math.prod(shape) + QUANT_BLOCK - 1) // QUANT_BLOCK
        return {
            "exp_avg": zeros(shape, dtype=torch.uint8),
            "exp_avg_sq": zeros(shape, dtype=torch.uint8),
            "exp_avg_absmax": zeros((blocks,), dtype=torch.float32),
            "exp_avg_sq_absmax": zeros((blocks,), dtype=torch.float32),
        }
    return {k: zeros(shape, dtype=state_dtype) for k in _MOMENTS}


def moments_fp32(st: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exp_avg, exp_avg_sq)`` of one parameter's state as new fp32 tensors, whatever its format: exact for every
    format (bf16 upcast; int8 ``map[code] * absmax``, as the kernel reads them). For consolidating or exporting
    state to tools that know only torch's fp32 Adam."""
    m, v = st["exp_avg"], st["exp_avg_sq"]
    if m.dtype == torch.uint8:
        return (
            dequantize_state(m, st["exp_avg_absmax"], signed=True),
            dequantize_state(v, st["exp_avg_sq_absmax"], signed=False),
        )
    return m.to(torch.float32, copy=True), v.to(torch.float32, copy=True)


def convert_moments(st: dict[str, Any], state_dtype: torch.dtype | str, shape: torch.Size) -> dict[str, torch.Tensor]:
    """One parameter's moments (any format) as new contiguous tensors in ``state_dtype``, shaped like the
    parameter. Same format: copied as they are (no requantisation). Otherwise through exact fp32 values
    (:func:`moments_fp32`), then bf16 round to nearest even, or the kernel's int8 quantisation."""
    if format_of(st) == state_dtype:
        out = {k: st[k].detach().reshape(shape).clone(memory_format=torch.contiguous_format) for k in _MOMENTS}
        if state_dtype == "int8":
            out.update({k: st[k].detach().reshape(-1).clone() for k in ABSMAX_KEYS})
        return out
    m, v = moments_fp32(st)
    if state_dtype == "int8":
        mq, ma = quantize_state(m, signed=True)
        vq, va = quantize_state(v, signed=False)
        return {"exp_avg": mq.reshape(shape), "exp_avg_sq": vq.reshape(shape), "exp_avg_absmax": ma,
                "exp_avg_sq_absmax": va}  # fmt: skip
    return {"exp_avg": m.to(state_dtype).reshape(shape).contiguous(),
            "exp_avg_sq": v.to(state_dtype).reshape(shape).contiguous()}  # fmt: skip

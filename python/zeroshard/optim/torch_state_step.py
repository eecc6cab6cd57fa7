"""The fused CPU Adam's step (:func:`zeroshard.ops.adam_step`) in torch ops, for tensors on any device.

The same state formats (:mod:`zeroshard.optim.state_format`: fp32, bf16 rounded to nearest even, block-wise int8 with
the same dynamic maps, absmax blocks of 2048 and quantisation rule) and the same bits as the C++ kernel, so a state
written by one is stepped by the other and checkpoints are interchangeable. Per element, in the kernel's order
(``csrc/adam/adam_kernel.h``, ``Factors``)::

    g = (float32(grad) * grad_unscale) * grad_clip
    g = fma(p, weight_decay, g)                          Adam (L2)
    p = p * (1 - lr * weight_decay)                      AdamW (decoupled)
    m = fma(lerp_coeff, g - m, m if |1 - beta1| < 0.5 else g)
    v = fma((1 - beta2) * g, g, v * beta2)
    p = p + (-step_size * m) / fma(sqrt(v), 1 / sqrt(1 - beta2**t), eps)

torch has no fused multiply-add, so each ``fma`` here is computed exactly: the fp32 product in float64 (exact), the sum
in float64 rounded to odd (Boldo & Melquiond 2008, "Emulation of FMA and correctly rounded sums: proved algorithms
using rounding to odd": an exact TwoSum error picks the odd neighbour), then rounded to fp32, which gives the correctly
rounded fp32 fma. ``sqrt`` is taken in float64 and rounded (correctly rounded in fp32, as the kernel's). Every other
operation is one fp32 operation, as in the kernel.

Work is done in chunks of :data:`CHUNK` elements (a multiple of the 2048-element quantisation block), so temporaries
stay bounded on large shards; each block is independent, so chunking does not change the bits.
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import torch

from zeroshard.ops import QUANT_BLOCK
from zeroshard.optim.state_format import format_of

__all__ = [
    "CHUNK",
    "Factors",
    "adam_step_torch",
    "check_step_tensors",
    "dequantize_blocks",
    "make_factors",
    "quantize_blocks",
]

CHUNK = 1 << 21  # elements per chunk: 1024 quantisation blocks
assert CHUNK % QUANT_BLOCK == 0


def _f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value, as C's ``static_cast<float>(double)``."""
    return struct.unpack("f", struct.pack("f", x))[0]


class Factors(NamedTuple):
    """Per-step scalars, each an fp32 value held as a Python float (``csrc/adam/adam_kernel.h``, ``Factors``)."""

    l2_decay: bool
    decoupled_decay: bool
    weight_decay: float
    decay_mul: float
    lerp_small: bool
    lerp_coeff: float
    beta2: float
    one_minus_beta2: float
    inv_bc2_sqrt: float
    eps: float
    neg_step_size: float
    grad_unscale: float
    grad_clip: float


def make_factors(
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    grad_unscale: float = 1.0,
    grad_clip: float = 1.0,
) -> Factors:
    """The kernel's factors (``make_factors`` in ``csrc/adam/adam.cpp``): computed in double as torch computes its
    Python-float scalars, rounded once to fp32.

    Raises:
        ValueError: a hyperparameter out of range (as ``zeroshard.ops.adam_step``), naming it.
    """
    checks = (
        (step >= 1, f"step={step} (counts from 1)"),
        (lr >= 0.0, f"lr={lr} (need >= 0)"),
        (0.0 <= beta1 < 1.0, f"beta1={beta1} (need 0 <= beta1 < 1)"),
        (0.0 <= beta2 < 1.0, f"beta2={beta2} (need 0 <= beta2 < 1)"),
        (eps >= 0.0, f"eps={eps} (need >= 0)"),
        (weight_decay >= 0.0, f"weight_decay={weight_decay} (need >= 0)"),
        (math.isfinite(grad_unscale) and grad_unscale >= 0.0, f"grad_unscale={grad_unscale} (need finite, >= 0)"),
        (math.isfinite(grad_clip) and grad_clip >= 0.0, f"grad_clip={grad_clip} (need finite, >= 0)"),
    )
    for ok, what in checks:
        if not ok:
            raise ValueError(f"adam_step_torch: invalid {what}")
    w = _f32(1.0 - beta1)
    lerp_small = abs(w) < 0.5
    step_size, bc2_sqrt = lr, 1.0
    if bias_correction:
        step_size = lr / (1.0 - beta1**step)
        bc2_sqrt = (1.0 - beta2**step) ** 0.5
    return Factors(
        l2_decay=weight_decay != 0.0 and not adamw_mode,
        decoupled_decay=weight_decay != 0.0 and adamw_mode,
        weight_decay=_f32(weight_decay),
        decay_mul=_f32(1.0 - lr * weight_decay),
        lerp_small=lerp_small,
        lerp_coeff=w if lerp_small else w - 1.0,  # exact: w >= 0.5
        beta2=_f32(beta2),
        one_minus_beta2=_f32(1.0 - beta2),
        inv_bc2_sqrt=_f32(1.0 / bc2_sqrt),
        eps=_f32(eps),
        neg_step_size=_f32(-step_size),
        grad_unscale=_f32(grad_unscale),
        grad_clip=_f32(grad_clip),
    )


def fma32(a: torch.Tensor | float, b: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """``a * b + c`` with one rounding to fp32 (a correctly rounded fp32 fma), for fp32 tensors / fp32-exact floats.

    The product of two fp32 values is exact in float64; the float64 sum is rounded to odd (TwoSum gives its exact
    error ``e``; an inexact result with an even last bit moves one ulp towards the exact sum), and an odd-rounded
    float64 rounds to the same fp32 value as the exact sum (53 >= 24 + 2 bits). Non-finite inputs give what the
    hardware fma gives (the error is then NaN and no correction is made)."""
    p = (a.double() if isinstance(a, torch.Tensor) else a) * b.double()
    cd = c.double() if isinstance(c, torch.Tensor) else c
    s = p + cd
    bb = s - p
    e = (p - (s - bb)) + (cd - bb)
    bits = s.view(torch.int64)
    fix = (e != 0) & e.isfinite() & ((bits & 1) == 0)
    step = torch.where((e > 0) == (s > 0), 1, -1)  # away from zero if the exact sum is larger in magnitude
    return torch.where(fix, bits + step, bits).view(torch.float64).float()


def _sqrt32(v: torch.Tensor) -> torch.Tensor:
    return v.double().sqrt().float()  # correctly rounded in float64, so in fp32 after one more rounding


_SCALARS = ("weight_decay", "decay_mul", "lerp_coeff", "beta2", "one_minus_beta2", "inv_bc2_sqrt", "eps",
            "neg_step_size", "grad_unscale", "grad_clip")  # fmt: skip


def _scalars(f: Factors, device: torch.device) -> torch.Tensor:
    """The fp32 factors as one fp32 tensor on ``device`` (so a compiled step is not specialised on their values)."""
    return torch.tensor([getattr(f, k) for k in _SCALARS], dtype=torch.float32).to(device, non_blocking=True)


def update_fp32(
    flags: tuple[bool, bool, bool], s: torch.Tensor, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Adam/AdamW element update in the kernel's order and roundings (module docstring); all fp32, same shape.
    ``flags``: ``(l2_decay, decoupled_decay, lerp_small)``; ``s``: the factors in :data:`_SCALARS` order (fp32).
    Returns new ``(p, m, v)``; the inputs are not modified."""
    l2_decay, decoupled_decay, lerp_small = flags
    wd, decay_mul, lerp_coeff, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size, unscale, clip = s.unbind()
    g = g * unscale * clip
    if l2_decay:
        g = fma32(wd, p, g)
    if decoupled_decay:
        p = p * decay_mul
    diff = g - m
    m = fma32(lerp_coeff, diff, m if lerp_small else g)
    v = fma32(g * one_minus_beta2, g, v * beta2)
    denom = fma32(inv_bc2_sqrt, _sqrt32(v), eps)
    p = p + (m * neg_step_size) / denom
    return p, m, v


def _step_chunk(
    flags: tuple[bool, bool, bool],
    s: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    ma: torch.Tensor | None,
    va: torch.Tensor | None,
    maps: tuple[torch.Tensor, ...] | None,
) -> tuple[torch.Tensor, ...]:
    """One chunk's step as a pure function (what ``compile=True`` compiles): fp32 ``p``/``g``, the stored moments
    ``m``/``v`` (fp32, bf16 or uint8 codes with absmax ``ma``/``va`` and ``maps`` = signed values, signed
    thresholds, unsigned values, unsigned thresholds). Returns ``(p, m, v[, ma, va])`` in the stored dtypes."""
    if maps is None:
        p, m32, v32 = update_fp32(flags, s, p, g, m.float(), v.float())
        return p, m32.to(m.dtype), v32.to(v.dtype)
    sv, st, uv, ut = maps
    p, m32, v32 = update_fp32(flags, s, p, g, _dequantize(m, ma, sv), _dequantize(v, va, uv))
    mq, ma = _quantize(m32, st)
    vq, va = _quantize(v32, ut)
    return p, mq, vq, ma, va


_MAPS: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}


def _maps(device: torch.device, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's dynamic map (256 fp32 values) and its exact nearest-code thresholds 1..255 on ``device``."""
    key = (device, signed)
    if key not in _MAPS:
        from zeroshard import _C

        values = _C.adam_dynamic_map(signed).to(device)
        thresholds = _C.adam_dynamic_map_thresholds(signed)[1:].contiguous().to(device)
        _MAPS[key] = (values, thresholds)
    return _MAPS[key]


def _padded_blocks(x: torch.Tensor) -> torch.Tensor:
    """1-D ``x`` zero-padded to whole blocks, as ``(blocks, 2048)``."""
    pad = -x.numel() % QUANT_BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, QUANT_BLOCK)


def _dequantize(codes: torch.Tensor, absmax: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    x = _padded_blocks(values[codes.long()]) * absmax[:, None]
    return x.view(-1)[: codes.numel()]


def _quantize(x: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _padded_blocks(x)
    absmax = blocks.abs().amax(dim=1)
    absmax = torch.where(absmax.isfinite(), absmax, torch.full_like(absmax, float("nan")))
    divisor = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    normed = blocks / divisor[:, None]
    codes = torch.searchsorted(thresholds, normed, right=True)
    codes = torch.where(normed.isnan(), torch.zeros_like(codes), codes)
    return codes.view(-1)[: x.numel()].to(torch.uint8), absmax


def dequantize_blocks(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of 1-D uint8 ``codes``: ``map[code] * absmax`` of the code's block (one fp32 multiply)."""
    return _dequantize(codes, absmax, _maps(codes.device, signed)[0])


def quantize_blocks(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D fp32 ``x`` as ``(uint8 codes, fp32 absmax per block)`` by the kernel's rule: absmax = ``max |x|`` of the
    block (NaN if it holds a NaN or inf; its codes are then 0); code = how many thresholds ``x / absmax`` reaches
    (nearest map value, ties to the larger; ``exp_avg_sq``'s first threshold is -inf, so never code 0)."""
    return _quantize(x, _maps(x.device, signed)[1])


_COMPILED: dict[str, Any] = {}


def _compiled_step() -> Any:
    """``_step_chunk`` through ``torch.compile`` (one fused kernel per chunk on CUDA), built on first use."""
    if "step" not in _COMPILED:
        _COMPILED["step"] = torch.compile(_step_chunk, dynamic=True)
    return _COMPILED["step"]


def adam_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    grad_unscale: float = 1.0,
    grad_clip: float = 1.0,
    compile: bool = False,
) -> None:
    """One Adam/AdamW step of ``param`` in place, with the bits of :func:`zeroshard.ops.adam_step` on any device.

    Args:
        param: fp32 master weights (or bf16 weights with no master: upcast, rounded to nearest even once), any
            shape, contiguous; updated in place.
        grad: fp32 / bf16 / fp16, ``param``'s number of elements, same device. Read only.
        state: the parameter's moments, updated in place, in the format their dtype says
            (:func:`~zeroshard.optim.state_format.format_of`): ``exp_avg`` / ``exp_avg_sq`` fp32 or bf16, or uint8
            codes with ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32, ``ceil(numel / 2048)`` each). All on
            ``param``'s device. So an int8 optimizer may keep some parameters' moments in fp32.
        step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_unscale, grad_clip: as for
            :func:`zeroshard.ops.adam_step` (``step`` counts this step).
        compile: run each chunk through ``torch.compile`` (the same ops, fused; the same bits): see
            ``benchmarks/bench_device_adam.py`` for where it measures faster.

    NaN / inf: as the kernel. fp32 / bf16 moments poison only the element (torch's AdamW); an int8 block whose new
    moment holds a NaN or inf gets absmax NaN, so from the next step on all its elements are NaN.

    Raises:
        ValueError: a hyperparameter out of range, or a tensor of the wrong size, device or dtype (naming it).
    """
    f = make_factors(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     adamw_mode=adamw_mode, bias_correction=bias_correction, grad_unscale=grad_unscale,
                     grad_clip=grad_clip)  # fmt: skip
    fmt = format_of(state)
    n = param.numel()
    check_step_tensors(param, grad, state)
    p_flat, g_flat = param.view(-1), grad.view(-1)
    m_flat, v_flat = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    flags = (f.l2_decay, f.decoupled_decay, f.lerp_small)
    s = _scalars(f, param.device)
    maps = (*_maps(param.device, True), *_maps(param.device, False)) if fmt == "int8" else None
    step_chunk = _compiled_step() if compile else _step_chunk
    for c0 in range(0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        ma = va = None
        if fmt == "int8":
            b0, b1 = c0 // QUANT_BLOCK, -(-c1 // QUANT_BLOCK)
            ma, va = state["exp_avg_absmax"][b0:b1], state["exp_avg_sq_absmax"][b0:b1]
        out = step_chunk(flags, s, p_flat[c0:c1].float(), g_flat[c0:c1].float(), m_flat[c0:c1], v_flat[c0:c1],
                         ma, va, maps)  # fmt: skip
        p_flat[c0:c1].copy_(out[0])  # bf16 weights: round to nearest even, as the kernel's store
        m_flat[c0:c1].copy_(out[1])
        v_flat[c0:c1].copy_(out[2])
        if fmt == "int8":
            ma.copy_(out[3])
            va.copy_(out[4])


def check_step_tensors(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> None:
    """The checks of :func:`adam_step_torch` on its tensors, alone (ValueError naming the tensor)."""
    fmt = format_of(state)
    n = param.numel()
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"adam_step_torch: param has dtype {param.dtype}; use float32 master weights (or bfloat16)")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"adam_step_torch: grad has dtype {grad.dtype}; use float32, bfloat16 or float16")
    tensors = [("grad", grad), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])]
    if fmt == "int8":
        blocks = -(-n // QUANT_BLOCK)
        for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            t = state.get(key)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != blocks:
                raise ValueError(
                    f"adam_step_torch: int8 state needs {key} as float32 of ceil({n} / {QUANT_BLOCK}) = {blocks} "
                    f"elements; got {None if t is None else (t.dtype, t.numel())}"
                )
            tensors.append((key, t))
    elif fmt not in (torch.float32, torch.bfloat16):
        raise ValueError(f"adam_step_torch: exp_avg has dtype {fmt}; moments are float32, bfloat16 or uint8 (int8)")
    if state["exp_avg_sq"].dtype != state["exp_avg"].dtype:
        raise ValueError("adam_step_torch: exp_avg and exp_avg_sq have different dtypes; keep both in one format")
    for name, t in tensors:
        if t.device != param.device:
            raise ValueError(f"adam_step_torch: {name} is on {t.device}, param on {param.device}; keep them together")
        if name in ("grad", "exp_avg", "exp_avg_sq") and t.numel() != n:
            raise ValueError(f"adam_step_torch: {name} has {t.numel()} elements, param {n}")
        if not t.is_contiguous():
            raise ValueError(f"adam_step_torch: {name} is not contiguous; pass .contiguous() tensors")
    if not param.is_contiguous():
        raise ValueError("adam_step_torch: param is not contiguous")

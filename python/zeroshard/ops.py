"""Functional entry points of the compiled core."""

from __future__ import annotations

import torch

from zeroshard import _C

__all__ = [
    "QUANT_BLOCK",
    "adam_step",
    "adam_traffic_reference",
    "dequantize_state",
    "dynamic_map",
    "quantize_state",
]

QUANT_BLOCK: int = _C.ADAM_QUANT_BLOCK
"""Elements per block of int8 Adam state (2048): one fp32 absmax per block and moment."""


def adam_step(
    param_fp32: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    param_out: torch.Tensor | None = None,
    grad_stats: bool = False,
    isa: str | None = None,
    grad_unscale: float = 1.0,
    grad_clip: float = 1.0,
    exp_avg_absmax: torch.Tensor | None = None,
    exp_avg_sq_absmax: torch.Tensor | None = None,
) -> tuple[float, bool] | None:
    """One fused Adam/AdamW step on CPU tensors, in place, in a single pass over memory.

    Per element, in torch's order (``torch.optim.AdamW`` / ``torch.optim.Adam``, single-tensor CPU path)::

        g = float32(grad)                             # bf16 / fp16 upcast while loading
        g = (g * grad_unscale) * grad_clip            # only if either is not 1: two fp32 roundings, like two mul_
        g = g + weight_decay * p                      # Adam mode (adamw_mode=False), L2 penalty
        p = p * (1 - lr * weight_decay)               # AdamW mode, decoupled decay
        m = lerp(m, g, 1 - beta1)
        v = beta2 * v + (1 - beta2) * g * g
        p = p - step_size * m / (sqrt(v) * (1 / sqrt(1 - beta2**step)) + eps),  step_size = lr / (1 - beta1**step)
        param_out = p.to(param_out.dtype)             # same pass

    With ``bias_correction=False``, ``step_size = lr`` and the ``sqrt(1 - beta2**step)`` factor is 1. The scalar
    factors are computed in double on the host and rounded to float as torch rounds them. Results match
    ``torch.optim.AdamW`` / ``Adam`` to about 1e-7 relative per step, not bit for bit: the denominator multiplies
    by the reciprocal of ``sqrt(1 - beta2**step)`` in one fma where torch divides (one division less per element,
    the step's most expensive operation), and torch's CPU ``sqrt`` (MKL VML) may be 1 ulp off.

    Args:
        param_fp32: fp32 master weights, any shape, updated in place. May also be bfloat16 weights kept with no
            fp32 master (then without ``param_out``): upcast while loading, the new value rounded to nearest even
            once per step; the moments stay fp32. This is DeepSpeedCPUAdam's bf16 mode
            (``fp32_optimizer_states=True``), 22 bytes of traffic per parameter against the master path's 30.
        grad: gradient, float32, bfloat16 or float16, same number of elements. Read only.
        exp_avg: first moment (m), same number of elements, updated in place. Its dtype, the same as
            ``exp_avg_sq``'s, selects the state format:

            - ``float32``: fp32 moments (8 bytes per parameter);
            - ``bfloat16``: loaded as fp32, updated in fp32 as above, rounded to nearest even on store (4 bytes);
            - ``uint8``: block-wise dynamic 8-bit state (2 bytes + 8 per 2048): each element is the index of a value
              of :func:`dynamic_map` (signed for ``exp_avg``, unsigned for ``exp_avg_sq``) scaled by its block's
              absmax, given in ``exp_avg_absmax`` / ``exp_avg_sq_absmax``. Per block of :data:`QUANT_BLOCK`
              elements (the last one may be shorter) the kernel dequantises both moments (``map[code] * absmax``),
              updates them in fp32 exactly as the fp32 format does, then requantises: the new absmax is
              ``max |x|`` over the block, each code the nearest map value to ``x / absmax`` (exact decision; a
              tie takes the larger code; an all-zero block keeps absmax 0). A block whose updated moment holds a
              NaN or inf gets absmax NaN, so from the next step on all its elements are NaN (torch's AdamW would
              poison only that element; 8-bit codes cannot say "inf"). Bits do not depend on the ISA or threads.
        exp_avg_sq: second moment (v), same number of elements and dtype as ``exp_avg``, updated in place.
        step: step count including this step (torch's ``state["step"]`` after its increment), ``>= 1``.
        lr: learning rate, ``>= 0``.
        beta1, beta2: moment decay rates, each in ``[0, 1)``.
        eps: added to the denominator, ``>= 0``.
        weight_decay: ``>= 0``; L2 (Adam) or decoupled (AdamW) by ``adamw_mode``.
        adamw_mode: True for AdamW (decoupled decay), False for Adam with L2 penalty.
        bias_correction: apply Adam's bias correction (True in torch).
        param_out: optional bfloat16, float16 or float32 tensor with the same number of elements; receives the
            updated weights (round to nearest even; bf16 NaN stays NaN, fp16 overflow becomes inf).
        grad_stats: also return the gradient statistics computed in the same pass.
        isa: ``"scalar"``, ``"avx2"`` or ``"avx512"`` to force a kernel build; default ``ZEROSHARD_CPU_ISA`` or
            the best one this CPU supports (see ``zeroshard.cpu_isa()``).
        grad_unscale: finite, ``>= 0``: the gradient is multiplied by it first (``1 / loss_scale`` of fp16 training).
        grad_clip: finite, ``>= 0``: then by this (the clip-by-norm coefficient). Folding both into the step saves
            the two passes over the gradient that ``g.mul_(...)`` would take; the bits are the same for fp32
            gradients. The statistics (``grad_stats``) are of the gradient as stored, before these factors.
        exp_avg_absmax, exp_avg_sq_absmax: int8 state only (uint8 moments), both required then: float32 CPU
            tensors of ``ceil(numel / 2048)`` elements, the per-block scales (units of the moment: the largest
            ``|m|``, resp. ``|v|``, of the block), updated in place. Fresh state: zeros (codes and absmax).

    All tensors must be on the CPU, dense (strided) and contiguous, with no two of them sharing memory. No copy is
    made. Threads: ``torch.get_num_threads()``, over fixed 64Ki-element chunks, so results do not depend on the
    thread count.

    CUDA: where this build has its CUDA parts (``zeroshard._C.adam_cuda_available()``), all tensors may instead be
    on one CUDA device: the step is then a CUDA kernel (``csrc/adam/adam_kernel_cuda.cu``) with the same bits as
    the CPU kernel, launched on the device's current stream (asynchronous), without ``isa``, ``grad_stats`` or
    ``param_out`` (ValueError).

    Returns:
        ``None``, or with ``grad_stats=True`` a tuple ``(grad_sq_sum, found_inf)``: the sum of squares of the
        upcast gradient (Python float, accumulated in double) and whether any gradient element is inf or NaN.

    Raises:
        RuntimeError: a tensor is not on the CPU (or not on param's CUDA device), not dense, not contiguous, or two
            tensors share memory; CUDA tensors in a build without CUDA parts.
        TypeError: param not float32 or bfloat16, exp_avg/exp_avg_sq of different or unsupported dtypes (float32,
            bfloat16, uint8), an absmax not float32, grad or param_out of an unsupported dtype.
        ValueError: numel mismatch (an absmax must have ``ceil(numel / 2048)`` elements), absmax missing for uint8
            moments or given for float moments, ``param_out`` given with a bfloat16 param, a hyperparameter out of
            range, or an unknown / unsupported ``isa``.
        Every check runs before any memory is written: on error nothing is modified.

    Sources: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, Algorithm 1; Loshchilov & Hutter,
    "Decoupled Weight Decay Regularization", ICLR 2019 (AdamW); int8 state: Dettmers et al., "8-bit Optimizers via
    Block-wise Quantization", ICLR 2022, with bitsandbytes' ``create_dynamic_map(signed=True/False)``
    (bitsandbytes/functional.py).
    """
    return _C.adam_step(
        param_fp32,
        grad,
        exp_avg,
        exp_avg_sq,
        int(step),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adamw_mode),
        bool(bias_correction),
        param_out=param_out,
        compute_grad_stats=bool(grad_stats),
        isa=isa,
        grad_unscale=float(grad_unscale),
        grad_clip=float(grad_clip),
        exp_avg_absmax=exp_avg_absmax,
        exp_avg_sq_absmax=exp_avg_sq_absmax,
    )


def adam_traffic_reference(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, isa: str | None = None
) -> None:
    """The memory traffic of :func:`adam_step` with no arithmetic: the bandwidth ceiling of an in-place update.

    Reads ``param``, ``grad``, ``exp_avg``, ``exp_avg_sq`` and writes the first, third and fourth back unchanged, 28
    bytes per element, with the same chunks, threads, loop and prefetch as the step. ``bench_cpu_adam.py`` reports
    the step's time as a fraction of this one measured in the same run.

    Args:
        param, grad, exp_avg, exp_avg_sq: float32 CPU tensors, dense, contiguous, same number of elements, no two
            sharing memory. Their values do not change.
        isa: as for :func:`adam_step`.

    Raises:
        RuntimeError / TypeError / ValueError: as :func:`adam_step` for a bad tensor; TypeError if one is not float32.
    """
    _C.adam_traffic_reference(param, grad, exp_avg, exp_avg_sq, isa)


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 ascending float32 values of the dynamic 8-bit map of int8 Adam state: ``signed=True`` for
    ``exp_avg`` (in ``[-0.99297, 1]``, 0.0 at index 127), ``signed=False`` for ``exp_avg_sq`` (in ``[0, 1]``, 0.0
    at index 0). Built as bitsandbytes' ``create_dynamic_map(signed)`` builds it (bitsandbytes/functional.py;
    Dettmers 2016, 8-bit approximations): a new tensor each call."""
    return _C.adam_dynamic_map(bool(signed))


def _blocks(n: int) -> int:
    return (n + QUANT_BLOCK - 1) // QUANT_BLOCK


def dequantize_state(codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """fp32 values of an int8 moment, exactly as the kernel reads them: ``dynamic_map(signed)[code] * absmax`` of
    the code's block (one fp32 multiply).

    Args:
        codes: uint8 tensor, any shape, the moment's codes (``state["exp_avg"]`` or ``state["exp_avg_sq"]``).
        absmax: float32 tensor of ``ceil(codes.numel() / 2048)`` elements.
        signed: True for ``exp_avg``, False for ``exp_avg_sq``.

    Returns:
        A new float32 tensor shaped like ``codes``.

    Raises:
        TypeError / ValueError: a wrong dtype or number of elements, naming the argument.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"dequantize_state: codes has dtype {codes.dtype}; int8 state codes are torch.uint8")
    if absmax.dtype != torch.float32:
        raise TypeError(f"dequantize_state: absmax has dtype {absmax.dtype}; absmax scales are torch.float32")
    n = codes.numel()
    if absmax.numel() != _blocks(n):
        raise ValueError(
            f"dequantize_state: absmax has {absmax.numel()} elements; {n} codes need ceil({n} / {QUANT_BLOCK}) = "
            f"{_blocks(n)}"
        )
    values = dynamic_map(signed)[codes.reshape(-1).long()]
    scale = absmax.reshape(-1).repeat_interleave(QUANT_BLOCK)[:n]
    return (values * scale).reshape(codes.shape)


def quantize_state(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 moment as int8 state, by the kernel's rule (``adam_step``): per block of 2048 elements absmax =
    ``max |x|`` (NaN if the block holds a NaN or inf; then all its codes are 0), each code the nearest map value to
    ``x / absmax`` in fp32 (``x`` itself when absmax is 0), ties to the larger code; with ``signed=False`` at least
    code 1, so a positive second moment never reads back as 0 (its step would be ``lr * m / eps``).

    Args:
        x: float tensor, any shape (bf16 / fp16 are upcast exactly).
        signed: True for ``exp_avg``, False for ``exp_avg_sq``.

    Returns:
        ``(codes, absmax)``: uint8 shaped like ``x``; float32 of ``ceil(x.numel() / 2048)`` elements.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize_state: x has dtype {x.dtype}; pass a floating-point moment")
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    pad = _blocks(n) * QUANT_BLOCK - n
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, QUANT_BLOCK)
    absmax = blocks.abs().amax(dim=1)
    absmax = torch.where(blocks.isfinite().all(dim=1), absmax, torch.full_like(absmax, float("nan")))
    divisor = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    normed = blocks / divisor[:, None]
    thresholds = _C.adam_dynamic_map_thresholds(bool(signed))[1:].contiguous()
    codes = torch.searchsorted(thresholds, normed.contiguous(), right=True)
    codes = torch.where(normed.isnan(), torch.zeros_like(codes), codes)
    return codes.reshape(-1)[:n].to(torch.uint8).reshape(x.shape), absmax

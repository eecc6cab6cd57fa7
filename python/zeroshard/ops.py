"""Functional entry points of the compiled core."""

from __future__ import annotations

import torch

from zeroshard import _C

__all__ = ["adam_step", "adam_traffic_reference"]


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
        exp_avg: fp32 first moment (m), same number of elements, updated in place.
        exp_avg_sq: fp32 second moment (v), same number of elements, updated in place.
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

    All tensors must be on the CPU, dense (strided) and contiguous, with no two of them sharing memory. No copy is
    made. Threads: ``torch.get_num_threads()``, over fixed 64Ki-element chunks, so results do not depend on the
    thread count.

    Returns:
        ``None``, or with ``grad_stats=True`` a tuple ``(grad_sq_sum, found_inf)``: the sum of squares of the
        upcast gradient (Python float, accumulated in double) and whether any gradient element is inf or NaN.

    Raises:
        RuntimeError: a tensor is not on the CPU, not dense, not contiguous, or two tensors share memory.
        TypeError: param not float32 or bfloat16, exp_avg/exp_avg_sq not float32, grad or param_out of an
            unsupported dtype.
        ValueError: numel mismatch, ``param_out`` given with a bfloat16 param, a hyperparameter out of range, or
            an unknown / unsupported ``isa``.
        Every check runs before any memory is written: on error nothing is modified.

    Sources: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, Algorithm 1; Loshchilov & Hutter,
    "Decoupled Weight Decay Regularization", ICLR 2019 (AdamW).
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

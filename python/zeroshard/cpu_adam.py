"""``CPUAdam``: a ``torch.optim.Optimizer`` that steps CPU parameters with the fused zeroshard kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from zeroshard import _C

__all__ = ["CPUAdam"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for fp32 CPU parameters, one fused pass per parameter (``zeroshard.ops.adam_step``).

    A drop-in for ``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam`` (``adamw_mode=False``) with
    ``amsgrad=False, maximize=False``. Per element and step ``t``::

        g = grad (+ weight_decay * p if not adamw_mode)
        p = p * (1 - lr * weight_decay)                     if adamw_mode
        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    (bias correction terms dropped when ``bias_correction=False``). Results match torch to ~1e-7 relative per step
    (see ``zeroshard.ops.adam_step`` for the exact operation order and the one known source of 1-ulp differences).

    Args:
        params: iterable of parameters or of param-group dicts, as for any torch optimizer. Parameters must be fp32,
            on the CPU, dense and contiguous.
        lr: learning rate, ``>= 0`` (float; a 0-dim tensor is read as a float each step).
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: ``>= 0``, added to the denominator.
        weight_decay: ``>= 0``; decoupled (AdamW) or L2 (Adam) by ``adamw_mode``.
        adamw_mode: keyword only; True = AdamW (Loshchilov & Hutter 2019), False = Adam with L2 penalty.
        bias_correction: keyword only; Adam's bias correction (Kingma & Ba 2015, Alg. 1). torch always applies it.

    Gradients: ``p.grad`` (fp32: torch requires ``.grad`` to share the parameter's dtype), or bf16 / fp16 / fp32
    gradients passed to :meth:`step` as ``grads={param: grad}``: the kernel upcasts them while loading, with no
    separate conversion pass (``zeroshard.ops.adam_step``).

    State: per parameter ``step`` (0-dim float32 tensor), ``exp_avg`` and ``exp_avg_sq`` (fp32, like the
    parameter): the same keys and layout as ``torch.optim.Adam``/``AdamW``, so ``state_dict()`` loads into either
    and theirs load into this (a torch group's ``decoupled_weight_decay`` sets ``adamw_mode``).

    Raises:
        ValueError: in ``__init__`` for an out-of-range hyperparameter (naming the value). In ``step`` for a bad
            group hyperparameter, ``amsgrad``/``maximize`` set by a loaded torch state, or a parameter / gradient /
            state tensor that is not on the CPU, sparse, non-contiguous, of a wrong dtype or size (naming the
            parameter's group and index and the fix). All checks run before any parameter or state is modified.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            # Groups loaded from torch.optim.Adam/AdamW carry decoupled_weight_decay instead of adamw_mode.
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group.setdefault("bias_correction", True)

    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, grads: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> float | None:  # type: ignore[override]
        """Perform one optimization step over every parameter that has a gradient.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss (run with grad enabled).
            grads: optional ``{param: gradient}``: CPU, contiguous, the parameter's number of elements, float32,
                bfloat16 or float16. Used instead of ``param.grad`` for those parameters.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: see the class docstring; nothing is modified when it is raised.
        """
        loss = run_closure(closure)

        # Validate everything before the first write, so a bad parameter leaves the whole optimizer untouched.
        work = []
        for gi, group in enumerate(self.param_groups):
            _check_group(gi, group)
            for pi, p in enumerate(group["params"]):
                g = grads.get(p) if grads is not None else None
                g = p.grad if g is None else g
                if g is None:
                    continue
                _check_param(gi, pi, p, g, self.state.get(p))
                work.append((group, p, g))

        for group, p, g in work:
            state = self.state[p]
            if len(state) == 0:
                state.update(self._new_state(p))
            state["step"] += 1
            _C.adam_step(p.detach(), g.detach(), state["exp_avg"], state["exp_avg_sq"], *step_hyper(state, group))
        return loss

    def _new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh state of ``p`` in torch's keys and layout: ``step`` 0-dim, fp32 zero moments shaped like ``p``."""
        return {
            "step": torch.tensor(0.0, dtype=_step_dtype()),
            "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.contiguous_format),
        }


def run_closure(closure: Callable[[], float] | None) -> float | None:
    """The loss of ``closure`` evaluated with grad enabled (an optimizer step runs under ``no_grad``), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def step_hyper(state: dict[str, Any], group: dict[str, Any]) -> tuple:
    """``(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction)`` as ``_C.adam_step`` and the
    offload pipeline take them, from a parameter's state (``step`` already incremented) and its group."""
    beta1, beta2 = group["betas"]
    return (
        int(state["step"].item()),
        float(group["lr"]),
        float(beta1),
        float(beta2),
        float(group["eps"]),
        float(group["weight_decay"]),
        bool(group["adamw_mode"]),
        bool(group["bias_correction"]),
    )


def _step_dtype() -> torch.dtype:
    # torch.optim keeps `step` in float32 (float64 only when that is the default dtype).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}lr as a Tensor must have one element, got {lr.numel()}")
    if not 0.0 <= float(lr):
        raise ValueError(f"{where}Invalid learning rate: {lr} (need lr >= 0)")
    if not 0.0 <= eps:
        raise ValueError(f"{where}Invalid epsilon value: {eps} (need eps >= 0)")
    if len(betas) != 2:
        raise ValueError(f"{where}betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"{where}Invalid beta parameter at index {i}: {b} (need 0 <= beta < 1)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{where}Invalid weight_decay value: {weight_decay} (need weight_decay >= 0)")


def _check_group(gi: int, group: dict[str, Any]) -> None:
    _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], where=f"CPUAdam param group {gi}: ")
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(key):
            raise ValueError(
                f"CPUAdam param group {gi}: {key}=True (from a loaded torch optimizer state) is not supported; "
                f"set group['{key}'] = False or use torch.optim.Adam/AdamW"
            )


def _check_tensor(what: str, t: torch.Tensor, fix_device: str) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}; CPUAdam steps CPU tensors only ({fix_device})")
    if t.layout != torch.strided:
        raise ValueError(f"{what} has layout {t.layout}; CPUAdam needs dense tensors (sparse: torch.optim.SparseAdam)")
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous (strides {t.stride()}); make it contiguous (no copy is made)")


def _check_param(gi: int, pi: int, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any] | None) -> None:
    name = f"CPUAdam param {pi} of group {gi} (shape {tuple(p.shape)})"
    _check_tensor(name, p, "move the model to the CPU, or use a GPU optimizer")
    if p.dtype != torch.float32:
        raise ValueError(f"{name} has dtype {p.dtype}; CPUAdam needs float32 (master) parameters: call .float()")
    _check_tensor(f"the gradient of {name}", g, "gradients must live with their CPU parameter")
    if g.dtype not in _GRAD_DTYPES:
        raise ValueError(f"the gradient of {name} has dtype {g.dtype}; supported: float32, bfloat16, float16")
    if g.numel() != p.numel():
        raise ValueError(f"the gradient of {name} has {g.numel()} elements, expected {p.numel()}")
    if not state:
        return
    for key in ("exp_avg", "exp_avg_sq"):
        s = state.get(key)
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"state['{key}'] of {name} is missing; load a complete Adam/AdamW state_dict")
        _check_tensor(f"state['{key}'] of {name}", s, "load the state_dict onto CPU parameters")
        if s.dtype != torch.float32 or s.numel() != p.numel():
            raise ValueError(
                f"state['{key}'] of {name} is {s.dtype} with {s.numel()} elements; expected float32 with {p.numel()}"
            )
    if not isinstance(state.get("step"), torch.Tensor):
        raise ValueError(f"state['step'] of {name} is missing or not a tensor; load a complete Adam/AdamW state_dict")

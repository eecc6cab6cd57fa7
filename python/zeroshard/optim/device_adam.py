"""``DeviceAdam``: Adam/AdamW in fp32, bf16 or int8 state on the parameters' own device.

The ZeRO engine steps fp32 master shards that live on the GPU (no ``offload_optimizer``) with it when the moments are
to be kept in bf16 or int8 (:mod:`zeroshard.optim.engine_state_format`). On CUDA the step is zeroshard's CUDA kernel
(``csrc/adam/adam_kernel_cuda.cu``, through :func:`zeroshard.ops.adam_step`); on any other device, or in a build
without CUDA parts, the same step in torch ops (:mod:`zeroshard.optim.torch_state_step`), so it is tested on CPU.
Both have the CPU kernel's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from zeroshard import _C, ops
from zeroshard.optim.cpu_adam import CPUAdam, _check_group, run_closure, step_count, step_hooks
from zeroshard.optim.kernel_check import kernel_agrees
from zeroshard.optim.state_format import ABSMAX_KEYS, MIN_8BIT_SIZE, new_moments
from zeroshard.optim.torch_state_step import adam_step_torch, check_step_tensors

__all__ = ["DeviceAdam"]


class DeviceAdam(CPUAdam):
    """Adam / AdamW over parameters on any device (CUDA master shards), with :class:`CPUAdam`'s state formats and bits.

    A :class:`CPUAdam` in everything but where the step runs: the same arguments (``adamw_mode``,
    ``bias_correction``, ``state_dtype``: ``torch.float32``, ``torch.bfloat16`` or ``"int8"``), the same state keys
    and dtypes (``step`` a plain number while training, ``exp_avg`` / ``exp_avg_sq`` in the format, int8 adds
    ``exp_avg_absmax`` / ``exp_avg_sq_absmax``), the same ``state_dict`` / ``load_state_dict`` conversions; so the
    engine's checkpoints, restore checks and consolidation treat both alike, and a state written by either steps in
    the other. The moments live on each parameter's device. Each parameter is stepped, in the format its state's
    dtypes say (an int8 optimizer may hold fp32 moments for some parameters), by zeroshard's CUDA kernel where the
    parameter is on a CUDA device and this build has it (:func:`zeroshard.ops.adam_step`; ``_C.adam_cuda_available()``),
    else by :func:`~zeroshard.optim.torch_state_step.adam_step_torch` (torch ops). Both give the CPU kernel's bits;
    the CUDA kernel is used on a device only once it gave the torch-ops step's bits there
    (:func:`~zeroshard.optim.kernel_check.kernel_agrees`: a warning and the torch-ops step otherwise).

    Args:
        params, lr, betas, eps, weight_decay, adamw_mode, bias_correction, state_dtype, min_8bit_size,
            fp32_state_params: as :class:`CPUAdam`.
            Parameters: fp32 (or bf16, no master), dense, contiguous, on any device.
        compile: keyword only; step the torch-ops path's chunks through ``torch.compile`` (the first step of each
            format compiles, about a minute for int8 on a 2-core CPU). Same bits on the CPU (tested); on an H100 the
            compiled int8 step differed from the eager one in some elements, so CUDA parameters keep the CUDA kernel
            whatever this says. Off by default: ``benchmarks/bench_device_adam.py`` measures it.

    Raises:
        ValueError: as :class:`CPUAdam` (construction; a bad group hyperparameter or tensor at ``step``, before any
            parameter or state is modified).
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
        state_dtype: torch.dtype | str = torch.float32,
        min_8bit_size: int = MIN_8BIT_SIZE,
        fp32_state_params: Iterable[torch.Tensor] | None = None,
        compile: bool = False,
    ) -> None:
        self.compile = bool(compile)
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
            state_dtype=state_dtype,
            min_8bit_size=min_8bit_size,
            fp32_state_params=fp32_state_params,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`CPUAdam.load_state_dict` (moments converted to ``state_dtype``), then each parameter's moments
        moved to its device."""
        super().load_state_dict(state_dict)
        for p, st in self.state.items():
            for k in ("exp_avg", "exp_avg_sq", *ABSMAX_KEYS):
                if isinstance(st.get(k), torch.Tensor) and st[k].device != p.device:
                    st[k] = st[k].to(p.device)

    @step_hooks
    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, grads: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> float | None:  # type: ignore[override]
        """One Adam step over every parameter that has a gradient (``grads={param: grad}`` overrides ``p.grad``).

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a bad group hyperparameter, or a parameter / gradient / state of the wrong dtype, size,
                device or layout (naming it); nothing is modified then.
        """
        loss = run_closure(closure)
        work = []
        for gi, group in enumerate(self.param_groups):
            _check_group(gi, group)
            beta1, beta2 = group["betas"]
            hyper = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]), adamw_mode=bool(group["adamw_mode"]),
                         bias_correction=bool(group["bias_correction"]))  # fmt: skip
            for i, p in enumerate(group["params"]):
                g = p.grad if grads is None else grads.get(p, p.grad)
                if g is None:
                    continue
                st = self.state.get(p) or self._new_state(p)
                _check_param(gi, i, p, g, st)
                try:
                    check_step_tensors(p, g, st)
                except ValueError as e:
                    raise ValueError(f"DeviceAdam param {i} of group {gi}: {e}") from None
                work.append((p, g, st, hyper))
        native = _C.adam_cuda_available()
        for p, g, st, hyper in work:
            t = step_count(st["step"]) + 1
            if native and p.is_cuda and kernel_agrees(ops.adam_step, p, g, st, step=t, **hyper):
                absmax = {k: st[k] for k in ABSMAX_KEYS if k in st}
                ops.adam_step(p.detach(), g.detach(), st["exp_avg"], st["exp_avg_sq"], step=t, **hyper, **absmax)
            else:
                adam_step_torch(p.detach(), g.detach(), st, step=t, compile=getattr(self, "compile", False), **hyper)
            st["step"] = t
            self.state[p] = st
        return loss

    def _new_state(self, p: torch.Tensor) -> dict[str, Any]:
        """Fresh state: ``step`` 0 and zero moments in ``p``'s :meth:`~CPUAdam.state_format` on ``p``'s device."""
        return {"step": 0, **new_moments(p.shape, self.state_format(p), zeros=_zeros_on(p.device))}


def _zeros_on(device: torch.device) -> Callable[..., torch.Tensor]:
    return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


def _check_param(gi: int, i: int, p: torch.Tensor, g: torch.Tensor, st: dict[str, Any]) -> None:
    what = f"DeviceAdam param {i} of group {gi} (shape {list(p.shape)}, {p.dtype}, {p.device})"
    if p.is_sparse or g.is_sparse:
        raise ValueError(f"{what}: sparse parameters or gradients are not supported")
    if g.numel() != p.numel() or g.device != p.device:
        raise ValueError(f"{what}: its gradient has {g.numel()} elements on {g.device}; need {p.numel()} on {p.device}")
    for key in ("exp_avg", "exp_avg_sq"):
        t = st.get(key)
        if not isinstance(t, torch.Tensor) or t.numel() != p.numel() or t.device != p.device:
            raise ValueError(
                f"state['{key}'] of {what} is missing, of another size or on another device; load a complete "
                "state_dict, or `del optimizer.state[param]` to restart its moments"
            )

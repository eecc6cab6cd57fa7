"""``CPUAdam``: a ``torch.optim.Optimizer`` that steps CPU parameters with the fused zeroshard kernel."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Any

import torch
import torch.optim.optimizer as _torch_optimizer

from zeroshard import _C
from zeroshard.optim.state_format import (
    ABSMAX_KEYS,
    MIN_8BIT_SIZE,
    check_min_8bit_size,
    check_state_dtype,
    convert_moments,
    format_of,
    new_moments,
)

__all__ = ["CPUAdam"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
_EXP_AVG, _EXP_AVG_SQ = operator.itemgetter("exp_avg"), operator.itemgetter("exp_avg_sq")
_M_ABSMAX, _V_ABSMAX = operator.itemgetter("exp_avg_absmax"), operator.itemgetter("exp_avg_sq_absmax")
_STEP = operator.itemgetter("step")
_data_ptr = torch.Tensor.data_ptr


def step_hooks(func: Callable) -> Callable:
    """What ``torch.optim.Optimizer`` wraps every ``step`` in (``profile_hook_step``: step pre/post hooks, global and
    per optimizer, and ``_optimizer_step_code``), with its ``record_function`` entered only while a profiler runs:
    entering it costs tens of microseconds a step on this CPU even when nothing records, more than a whole step of a
    small model here. Marked ``hooked`` so torch does not wrap the method again."""

    @functools.wraps(func)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        if torch.autograd._profiler_enabled():
            return torch.optim.Optimizer.profile_hook_step(func)(self, *args, **kwargs)
        for pre_hook in chain(_global_pre_hooks().values(), self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, (self, *args), kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"{func} must return None or a tuple of (new_args, new_kwargs), but got {result}."
                    )
                (_, *args), kwargs = result
        out = func(self, *args, **kwargs)
        self._optimizer_step_code()
        for post_hook in chain(self._optimizer_step_post_hooks.values(), _global_post_hooks().values()):
            post_hook(self, (self, *args), kwargs)
        return out

    wrapper.hooked = True  # type: ignore[attr-defined]
    return wrapper


def _global_pre_hooks() -> dict:
    return _torch_optimizer._global_optimizer_pre_hooks  # torch.optim.optimizer.register_optimizer_step_pre_hook


def _global_post_hooks() -> dict:
    return _torch_optimizer._global_optimizer_post_hooks


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for fp32 or bf16 CPU parameters, one fused pass per parameter (``zeroshard.ops.adam_step``).

    A drop-in for ``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam`` (``adamw_mode=False``) with
    ``amsgrad=False, maximize=False``. Per element and step ``t``::

        g = grad (+ weight_decay * p if not adamw_mode)
        p = p * (1 - lr * weight_decay)                     if adamw_mode
        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    (bias correction terms dropped when ``bias_correction=False``). Results match torch to ~1e-7 relative per step
    (see ``zeroshard.ops.adam_step`` for the exact operation order and the one known source of 1-ulp differences).

    Args:
        params: iterable of parameters or of param-group dicts, as for any torch optimizer. Parameters must be on
            the CPU, dense and contiguous, and fp32 or bf16. A bf16 parameter keeps no fp32 master: each step loads
            it as fp32, updates it with fp32 moments and rounds the result to nearest even once, as
            ``DeepSpeedCPUAdam`` does with bf16 parameters and ``fp32_optimizer_states=True`` (torch's AdamW on
            bf16 parameters instead keeps bf16 moments and rounds after each of its operations).
        lr: learning rate, ``>= 0`` (float; a 0-dim tensor is read as a float each step).
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: ``>= 0``, added to the denominator.
        weight_decay: ``>= 0``; decoupled (AdamW) or L2 (Adam) by ``adamw_mode``.
        adamw_mode: keyword only; True = AdamW (Loshchilov & Hutter 2019), False = Adam with L2 penalty.
        bias_correction: keyword only; Adam's bias correction (Kingma & Ba 2015, Alg. 1). torch always applies it.
        state_dtype: keyword only; how the moments are kept (``zeroshard.optim.state_format``):
            ``torch.float32`` (default, torch's format), ``torch.bfloat16`` (fp32 math, moments rounded to nearest
            even on store), or ``"int8"``: block-wise dynamic 8-bit moments (Dettmers et al. 2022, bitsandbytes'
            scheme; see ``zeroshard.ops.adam_step``). The fp32 master weights (the parameters) are kept as they are.
        min_8bit_size: keyword only; with ``state_dtype="int8"``, a parameter of fewer elements keeps fp32 moments
            (default 4096, bitsandbytes' ``min_8bit_size``: ``Optimizer2State.init_state`` in
            ``bitsandbytes/optim/optimizer.py``, bitsandbytes-foundation/bitsandbytes@06029dd, keeps 32-bit state
            for tensors with ``p.numel() < config["min_8bit_size"]``). Norm weights and biases are small and
            their moments the hardest to quantise (a few large values per block); their fp32 state costs little.
            ``0`` quantises every parameter (bitsandbytes never quantises under 4096 elements, whatever the
            setting). Ignored for other formats.
        fp32_state_params: keyword only; with ``state_dtype="int8"``, the parameters that keep fp32 moments, in
            place of the ``min_8bit_size`` rule (every other parameter keeps int8). The ZeRO engine passes the master
            shards of its flat parameters of small parameters: a shard is not the user's tensor, so the size rule
            does not apply to it (:meth:`keep_fp32_state`). Default ``None``: the size rule.

    Gradients: ``p.grad`` (the parameter's dtype, as torch requires), or bf16 / fp16 / fp32 gradients passed to
    :meth:`step` as ``grads={param: grad}``: the kernel upcasts them while loading, with no separate conversion pass
    (``zeroshard.ops.adam_step``).

    State: per parameter ``step`` (0-dim float32 tensor), ``exp_avg`` and ``exp_avg_sq`` in the parameter's format,
    :meth:`state_format` (``state_dtype``, or fp32 for a small parameter under int8; for fp32 and bf16 parameters
    alike). With the default fp32 format these are the keys and layout of
    ``torch.optim.Adam``/``AdamW``, so ``state_dict()`` loads into either and theirs load into this (a torch group's
    ``decoupled_weight_decay`` sets ``adamw_mode``). bf16 format: the same keys, bf16 tensors. int8 format:
    ``exp_avg`` / ``exp_avg_sq`` are uint8 codes shaped like the parameter, plus ``exp_avg_absmax`` /
    ``exp_avg_sq_absmax``, fp32 of ``ceil(numel / 2048)`` elements; ``zeroshard.optim.state_format.moments_fp32``
    turns either into fp32 moments. ``state_dict()`` holds the state as it is kept (no fp32 copy).
    ``load_state_dict`` takes any of the three formats and converts each parameter's moments to its
    :meth:`state_format`: same format as is;
    otherwise through exact fp32 values, then bf16 round to nearest even or the kernel's int8 quantisation.

    Raises:
        ValueError: in ``__init__`` for an out-of-range hyperparameter (naming the value), an unsupported
            ``state_dtype`` (naming the accepted ones), or a ``min_8bit_size`` that is not an int >= 0. In ``step``
            for a bad group hyperparameter, ``amsgrad``/``maximize`` set by a loaded torch state, or a parameter /
            gradient / state tensor that is not on the CPU, sparse, non-contiguous, of a wrong dtype or size (naming
            the parameter's group and index and the fix). All checks run before any parameter or state is modified.
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
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        self.state_dtype = check_state_dtype(state_dtype)
        self.min_8bit_size = check_min_8bit_size(min_8bit_size)
        # explicit fp32-state tensors (by identity), or None: the size rule
        self._fp32_state: dict[int, torch.Tensor] | None = None
        if fp32_state_params is not None:
            self._fp32_state = {id(p): p for p in fp32_state_params}
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        self._plans: dict[int, _GroupPlan] = {}  # by group index; rebuilt when a group's tensors change
        self._seen: tuple | None = None  # optimizer.state as the last successful step left it (_state_unchanged)

    def use_state_dtype(self, state_dtype: torch.dtype | str) -> None:
        """Keeps the moments in ``state_dtype`` from now on (as if given to ``__init__``); for an optimizer that holds
        no state yet (the ZeRO engine sets its ``optimizer_state_dtype`` this way).

        Raises:
            ValueError: an unsupported ``state_dtype`` (naming the accepted ones).
            RuntimeError: the optimizer already holds state (convert it with ``load_state_dict`` instead).
        """
        state_dtype = check_state_dtype(state_dtype)
        if self.state:
            raise RuntimeError(
                f"CPUAdam.use_state_dtype({state_dtype!r}): the optimizer already holds state for {len(self.state)} "
                "parameters; build a new CPUAdam with this state_dtype and load_state_dict the old state into it"
            )
        self.state_dtype = state_dtype
        self._plans = {}

    def keep_fp32_state(self, params: Iterable[torch.Tensor]) -> None:
        """Under ``state_dtype="int8"``, exactly ``params`` keep fp32 moments from now on, in place of the
        ``min_8bit_size`` rule (as ``fp32_state_params`` in ``__init__``); for an optimizer that holds no state yet.
        The ZeRO engine calls it with the master shards of the flat parameters it built from small parameters.

        Raises:
            RuntimeError: the optimizer already holds state.
        """
        if self.state:
            raise RuntimeError(
                f"CPUAdam.keep_fp32_state: the optimizer already holds state for {len(self.state)} parameters; choose "
                "the fp32-state parameters before the first step"
            )
        self._fp32_state = {id(p): p for p in params}
        self._plans = {}

    def state_format(self, p: torch.Tensor) -> torch.dtype | str:
        """The format ``p``'s moments are kept in: ``state_dtype``, except under ``"int8"`` fp32 for a parameter in
        ``fp32_state_params`` (when given) or else of fewer than ``min_8bit_size`` elements (bitsandbytes' rule)."""
        if self.state_dtype != "int8":
            return self.state_dtype
        fp32 = self.__dict__.get("_fp32_state")
        small = id(p) in fp32 if fp32 is not None else p.numel() < self.__dict__.get("min_8bit_size", 0)
        return torch.float32 if small else "int8"

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("state_dtype", torch.float32)
        self.__dict__.setdefault("min_8bit_size", 0)  # pickled before the rule: every parameter int8, as then
        self.__dict__.setdefault("_fp32_state", None)
        for group in self.param_groups:
            # Groups loaded from torch.optim.Adam/AdamW carry decoupled_weight_decay instead of adamw_mode.
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group.setdefault("bias_correction", True)
        for st in self.state.values():
            if "step" in st:
                st["step"] = step_count(st["step"])
        self._plans = {}
        self._seen = None

    def state_dict(self) -> dict[str, Any]:
        """torch's format: as ``torch.optim.AdamW.state_dict()``, ``step`` a 0-dim float32 tensor (kept as a plain
        number while training)."""
        sd = super().state_dict()
        sd["state"] = {k: _torch_state(v) for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, except that the moments keep or take ``state_dtype``
        (torch casts every floating state tensor to its parameter's dtype: bf16 moments of fp32 parameters would
        become fp32, fp32 moments of bf16 parameters bf16, int8 absmax of bf16 parameters bf16). Moments saved in
        another format are converted (see the class docstring). Raises ValueError naming a parameter whose saved
        state is incomplete (exp_avg / exp_avg_sq missing, or an absmax of uint8 moments)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        moments = {}
        for i in saved_ids:
            st = state_dict["state"].get(i, {})
            keys = [k for k in (*_MOMENTS, *ABSMAX_KEYS) if isinstance(st.get(k), torch.Tensor)]
            if not keys:
                continue
            if not all(k in keys for k in _MOMENTS) or (
                st["exp_avg"].dtype == torch.uint8 and not all(k in keys for k in ABSMAX_KEYS)
            ):
                raise ValueError(
                    f"CPUAdam.load_state_dict: the state of saved param {i} has only {keys}; a complete Adam state "
                    f"has exp_avg and exp_avg_sq (int8: also {list(ABSMAX_KEYS)})"
                )
            moments[i] = {k: st[k] for k in keys}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            if i not in moments or p not in self.state:
                continue
            saved = moments[i]
            fmt = self.state_format(p)
            if fmt == torch.float32 and p.dtype == torch.float32 and format_of(saved) == torch.float32:
                continue  # torch's own load: nothing to convert
            st = self.state[p]
            for k in ABSMAX_KEYS:
                st.pop(k, None)
            st.update(convert_moments(saved, fmt, p.shape))
        self._plans = {}

    @step_hooks
    def step(
        self, closure: Callable[[], float] | None = None, *, grads: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> float | None:  # type: ignore[override]
        """Perform one optimization step over every parameter that has a gradient.

        One call into the compiled core for all groups (``_C.adam_step_groups``). Each group's parameters and state
        are checked once, when they first appear or change (another tensor or storage behind a parameter or its
        state: see ``_GroupPlan``); later steps compare data pointers, and check the gradients in C++.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss (run with grad enabled).
            grads: optional ``{param: gradient}``: CPU, contiguous, the parameter's number of elements, float32,
                bfloat16 or float16. Used instead of ``param.grad`` for those parameters.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: see the class docstring; nothing is modified when it is raised.
        """
        # No torch.no_grad() here (it costs microseconds a step): the kernel writes through raw pointers, bumping
        # autograd's version counters itself, and the new moments are made from no tensor that requires grad.
        loss = run_closure(closure)
        state = self.state
        seen, self._seen = getattr(self, "_seen", None), None  # kept only across successful steps
        same_state = _state_unchanged(state, seen)
        work, plans = [], []
        for gi, group in enumerate(self.param_groups):
            _check_group(gi, group)
            params = group["params"]
            if grads is None:
                gl = [p.grad for p in params]
            else:
                gl = [grads.get(p, p.grad) for p in params]
            plan = self._plans.get(gi)
            if plan is None or not plan.current(params, state, gl, same_state):
                plan = _GroupPlan(gi, params, state, gl, self._new_state, self.state_format)
                self._plans[gi] = plan
            ready = plan.ready_grads(gl)
            beta1, beta2 = group["betas"]
            work.append((plan.cpp, ready, plan.steps(), float(group["lr"]), float(beta1), float(beta2),
                         float(group["eps"]), float(group["weight_decay"]), bool(group["adamw_mode"]),
                         bool(group["bias_correction"]), 1.0, 1.0))  # fmt: skip
            plans.append((plan, ready))
        _C.adam_step_groups(work)
        for plan, ready in plans:
            plan.commit(state, ready)
        self._seen = (state, list(state), list(state.values()))
        return loss

    def _new_state(self, p: torch.Tensor) -> dict[str, Any]:
        """Fresh state of ``p``: ``step`` (a plain number here) and zero moments shaped like ``p`` in its
        :meth:`state_format` (also for a bf16 ``p``), on the CPU; int8 adds the zero absmax tensors."""
        return {"step": 0, **new_moments(p.shape, self.state_format(p))}


class _GroupPlan:
    """One param group as the compiled core steps it: the parameters that have state, checked once (``_C.AdamGroup``).

    A parameter gets its state the first time it has a gradient (as in torch); the plan is rebuilt then, and whenever
    the group's parameters or their state dicts are no longer the objects it was built from (``load_state_dict``,
    ``optimizer.state[p] = {...}``), or the tensors behind them changed: a parameter's storage (``p.data = new``,
    ``module.to(dtype)``, ``.bfloat16()``, ``_apply``, ``torch.utils.swap_tensors``) or its ``exp_avg`` /
    ``exp_avg_sq`` (replaced in the state dict, or their ``.data`` set). In-place changes need no rebuild.

    Staleness is seen by data pointer alone, with no per-tensor dtype or shape read each step (those cost more than
    the pointers): the core steps detached aliases this plan holds, so every storage it was built on stays allocated
    and a tensor that gets another storage (a conversion, a copy, a new allocation) cannot come back at the same
    address. A dtype or size can change at the same address only through a view of the same memory: a reshape, which
    the flat kernel steps the same, or a shrinking slice, whose gradient the core then refuses by size.
    """

    __slots__ = (
        "params", "states", "ready", "stateless", "pending", "cpp", "stepped", "stepped_states", "ptrs", "int8",
    )  # fmt: skip

    def __init__(
        self, gi: int, params: list, state: dict, grads: list, new_state: Callable, state_format: Callable
    ) -> None:
        self.params = list(params)
        self.states = [state.get(p) for p in params]
        self.ready: list[int] = []  # indices of parameters the core steps (they have, or are about to get, state)
        self.stateless: list[int] = []  # no state and no gradient yet
        self.pending: dict[int, dict] = {}  # state created now, added to optimizer.state once the step succeeded
        for i, (p, st, g) in enumerate(zip(params, self.states, grads)):
            if st:
                if "step" in st:
                    st["step"] = step_count(st["step"])
            elif g is not None:
                self.pending[i] = self.states[i] = new_state(p)  # the core checks p before anything is kept
            else:
                self.stateless.append(i)
                continue
            self.ready.append(i)
        self.stepped = [self.params[i] for i in self.ready]
        self.stepped_states = [self.states[i] for i in self.ready]
        formats = [state_format(p) for p in self.stepped]
        for i, p, st, fmt in zip(self.ready, self.stepped, self.stepped_states, formats):
            _check_state(gi, i, p, st, fmt)
        sts = self.stepped_states
        # the stepped tensors whose moments are int8 (others fp32 / bf16: no absmax; the core takes None there)
        self.int8 = [j for j, fmt in enumerate(formats) if fmt == "int8"]

        def absmax(key: str) -> list:
            return [st[key].detach() if f == "int8" else None for st, f in zip(sts, formats)]

        self.cpp = _C.AdamGroup(
            [p.detach() for p in self.stepped],
            [st["exp_avg"].detach() for st in sts],
            [st["exp_avg_sq"].detach() for st in sts],
            "CPUAdam",
            gi,
            absmax("exp_avg_absmax") if self.int8 else None,
            absmax("exp_avg_sq_absmax") if self.int8 else None,
        )
        self.ptrs = self.pointers()

    def pointers(self) -> list[int]:
        """Data pointers of every stepped parameter, then of their ``exp_avg``, then of their ``exp_avg_sq`` (then of
        both absmax tensors of those kept in int8), as the group's objects hold them now (KeyError / TypeError /
        RuntimeError if a state entry is gone or no tensor)."""
        sts = self.stepped_states
        tensors = chain(self.stepped, map(_EXP_AVG, sts), map(_EXP_AVG_SQ, sts))
        if self.int8:
            q = [sts[j] for j in self.int8]
            tensors = chain(tensors, map(_M_ABSMAX, q), map(_V_ABSMAX, q))
        return list(map(_data_ptr, tensors))

    def current(self, params: list, state: dict, grads: list, same_state: bool = False) -> bool:
        """Still valid: the same parameters and state dicts, no gradient for a parameter without state, and the same
        storages behind the stepped parameters and their moments. ``same_state``: ``state`` is as the last successful
        step left it (``_state_unchanged``), when every plan's state dicts were ``state``'s: no lookup needed."""
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            return False
        if not same_state and not all(map(operator.is_, map(state.get, params), self.states)):
            return False
        if any(grads[i] is not None for i in self.stateless):
            return False
        try:
            return self.pointers() == self.ptrs
        except (KeyError, TypeError, RuntimeError):  # an entry deleted or not a tensor: the rebuild names it
            return False

    def ready_grads(self, grads: list) -> list:
        return grads if not self.stateless else [grads[i] for i in self.ready]

    def steps(self) -> list[int]:
        return list(map(_STEP, self.stepped_states))

    def commit(self, state: dict, grads: list) -> None:
        """After a successful step: new states join ``optimizer.state``, and each stepped parameter counts a step."""
        for i, st in self.pending.items():
            state[self.params[i]] = st
        self.pending = {}
        for st, g in zip(self.stepped_states, grads):
            if g is not None:
                st["step"] += 1


def _state_unchanged(state: dict, seen: tuple | None) -> bool:
    """``state`` holds the same keys and value objects, in the same order, as ``seen`` = ``(state, keys, values)``
    recorded it. Hashes no key (a tensor's ``__hash__`` is a Python call): 0.05 us per entry against 0.15 for
    ``state.get(param)``."""
    if seen is None or seen[0] is not state or len(state) != len(seen[1]):
        return False
    return all(map(operator.is_, state, seen[1])) and all(map(operator.is_, state.values(), seen[2]))


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
        step_count(state["step"]),
        float(group["lr"]),
        float(beta1),
        float(beta2),
        float(group["eps"]),
        float(group["weight_decay"]),
        bool(group["adamw_mode"]),
        bool(group["bias_correction"]),
    )


def step_count(step: Any) -> int:
    """A state's ``step`` as a plain int (torch keeps a 0-dim float tensor; a loaded checkpoint may hold one)."""
    return int(step.item()) if isinstance(step, torch.Tensor) else int(step)


_FIX = {torch.float32: "t.float()", torch.bfloat16: "t.bfloat16()", "int8": "zeroshard.ops.quantize_state(t)"}


def _check_state(gi: int, i: int, p: torch.Tensor, st: dict[str, Any], state_dtype: Any = torch.float32) -> None:
    """The state of param ``i`` of group ``gi`` holds ``step`` and moments of ``p``'s size in ``state_dtype``, the
    parameter's :meth:`CPUAdam.state_format` (int8:
    with both absmax tensors; the core checks the rest: their sizes, device, layout, contiguity, aliasing). Raises
    ValueError naming the parameter and the fix."""
    what = f"CPUAdam param {i} of group {gi} (shape {list(p.shape)}, {p.dtype})"
    m, v = st.get("exp_avg"), st.get("exp_avg_sq")
    if not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor) or "step" not in st:
        raise ValueError(f"{what}: its state lacks step, exp_avg or exp_avg_sq; load a complete Adam/AdamW state_dict")
    int8 = state_dtype == "int8"
    want = torch.uint8 if int8 else state_dtype
    for key, t in (("exp_avg", m), ("exp_avg_sq", v)):
        if t.dtype != want:
            raise ValueError(
                f"state['{key}'] of {what} is {t.dtype}; this CPUAdam keeps {want} moments for it (format "
                f"{state_dtype!r}, also for bf16 parameters; under int8, fp32 for parameters below min_8bit_size): "
                f"assign {_FIX[state_dtype]}, or load_state_dict to convert"
            )
        if t.numel() != p.numel():
            raise ValueError(
                f"state['{key}'] of {what} has shape {list(t.shape)} ({t.numel()} elements) but the parameter has "
                f"{p.numel()} (one of them was replaced by a tensor of another size): give both the same size, or "
                f"`del optimizer.state[param]` to restart its moments"
            )
    if int8:
        for key in ABSMAX_KEYS:
            if not isinstance(st.get(key), torch.Tensor):
                raise ValueError(
                    f"{what}: its int8 state lacks {key} (one fp32 absmax per 2048 elements); load a complete "
                    f"state_dict, or `del optimizer.state[param]` to restart its moments"
                )


def _torch_state(st: dict[str, Any]) -> dict[str, Any]:
    """A copy of one parameter's state with ``step`` as torch stores it (a 0-dim float32 tensor)."""
    if "step" not in st or isinstance(st["step"], torch.Tensor):
        return st
    return {**st, "step": torch.tensor(float(st["step"]), dtype=_step_dtype())}


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

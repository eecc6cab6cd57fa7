"""Random draws made by constructors on the meta device, recorded so that materialisation can replay them.

An eager build consumes random numbers twice for a Hugging Face model: once in the constructors (``nn.Linear`` runs
``reset_parameters()``, GPT-2's ``Conv1D`` calls ``nn.init.normal_``), then again in ``post_init()``, whose
``_init_weights`` overwrites those values. On the meta device the constructors' draws consume nothing, so replaying
``_init_weights`` alone would start from another point of the random stream and give other numbers. Under
:func:`zeroshard.meta_init.init_meta_context` each random initialiser a constructor applies to a meta tensor (the
``nn.init`` functions, the random in-place tensor methods, random factories such as ``torch.randn``) is recorded here
with its arguments and target; materialisation replays each one on a scratch tensor of the same shape, dtype and
device (the same draws, so the generator advances exactly as in the eager build), then frees it.

Nothing is patched: recording happens in the scoped torch function mode of ``init_meta_context``. A log holds weak
references to its targets, so it keeps no model alive; a log whose targets are all gone (materialised models drop
their meta tensors) is dropped when the next session starts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

# in-place initialisers that consume random numbers (a draw on meta consumes nothing, so these must be replayed)
RANDOM_INITIALIZERS = frozenset(
    [getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "bernoulli_", "exponential_", "random_", "cauchy_",
                                        "log_normal_", "geometric_")]
    + [getattr(nn.init, n) for n in ("normal_", "uniform_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
                                     "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
       if hasattr(nn.init, n)]
)  # fmt: skip

# factories that consume random numbers; on meta they allocate nothing and draw nothing
RANDOM_FACTORIES = frozenset(
    getattr(torch, n)
    for n in ("randn", "rand", "randint", "randperm", "normal", "randn_like", "rand_like", "randint_like", "bernoulli",
              "multinomial", "poisson")
)  # fmt: skip

_MAX_LOGS = 16


@dataclass
class Draw:
    """One recorded draw: ``func`` applied to a tensor of ``shape``/``dtype`` (in-place) or called as a factory."""

    seq: int
    func: Callable
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple
    kwargs: dict
    factory: bool
    target: weakref.ref  # the meta tensor drawn into / created (dead once a tie or re-registration replaced it)

    @torch.no_grad()
    def replay(self, device: torch.device, out: torch.Tensor | None = None) -> None:
        """Repeats the draw on ``device`` (into ``out`` when given, else into a scratch tensor that is freed)."""
        if self.factory:
            kwargs = {**self.kwargs, "device": device}
            result = self.func(*self.args, **kwargs)
            if out is not None:
                out.copy_(result)
            return
        t = out if out is not None else torch.empty(self.shape, dtype=self.dtype, device=device)
        self.func(t, *self.args, **self.kwargs)


@dataclass
class DrawLog:
    """The draws of one ``init_meta_context`` session, in order."""

    draws: list[Draw] = field(default_factory=list)

    def record_inplace(self, func: Callable, tensor: torch.Tensor, args: tuple, kwargs: dict) -> None:
        self.draws.append(
            Draw(len(self.draws), func, tuple(tensor.shape), tensor.dtype, args, kwargs, False, weakref.ref(tensor))
        )

    def record_factory(self, func: Callable, result: torch.Tensor, args: tuple, kwargs: dict) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "out")}
        self.draws.append(
            Draw(len(self.draws), func, tuple(result.shape), result.dtype, args, kwargs, True, weakref.ref(result))
        )

    def alive(self) -> bool:
        return any(d.target() is not None for d in self.draws)


_LOGS: list[DrawLog] = []


def new_log() -> DrawLog:
    """A log for one meta-construction session, registered so materialisation can find it."""
    _LOGS[:] = [log for log in _LOGS if log.alive()][-(_MAX_LOGS - 1) :]
    log = DrawLog()
    _LOGS.append(log)
    return log


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (shared by its views, ``.data`` and ``nn.Parameter`` wrappers), meta included."""
    return t.untyped_storage()._cdata


def find_log(tensors: list[torch.Tensor]) -> DrawLog | None:
    """The most recent log with a draw into one of ``tensors`` (matched by storage), or None."""
    keys = {storage_key(t) for t in tensors if t.is_meta}
    for log in reversed(_LOGS):
        for d in log.draws:
            t = d.target()
            if t is not None and storage_key(t) in keys:
                return log
    return None

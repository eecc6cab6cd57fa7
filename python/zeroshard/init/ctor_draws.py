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

from zeroshard.init.writes import (  # noqa: F401  (re-exported: the names this module always had)
    OVERWRITE_INITIALIZERS,
    RANDOM_FACTORIES,
    RANDOM_INITIALIZERS,
)

_MAX_LOGS = 16


@dataclass
class Draw:
    """One recorded write into a meta tensor, in the order the constructors made it.

    ``func`` applied in place to a tensor of ``shape``/``dtype`` (``view`` is its size, stride and storage offset, for
    writes into part of a tensor such as ``weight[pad].zero_()``), or called as a factory that created the tensor.
    ``random`` writes consume random numbers; the others (``zeros_``, ``fill_``, ``torch.ones``, ``mul_(2)``) follow
    from their arguments. ``func is None`` marks a write that cannot be replayed (it reads another tensor, e.g.
    ``copy_(src)``): the tensor's value since then is unknown.
    """

    seq: int
    func: Callable | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple
    kwargs: dict
    factory: bool
    target: weakref.ref  # the meta tensor drawn into / created (dead once a tie or re-registration replaced it)
    random: bool = True
    view: tuple | None = None  # (size, stride, storage_offset) of the written tensor
    key: int = 0  # storage_key of the written tensor when written (valid while that storage lives: see DrawLog.created)

    @torch.no_grad()
    def replay(self, device: torch.device, out: torch.Tensor | None = None) -> None:
        """Repeats the write on ``device`` (into ``out`` when given, else into a scratch tensor that is freed)."""
        if self.factory:
            kwargs = {**self.kwargs, "device": device}
            result = self.func(*self.args, **kwargs)
            if out is not None:
                out.copy_(result)
            return
        t = out if out is not None else torch.empty(self.shape, dtype=self.dtype, device=device)
        self.func(t, *self.args, **self.kwargs)

    def overwrites(self, tensor: torch.Tensor) -> bool:
        """Whether this write sets every element of ``tensor`` (a meta tensor of the same storage) and reads none."""
        if self.func is None:
            return False
        if not self.factory and self.func not in OVERWRITE_INITIALIZERS:
            return False
        return self.view == (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def replay_into(self, new: torch.Tensor, old: torch.Tensor, device: torch.device) -> None:
        """Repeats the write into ``new``, the materialised replacement of meta tensor ``old`` (same storage)."""
        size, stride, offset = self.view
        if self.view == (tuple(old.shape), tuple(old.stride()), old.storage_offset()):
            self.replay(device, out=new)
            return
        part = new.as_strided(size, stride, new.storage_offset() + offset - old.storage_offset())
        self.replay(device, out=part)


@dataclass
class Registration:
    """``parent.name = child`` (a submodule registered), in the constructors' order; ``replaced``: the name held
    another module before (a wrapper such as peft's LoRA layer put over an existing layer)."""

    seq: int
    parent: weakref.ref
    child: weakref.ref
    replaced: bool


@dataclass
class DrawLog:
    """The writes and submodule registrations of one ``init_meta_context`` session, in order.

    ``empty_init``: built under Lightning's ``init_module(empty_init=True)``, whose meaning is "skip the constructors'
    initialisation" (Lightning's DDP skips ``torch.nn.init`` calls; its FSDP runs ``reset_parameters()`` at setup):
    plain modules then get ``reset_parameters()`` at setup rather than a replay of their constructors.
    """

    draws: list[Draw] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)
    empty_init: bool = False
    seq: int = 0
    # storage_key -> seq of the last meta storage created at that address: writes recorded before it went to a
    # storage that has died since (addresses are reused), never to the live one
    created: dict[int, int] = field(default_factory=dict)

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def record_inplace(
        self, func: Callable | None, tensor: torch.Tensor, args: tuple, kwargs: dict, *, random: bool = True
    ) -> None:
        view = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        ref = weakref.ref(tensor)
        self.draws.append(
            Draw(self._next(), func, view[0], tensor.dtype, args, kwargs, False, ref, random, view, storage_key(tensor))
        )

    def record_factory(self, func: Callable, result: torch.Tensor, args: tuple, kwargs: dict, *, random=True) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "out")}
        view = (tuple(result.shape), tuple(result.stride()), result.storage_offset())
        key = storage_key(result)
        self.created[key] = self._next()
        ref = weakref.ref(result)
        self.draws.append(Draw(self._next(), func, view[0], result.dtype, args, kwargs, True, ref, random, view, key))

    def record_creation(self, tensor: torch.Tensor) -> None:
        """A new meta storage (any operation's output that is not a view)."""
        self.created[storage_key(tensor)] = self._next()

    def writes_by_storage(self) -> dict[int, list[Draw]]:
        """storage_key -> the recorded writes into the storage living there now, in order (none from a dead storage
        that had the same address)."""
        out: dict[int, list[Draw]] = {}
        for d in self.draws:
            if d.seq > self.created.get(d.key, 0):
                out.setdefault(d.key, []).append(d)
        return out

    def record_registration(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        replaced = parent._modules.get(name) is not None and parent._modules.get(name) is not child
        self.registrations.append(Registration(self._next(), weakref.ref(parent), weakref.ref(child), replaced))

    def random_draws(self) -> DrawLog:
        """This log with its random draws only (what the random stream depends on)."""
        draws = [d for d in self.draws if d.random and d.func is not None]
        return DrawLog(draws, self.registrations, self.empty_init, self.seq, self.created)

    def alive(self) -> bool:
        return any(d.target() is not None for d in self.draws)


_LOGS: list[DrawLog] = []


def new_log(*, empty_init: bool = False) -> DrawLog:
    """A log for one meta-construction session, registered so materialisation can find it."""
    _LOGS[:] = [log for log in _LOGS if log.alive()][-(_MAX_LOGS - 1) :]
    log = DrawLog(empty_init=empty_init)
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

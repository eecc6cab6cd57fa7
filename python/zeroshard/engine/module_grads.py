"""ModuleGrads: the model's ``param.grad`` under ZeRO, from the end of a backward until the optimizer step.

DDP leaves the averaged gradient in every ``param.grad``; ZeRO keeps it as fp32 shards on the optimizer's master
weights (stage 1-3) or in host buffers (offload), so without this the model's ``.grad`` would be ``None`` and
Lightning's ``grad_norm``, gradient logging and a user's gradient surgery would silently see nothing. After each
backward the engine calls :meth:`ModuleGrads.install`, which puts a
:class:`~zeroshard.sharding.sharded_grad.ShardedGradient` in the ``.grad`` of every parameter that has a gradient (see
that module for what reading and writing one does). Nothing is gathered unless someone reads.

Lifetime, as a DDP parameter's gradient between backward and ``zero_grad``:

* installed when a backward ends (the reduced gradient; during accumulation, this rank's local one);
* a replacement (``p.grad = t``) or ``p.grad = None`` reaches the step: before each optimizer step (a step pre-hook),
  before clipping and before the fp16 unscale, this rank's slice of ``t`` is written into its gradient shard (``None``
  writes zeros: the flat parameter still steps, with a zero gradient for that parameter's elements, where DDP would
  skip the parameter);
* cleared (``None``) after the optimizer step that consumed it, and by a gradient hook on each parameter just before
  the next backward accumulates into it, so a stale placeholder never meets a new gradient.

The cost when nobody reads: one placeholder assignment per parameter per backward, one hook call per parameter per
backward and one identity check per parameter per step (``benchmarks/bench_module_grads.py`` measures it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from zeroshard.offload.offload import OffloadedAdam
from zeroshard.sharding.collective_errors import named_collective
from zeroshard.sharding.flat_param import FlatParam
from zeroshard.sharding.sharded_grad import ShardedGradient


class ModuleGrads:
    """Gradient placeholders for an engine's trainable flat parameters.

    Args:
        engine: the :class:`~zeroshard.engine.engine.ZeroEngine` (its flat parameters, optimizers, offload, process
            group and step counter).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self._installed: dict[int, tuple[FlatParam, list[ShardedGradient]]] = {}  # id(fp) -> placeholders
        self._placeholders: dict[tuple[int, bool], list[ShardedGradient]] = {}  # (id(fp), local) -> placeholders
        self._cache: _Gathered | None = None  # the one flat parameter's gradient gathered now
        self._hooks = [
            p.register_hook(self._make_clear_hook(p)) for fp in engine.flat_params for p in fp.params if p.requires_grad
        ]
        self._optimizer_hooks: list = []
        self.hook_optimizers()

    def remove_hooks(self) -> None:
        for h in self._hooks + self._optimizer_hooks:
            h.remove()
        self._hooks, self._optimizer_hooks = [], []

    def hook_optimizers(self) -> None:
        """Replaced gradients reach every step of the engine's (current) optimizers: a step pre-hook writes them."""
        for h in self._optimizer_hooks:
            h.remove()
        self._optimizer_hooks = [
            opt.register_step_pre_hook(lambda opt, args, kwargs: self.sync(self.engine.optim.flat_params_of(opt)))
            for opt in self.engine.optimizers
        ]

    # -- lifetime ------------------------------------------------------------------------------------------------------

    def install(self, synced: bool) -> None:
        """After a backward: placeholders into the ``.grad`` of every parameter whose flat parameter got a gradient
        (``synced``: the reduced one; else this rank's local accumulation)."""
        self._drop_cache()
        for fp in self.engine.flat_params:
            if synced and self._source(fp, check=False)[0] is None:
                continue
            if not synced and fp.full_grad is None:
                continue
            key = (id(fp), not synced)
            grads = self._placeholders.get(key)
            if grads is None:  # made once per flat parameter and kind, then reused: an install only assigns
                grads = self._placeholders[key] = [
                    ShardedGradient(fp, i, self, not synced) for i in range(len(fp.params))
                ]
            self._installed[id(fp)] = (fp, grads)
            with _plain_grad_access():
                for holders, g in zip(_holders(fp), grads):
                    for t in holders:
                        t.grad = g

    def clear(self, flat_params: Iterable[FlatParam] | None = None) -> None:
        """``.grad = None`` where a placeholder of ``flat_params`` (default: all) is still installed."""
        self._drop_cache()
        ids = list(self._installed) if flat_params is None else [id(fp) for fp in flat_params]
        for key in ids:
            entry = self._installed.pop(key, None)
            if entry is None:
                continue
            fp, grads = entry
            with _plain_grad_access():
                for holders, g in zip(_holders(fp), grads):
                    for t in holders:
                        if t.grad is g:
                            t.grad = None

    def _make_clear_hook(self, param: nn.Parameter):
        def hook(grad: torch.Tensor) -> None:
            # runs before the autograd engine accumulates into param.grad: a placeholder must not receive the sum
            if isinstance(param.grad, ShardedGradient):
                self._drop_cache()  # writes through views of the old gradient land before the new one arrives
                param.grad = None

        return hook

    @torch.no_grad()
    def sync(self, flat_params: Iterable[FlatParam] | None = None) -> None:
        """Writes gradients the user replaced (``p.grad = t`` or ``None``) into this rank's gradient shards, then puts
        the placeholders back. Collective-free: each rank writes its own slice of its own ``t``."""
        self._drop_cache()  # the shards are about to change (unscale, clip, step): read them afresh afterwards
        flat_params = self.engine.flat_params if flat_params is None else flat_params
        for fp in flat_params:
            entry = self._installed.get(id(fp))
            if entry is None:
                continue
            grads = entry[1]
            replaced = []
            with _plain_grad_access():  # a plain loop: this runs before every step, read or not
                for i, (holders, g) in enumerate(zip(_holders(fp), grads)):
                    for t in holders:
                        if t.grad is not g:
                            replaced.append((i, holders, g))
                            break
            for i, holders, g in replaced:
                with _plain_grad_access():
                    user = [t.grad for t in holders if t.grad is not g]
                self._store(fp, i, g, user[-1])
                with _plain_grad_access():
                    for t in holders:
                        t.grad = g

    def _store(self, fp: FlatParam, index: int, g: ShardedGradient, new: torch.Tensor | None) -> None:
        if g.local:
            view = fp.full_grad_views()[index]
            view.copy_(new) if new is not None else view.zero_()
            return
        src, scale = self._source(fp)
        if src is None:
            return
        flat = None if new is None else new.detach().reshape(-1).to(src.device, torch.float32)
        for pi, p_off, s_off, n in fp.layout.shard_slices(fp.rank):
            if pi == index:
                piece = src[s_off : s_off + n]
                piece.copy_(flat[p_off : p_off + n] / scale) if flat is not None else piece.zero_()

    # -- GradAccess ----------------------------------------------------------------------------------------------------

    def value(self, g: ShardedGradient, exact: bool) -> torch.Tensor:
        if g.local:
            view = g.flat.full_grad_views()[g.index]
        else:
            view = self._gathered(g)[g.index]
        return view if exact or view.dtype == g.dtype else view.to(g.dtype)

    def written(self, g: ShardedGradient) -> None:
        if not g.local:  # (a local value is this rank's accumulation buffer itself)
            self._write_back(self._cache)

    def exposed(self, g: ShardedGradient) -> None:
        if not g.local and self._cache.snapshot is None:
            begin, end = g.flat.layout.shard_range(g.flat.rank)
            self._cache.snapshot = self._cache.full[begin:end].clone()

    @torch.no_grad()
    def _write_back(self, cache: _Gathered, changed_only: bool = False) -> None:
        """This rank's slice of ``cache`` into its gradient shard (``changed_only``: the elements that differ from
        the snapshot taken when a view was handed out)."""
        fp = cache.flat
        src, scale = self._source(fp)
        if src is None:
            return
        begin, end = fp.layout.shard_range(fp.rank)
        mine = cache.full[begin:end]
        new = (mine / scale if scale != 1.0 else mine).to(src.device, src.dtype)
        if changed_only:
            changed = mine.ne(cache.snapshot).to(src.device)
            src[changed] = new[changed]
        else:
            src.copy_(new)

    def _drop_cache(self) -> None:
        """Forgets the gathered gradient, first storing what was written through views of it."""
        cache, self._cache = self._cache, None
        if cache is not None and cache.snapshot is not None:
            self._write_back(cache, changed_only=True)

    def describe(self, g: ShardedGradient) -> str:
        return f"'{g.flat.names[g.index]}'"

    @torch.no_grad()
    def _gathered(self, g: ShardedGradient) -> list[torch.Tensor]:
        """Per-parameter views of ``g``'s flat parameter's whole reduced gradient (fp32), gathered once per flat
        parameter and kept until another one is read (so one flat parameter's gradient is whole at a time)."""
        fp = g.flat
        if self._cache is not None and self._cache.flat is fp:
            return self._cache.views
        self._drop_cache()
        engine = self.engine
        src, scale = self._source(fp)
        device = engine._device()  # the process group's device (NCCL: the current CUDA device)
        shard = (
            torch.zeros(fp.layout.shard_numel, dtype=torch.float32, device=device)
            if src is None
            else src.to(device, torch.float32, copy=True)
        )
        if scale != 1.0:
            shard.mul_(scale)
        full = torch.empty(fp.layout.padded_numel, dtype=torch.float32, device=device)
        what = (
            f"reading the .grad of {self.describe(g)}: a collective, every rank must read the same gradients in the "
            "same order"
        )
        with named_collective(
            "gradient all-gather", what, step=engine.steps, rank=engine.rank, world_size=engine.world_size
        ):
            engine.collectives.all_gather([shard], [full], full.numel()).wait()  # the shard group's bucketed path
        full = full.to(fp.device)
        self._cache = _Gathered(fp, full, fp.layout.views(full))
        return self._cache.views

    def _source(self, fp: FlatParam, check: bool = True) -> tuple[torch.Tensor | None, float]:
        """This rank's reduced gradient shard of ``fp`` and the factor still to apply to it (fp16 unscale and clip
        coefficient an :class:`OffloadedAdam` folds into its step), or ``(None, 1.0)``.

        Raises:
            RuntimeError: (``check``) ``overlap_step`` already stepped ``fp`` during backward.
        """
        engine = self.engine
        opt = engine.optim.optimizer_of(fp)
        if isinstance(opt, OffloadedAdam):
            if check and opt.stepped_during_backward(fp):
                raise RuntimeError(
                    f"zeroshard: the gradient of {fp.names[0]} (and its bucket) was consumed by overlap_step=True, "
                    "which steps each bucket during backward. Reading or changing .grad needs overlap_step=False."
                )
            if not engine.offload.has_gradient(fp):
                return None, 1.0
            return engine.offload.wait_for_gradients([fp])[0], opt.grad_unscale * opt.grad_clip
        grad = fp.master.grad if fp.master is not None else None
        return grad, 1.0


class _Gathered:
    """One flat parameter's whole reduced gradient (fp32, 1-D, padded), its per-parameter views, and this rank's
    slice as it was when a view of it was first handed out (``None`` before)."""

    def __init__(self, flat: FlatParam, full: torch.Tensor, views: list[torch.Tensor]) -> None:
        self.flat, self.full, self.views = flat, full, views
        self.snapshot: torch.Tensor | None = None


def _plain_grad_access():
    """``.grad`` of stage-3 placeholders read and set without their ``__torch_function__`` (a Python call each, 5 us:
    most of an install's time otherwise)."""
    return torch._C.DisableTorchFunctionSubclass()


def _holders(fp: FlatParam) -> list[list[torch.Tensor]]:
    """Per parameter of ``fp``, the tensors whose ``.grad`` users may read: the parameter, and at stage 3 its
    placeholder (what the module holds while the unit is freed)."""
    if fp.placeholders is None:
        return [[p] for p in fp.params]
    return [[p, ph] for p, ph in zip(fp.params, fp.placeholders)]

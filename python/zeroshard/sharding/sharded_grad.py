"""ShardedGradient: a parameter's ``.grad`` after a ZeRO backward, so users read gradients where DDP puts them.

Under ZeRO the reduced gradient of a parameter exists only as pieces of fp32 gradient shards, one per rank (the master
shards' ``.grad``, or the host gradient shards with optimizer offload). Lightning's ``grad_norm``, a user's
``self.layer.weight.grad`` in ``on_before_optimizer_step`` or between ``manual_backward`` and ``step`` would otherwise
find ``None``. After each backward the engine puts this placeholder in every trainable parameter's ``.grad`` (at
stage 3 also in its :class:`~zeroshard.sharding.sharded_param.ShardedParameter`'s): a tensor subclass with the
parameter's shape, dtype and device and no memory (``torch.Tensor._make_wrapper_subclass``), whose values are served
on use by its owner (:class:`~zeroshard.engine.module_grads.ModuleGrads`):

* a read all-gathers the gradient shards of the parameter's flat parameter (a collective: every rank must read the same
  gradients in the same order, as Lightning's callbacks and ``grad_norm`` do). We gather rather than return a sharded
  view because a view's norm would be this rank's part only, and user code calls arbitrary ops; the gathered value is
  exactly what DDP's all-reduced ``.grad`` holds (the average over ranks). Nothing is gathered, and nothing costs,
  when nobody reads a gradient;
* an in-place op (``p.grad.mul_(0.5)``, ``clamp_``, ``zero_``, ``copy_``, ``clip_grad_norm_``'s scaling) is applied to
  the gathered value and this rank's slice is written back into its gradient shard, so it reaches the optimizer step;
  a view (``p.grad[0]``) is a view of the gathered value, and what is written through it is written back before the
  next read of another flat parameter's gradient and before clipping and the step;
* during gradient accumulation (a backward that did not synchronise) it serves this rank's local accumulated
  gradient, as DDP's ``no_sync`` leaves it, with no communication;
* ``repr()`` never reads values; a deep copy or pickle holds whole values.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_map

from zeroshard.sharding.sharded_param import _contiguous

aten = torch.ops.aten


class GradAccess(Protocol):
    """The engine's side of a gradient placeholder (:class:`zeroshard.engine.module_grads.ModuleGrads`)."""

    def value(self, grad: ShardedGradient, exact: bool) -> torch.Tensor:
        """The whole gradient: in ``grad``'s dtype, or (``exact``, for an op that writes it) in the dtype it is
        kept in, as a tensor whose writes :meth:`written` then stores."""

    def written(self, grad: ShardedGradient) -> None:
        """An in-place op changed the value :meth:`value` returned for ``grad``: store it."""

    def exposed(self, grad: ShardedGradient) -> None:
        """A view of the (exact) value of ``grad`` was handed out: store what is written through it later."""

    def describe(self, grad: ShardedGradient) -> str:
        """The parameter's name, for messages."""


class ShardedGradient(torch.Tensor):
    """Stand-in for the gradient of parameter ``index`` of flat parameter ``flat`` (see the module doc).

    Attributes:
        flat: the :class:`~zeroshard.sharding.flat_param.FlatParam` holding the parameter.
        index: the parameter's position in ``flat.params``.
        access: the :class:`GradAccess` serving values and writes.
        local: True for a gradient not reduced yet (an accumulation micro-batch): this rank's own, no collective.
    """

    flat: object
    index: int
    access: GradAccess
    local: bool

    @staticmethod
    def __new__(cls, flat, index: int, access: GradAccess, local: bool) -> ShardedGradient:
        shape = flat.shapes[index]
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=_contiguous(shape), dtype=flat.dtype, device=flat.device, requires_grad=False
        )
        t.flat, t.index, t.access, t.local = flat, index, access, local
        return t

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __repr__(self, *, tensor_contents=None) -> str:
        kind = "local, not reduced yet" if self.local else "reduced, sharded across ranks"
        return (
            f"ShardedGradient({self.access.describe(self)}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}: {kind}; reading it is a collective every rank must make)"
        )

    def __deepcopy__(self, memo):
        out = self.access.value(self, exact=False).clone()
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        return self.__deepcopy__({}).__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):  # p.grad.data, p.grad.detach()
            g = args[0]
            return ShardedGradient(g.flat, g.index, g.access, g.local)
        written = _written_args(func, args, kwargs)
        if written and torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                f"zeroshard: backward tried to accumulate into the .grad of {written[0].access.describe(written[0])}, "
                "which still holds the gradient of an earlier backward. Its parameter's gradient hook clears it "
                "first; please report this with the model."
            )
        flat, _ = tree_flatten((args, kwargs))
        grads = [a for a in flat if isinstance(a, ShardedGradient)]
        exact = {id(g) for g in written} | ({id(g) for g in grads} if func.is_view else set())
        values = {id(g): g.access.value(g, exact=id(g) in exact) for g in grads}
        real_args, real_kwargs = tree_map(lambda a: values.get(id(a), a), (args, kwargs))
        out = func(*real_args, **real_kwargs)
        for g in written:
            g.access.written(g)
        if written:  # an in-place op returns its (first) written argument: the placeholder, as torch returns self
            back = {id(values[id(g)]): g for g in written}
            return tree_map(lambda t: back.get(id(t), t), out)
        if func.is_view:
            for g in grads:
                g.access.exposed(g)
        return out


def _written_args(func, args, kwargs) -> list[ShardedGradient]:
    """The placeholders ``func`` writes (``Tensor(a!)`` arguments, lists of them included)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, ShardedGradient):
                out.append(t)
    return out

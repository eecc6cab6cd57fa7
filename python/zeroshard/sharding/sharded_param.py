"""ShardedParameter: what a ZeRO-3 module holds in a parameter's place while the parameter's unit is not gathered.

FSDP2 swaps a module's registered parameters between sharded ``DTensor``s and unsharded tensors around each use; we
do the same with this placeholder: a tensor subclass with the parameter's shape, dtype, device and
``requires_grad`` and no memory (``torch.Tensor._make_wrapper_subclass``), registered in every module slot of the
parameter while its unit is freed. The real ``nn.Parameter`` (a view into the unit's flat buffer) is put back when the
unit is gathered, so forward, backward and ``torch.compile`` only ever see ordinary tensors, and names, ``state_dict()``
keys, shapes and ties stay as they were.

Anything that touches a placeholder's values goes through ``__torch_dispatch__`` to its owner (the stage-3 runtime):

* whole-tensor writes (``p.copy_(x)``, ``p.data.copy_(x)``, ``p.data = x``, ``load_state_dict``) land in this
  rank's shard and fp32 master: each rank copies its own slice of ``x``, no communication;
* reads gather the parameter's unit on demand, a collective: every rank must make the same reads (Lightning's
  callbacks, e.g. ``WeightAveraging``, run on every rank); the unit stays gathered until another unit is read this way
  or the next step begins, and writes made to it meanwhile are written back to the shard;
* a read inside backward, or one that would need autograd through the placeholder, is an error naming the parameter
  (it would otherwise compute on values no rank holds);
* ``repr()`` never reads values, so printing a model or a parameter on one rank is safe.

Results of view operations are copies (a view of a gathered buffer would dangle once the unit is freed).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
_DATA_SET = torch._C.TensorBase.data.__set__


class ParamAccess(Protocol):
    """The runtime's side of a placeholder (implemented by :class:`zeroshard.sharding.sharded_units.ShardedUnits`)."""

    def resolve(self, placeholders: list[ShardedParameter], reason: str | None = None) -> list[torch.Tensor]:
        """Whole values for ``placeholders`` (gathering their units as needed), in order; ``reason`` names what the
        read is for in errors."""

    def write(self, placeholder: ShardedParameter, src: torch.Tensor) -> None:
        """``placeholder.copy_(src)``: into the gathered parameter, or this rank's shard slice."""

    def mark_written(self, placeholders: list[ShardedParameter]) -> None:
        """An in-place op changed the gathered values of ``placeholders``: write them back when freed."""

    def describe(self, placeholder: ShardedParameter) -> str:
        """The parameter's name and unit, for messages."""


class ShardedParameter(torch.Tensor):
    """Stand-in for parameter ``index`` of flat parameter ``flat`` while its unit is freed (see the module doc).

    Attributes:
        flat: the :class:`~zeroshard.sharding.flat_param.FlatParam` holding the parameter.
        index: the parameter's position in ``flat.params``.
        access: the :class:`ParamAccess` that serves reads and writes.
    """

    flat: object
    index: int
    access: ParamAccess

    @staticmethod
    def __new__(cls, flat, index: int, access: ParamAccess, *, is_param: bool = True) -> ShardedParameter:
        shape = flat.shapes[index]
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=_contiguous(shape),
            dtype=flat.dtype,
            device=flat.device,
            requires_grad=is_param and flat.params[index].requires_grad,
        )
        t.flat, t.index, t.access = flat, index, access
        if is_param:
            t._is_param = True  # isinstance(t, nn.Parameter), as nn.Parameter() marks tensor subclasses
        return t

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"ShardedParameter({self.access.describe(self)}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}: sharded by ZeRO stage 3; read it inside zeroshard.gathered_parameters(model))"
        )

    def __deepcopy__(self, memo):
        # a deep copy holds whole values (a collective gather of the unit, on every rank)
        with torch.no_grad():  # a copy reads values only: no autograd through the placeholder
            value = self.access.resolve([self], reason="a copy or pickle (deepcopy, torch.save)")[0].detach().clone()
        out = (
            torch.nn.Parameter(value, requires_grad=self.requires_grad) if getattr(self, "_is_param", False) else value
        )
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        return self.__deepcopy__({}).__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func == _DATA_SET and isinstance(args[0], ShardedParameter):  # p.data = x: a whole-tensor write
            dst, src = args
            if tuple(src.shape) != tuple(dst.shape):
                raise RuntimeError(
                    f"zeroshard: cannot give {dst.access.describe(dst)} (shape {list(dst.shape)}) data of shape "
                    f"{list(src.shape)}: a sharded parameter keeps its shape; change the model before the strategy "
                    "shards it"
                )
            with torch.no_grad():
                dst.copy_(src)
            return None
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            ph = args[0]
            return ShardedParameter(ph.flat, ph.index, ph.access, is_param=False)
        if func is aten.copy_.default and isinstance(args[0], ShardedParameter):
            dst, src = args[0], args[1]
            if isinstance(src, ShardedParameter):
                src = src.access.resolve([src])[0]
            dst.access.write(dst, src)
            return dst
        flat, _ = tree_flatten((args, kwargs))
        placeholders = [a for a in flat if isinstance(a, ShardedParameter)]
        access = placeholders[0].access
        values = dict(zip(map(id, placeholders), access.resolve(placeholders)))
        real_args, real_kwargs = tree_map(lambda a: values.get(id(a), a), (args, kwargs))
        out = func(*real_args, **real_kwargs)
        if func._schema.is_mutable:
            access.mark_written(placeholders)
        if func.is_view:
            out = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
        return out


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def real_parameter(t: torch.Tensor) -> torch.Tensor:
    """The parameter a placeholder stands for (``t`` itself for anything else): for code that matches a module's
    ``state_dict(keep_vars=True)`` or ``named_parameters()`` against flat parameters by identity."""
    return t.flat.params[t.index] if isinstance(t, ShardedParameter) else t

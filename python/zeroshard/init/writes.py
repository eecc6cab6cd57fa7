"""Which torch calls write into a tensor, and which of those overwrite it whole without reading it.

Shared by the recorder of :func:`zeroshard.meta_init.init_meta_context` (:mod:`zeroshard.init.ctor_draws`) and the dry
run of :mod:`zeroshard.init.init_plan`: both must agree on what counts as an initialisation of a meta tensor.
"""

from __future__ import annotations

import torch
from torch import nn

_INIT_NAMES = (
    "normal_", "uniform_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip
NN_INIT = frozenset(getattr(nn.init, n) for n in _INIT_NAMES if hasattr(nn.init, n))

# in-place initialisers that consume random numbers (a draw on meta consumes nothing, so these must be replayed)
RANDOM_INITIALIZERS = frozenset(
    [getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "bernoulli_", "exponential_", "random_", "cauchy_",
                                        "log_normal_", "geometric_")]
    + [getattr(nn.init, n) for n in ("normal_", "uniform_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
                                     "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
       if hasattr(nn.init, n)]
)  # fmt: skip

# initialisers that write every element and read none: the whole tensor's value is theirs alone
OVERWRITE_INITIALIZERS = RANDOM_INITIALIZERS | NN_INIT | frozenset(getattr(torch.Tensor, n) for n in ("fill_", "zero_"))

# factories that consume random numbers; on meta they allocate nothing and draw nothing
RANDOM_FACTORIES = frozenset(
    getattr(torch, n)
    for n in ("randn", "rand", "randint", "randperm", "normal", "randn_like", "rand_like", "randint_like", "bernoulli",
              "multinomial", "poisson")
)  # fmt: skip

# factories whose values follow from their arguments alone (replayed like the random ones, without a draw)
VALUE_FACTORIES = frozenset(
    getattr(torch, n)
    for n in ("zeros", "ones", "full", "eye", "arange", "linspace", "logspace", "tensor")
)  # fmt: skip

NOT_WRITES = frozenset(("requires_grad_", "share_memory_", "retain_grad", "resize_", "record_stream"))
DATA_SET = torch._C.TensorBase.data.__set__
DATA_GET = torch._C.TensorBase.data.__get__


def write_target(func, args, kwargs) -> torch.Tensor | None:
    """The tensor ``func(*args, **kwargs)`` writes into, if any (in-place methods, ``nn.init``, ``out=``)."""
    if func in NN_INIT:
        t = args[0] if args else kwargs.get("tensor")
        return t if isinstance(t, torch.Tensor) else None
    name = getattr(func, "__name__", "")
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is not None:
        if name == "__setitem__" or func == DATA_SET:
            return first
        if name.endswith("_") and not name.endswith("__") and name not in NOT_WRITES:
            return first
    out = kwargs.get("out")
    return out if isinstance(out, torch.Tensor) else None


def holds_tensor(value) -> bool:
    """True if ``value`` is or contains (in a tuple, list or dict) a tensor: a write that reads other tensors."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    return False

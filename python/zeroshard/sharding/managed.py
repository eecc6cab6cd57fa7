"""Which module a ZeRO engine manages: a registry beside the module rather than an attribute on it.

Pickling or deep-copying a module (a callback that sends it to another process, such as Lightning's
``ServableModuleValidator``; an EMA copy) must not carry the engine and its process groups along, just as a module
trained under DDP pickles without its ``DistributedDataParallel`` wrapper. The registry holds the module weakly: it
never keeps a model alive.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

_ENGINES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def register_engine(module: nn.Module, engine: Any) -> None:
    """Records ``engine`` (a :class:`~zeroshard.engine.engine.ZeroEngine`) as the manager of ``module``."""
    _ENGINES[module] = engine


def engine_of(module: nn.Module) -> Any:
    """The :class:`~zeroshard.engine.engine.ZeroEngine` built on ``module`` (the latest one), or ``None``: for
    ``module`` itself only, not its submodules or copies."""
    return _ENGINES.get(module)

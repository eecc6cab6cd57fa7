"""RuntimeHook: a module hook of zeroshard's runtime that does not travel with copies of the module.

Stage 3 puts gather/free hooks on modules (as FSDP2 does). A copy of such a module, ``copy.deepcopy`` (an EMA copy) or
pickle (a callback sending it to another process), holds its parameters whole (a placeholder's copy gathers it), so it
is a plain module: its hooks must not call into the original's runtime, and pickling must not try to serialise that
runtime (process groups). A copied :class:`RuntimeHook` is a hook that does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class RuntimeHook:
    """Calls ``fn``; copies and unpickled copies are :class:`NoHook`. While a profiler records, the call is the
    range ``label`` (as FSDP2's ``FSDP::pre_forward``); otherwise no ``record_function`` is entered (it costs
    microseconds per call even when nothing records)."""

    __slots__ = ("fn", "label")

    def __init__(self, fn: Callable[..., Any], label: str = "zeroshard::hook") -> None:
        self.fn = fn
        self.label = label

    @torch.compiler.disable  # as the hooks themselves: a compiled block breaks its graph around them, never inside
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(self.label):
                return self.fn(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return (NoHook, ())

    def __deepcopy__(self, memo) -> NoHook:
        return NoHook()


class NoHook:
    """A forward (pre-)hook that changes nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

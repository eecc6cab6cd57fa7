"""The default process group's lifetime when a zeroshard strategy created it.

A process that exits with a gloo process group still alive can abort at interpreter shutdown ("terminate called
without an active exception", exit -6): gloo's worker threads still hold finished work objects whose tensors are
freed after Python is gone (pytorch/pytorch#190489; the atexit fix proposed upstream in pytorch/pytorch#179291 was not
merged). torch asks every script to call ``torch.distributed.destroy_process_group()`` at the end; Lightning's
strategies leave the group alive so that code after ``fit`` can still use it. Both strategies here keep that, and
destroy the group from an ``atexit`` handler, while the interpreter is still whole, when they were the ones to create
it. A group the user created stays theirs to destroy.

Destroying the group does not stop gloo's worker threads (``ProcessGroupGloo`` has no shutdown; its threads end with
its destructor, and the engine's collectives still hold the group). A worker that has just finished a collective
still has to drop that work's tensors, which needs the GIL when Python created them (``all_gather_object`` after
``fit``, for one). If the interpreter is finalizing by then, the worker is unwound through a ``noexcept`` destructor:
the same abort, seen in about one run in four of ``test_fp16_overflow_*`` (core dump: ``~AsyncAllgatherWork`` ->
``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``). So the handler also releases the GIL for a moment
(:data:`GLOO_DRAIN_SECONDS`) while the interpreter is whole, for those workers to finish.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable

import torch.distributed as dist

_registered = False
GLOO_DRAIN_SECONDS = 0.1  # at exit, with the GIL released: for gloo workers to drop their last work's tensors


def init_and_destroy_at_exit(init: Callable[[], None]) -> None:
    """Runs ``init`` (a strategy's own process-group set-up); if that created the default group, registers one
    ``atexit`` handler that destroys it (once per process, however many strategies run)."""
    global _registered
    existed = dist.is_available() and dist.is_initialized()
    init()
    if existed or _registered or not (dist.is_available() and dist.is_initialized()):
        return
    _registered = True
    atexit.register(_destroy)


def _destroy() -> None:
    if not dist.is_initialized():
        return
    gloo = dist.get_backend() == "gloo"
    dist.destroy_process_group()
    if gloo:
        time.sleep(GLOO_DRAIN_SECONDS)

"""The default process group's lifetime when a zeroshard strategy created it.

A process that exits with a gloo process group still alive can abort at interpreter shutdown ("terminate called
without an active exception", exit -6): gloo's worker threads still hold finished work objects whose tensors are
freed after Python is gone (pytorch/pytorch#190489; the atexit fix proposed upstream in pytorch/pytorch#179291 was not
merged). torch asks every script to call ``torch.distributed.destroy_process_group()`` at the end; Lightning's
strategies leave the group alive so that code after ``fit`` can still use it. Both strategies here keep that, and
destroy the group from an ``atexit`` handler, while the interpreter is still whole, when they were the ones to create
it. A group the user created stays theirs to destroy.

Destroying the group does not stop gloo's worker threads (``ProcessGroupGloo`` has no shutdown; its threads end with
its destructor, and the engine's collectives still hold the group). Those workers get a pause at exit from
:mod:`zeroshard.sharding.gloo_exit`, registered before this handler so that it runs after it (``atexit`` is last in,
first out), and also when the script destroyed the group itself.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable

import torch.distributed as dist

from zeroshard.sharding.gloo_exit import drain_gloo_workers_at_exit

_registered = False


def init_and_destroy_at_exit(init: Callable[[], None]) -> None:
    """Runs ``init`` (a strategy's own process-group set-up); if that created the default group, registers one
    ``atexit`` handler that destroys it (once per process, however many strategies run)."""
    global _registered
    existed = dist.is_available() and dist.is_initialized()
    init()
    if existed or _registered or not (dist.is_available() and dist.is_initialized()):
        return
    _registered = True
    drain_gloo_workers_at_exit()  # first registered, so it runs after _destroy
    atexit.register(_destroy)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

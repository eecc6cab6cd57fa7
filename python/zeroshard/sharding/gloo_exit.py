"""A pause at interpreter exit for gloo's worker threads, whoever destroys the process group.

A gloo worker that has just finished a collective still has to drop that work's tensors, which needs the GIL when
Python created them. If the interpreter is finalizing by then, the worker is unwound through a ``noexcept``
destructor and the process aborts ("terminate called without an active exception", exit -6; core dump:
``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``; pytorch/pytorch#190489).
``ProcessGroupGloo`` has no shutdown that joins its threads, so the only remedy from Python is to release the GIL for a
moment at exit, while the interpreter is still whole. This holds whether the strategy's ``atexit`` handler destroyed
the group or the script called ``torch.distributed.destroy_process_group()`` itself (the case CI hit in
``ckpt_sharded.py``, where no pause ran).
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

GLOO_DRAIN_SECONDS = 0.1  # at exit, with the GIL released: for gloo workers to drop their last work's tensors

_registered = False


def drain_gloo_workers_at_exit(group: dist.ProcessGroup | None = None) -> None:
    """Registers, once per process, an ``atexit`` pause of :data:`GLOO_DRAIN_SECONDS` seconds if ``group`` (default:
    the world group, which must be initialised) runs on gloo; other backends register nothing."""
    global _registered
    if _registered or dist.get_backend(group) != "gloo":
        return
    _registered = True
    atexit.register(time.sleep, GLOO_DRAIN_SECONDS)

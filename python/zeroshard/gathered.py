"""gathered_parameters: whole parameters outside a training step (generation, inspection, export)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def gathered_parameters(module: nn.Module) -> Iterator[nn.Module]:
    """Makes every parameter of ``module`` whole on this rank for the duration; reshards on exit.

    At ZeRO stage 3 this all-gathers every unit (a collective: call it on every rank) and needs the whole model's
    parameters in device memory; at stages 1-2, or for a module zeroshard does not manage, it does nothing. The same
    role as DeepSpeed's ``GatheredParameters`` and FSDP's ``summon_full_params``. Writes to the parameters inside the
    context are not kept: the shards are the source of truth.

    Args:
        module: a module (or the LightningModule) a :class:`~zeroshard.ZeroEngine` was built over.

    Yields:
        ``module``.
    """
    engine = getattr(module, "_zeroshard_engine", None)
    if engine is None:
        yield module
        return
    with engine.gathered():
        yield module

"""gathered_parameters: whole parameters outside a training step (generation, inspection, export, editing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from zeroshard.sharding.managed import engine_of


@contextmanager
def gathered_parameters(module: nn.Module, writeback: bool = True) -> Iterator[nn.Module]:
    """Makes every parameter of ``module`` whole on this rank for the duration; reshards on exit.

    At ZeRO stage 3 this all-gathers every unit (a collective: call it on every rank) and needs the whole model's
    parameters in device memory; at stages 1-2, or for a module zeroshard does not manage, it does nothing. The same
    role as DeepSpeed's ``GatheredParameters`` and FSDP's ``summon_full_params`` (whose ``writeback`` default this
    follows).

    Leaving the block is safe whatever was done with the parameters inside it: a NumPy array made with ``.numpy()``
    keeps the memory it views (with the values of the moment), the parameters go back to their shards.

    Args:
        module: a module (or the LightningModule) a :class:`~zeroshard.ZeroEngine` was built over.
        writeback: keep what this rank wrote into the parameters inside the block: on exit each rank copies its own
            slice of every parameter into its shard, and the elements that changed into the fp32 master weights (one
            comparison pass over the shards). ``False`` discards the writes (the shards are untouched).

    Yields:
        ``module``.
    """
    engine = engine_of(module)
    if engine is None:
        yield module
        return
    with engine.gathered(writeback=writeback):
        yield module

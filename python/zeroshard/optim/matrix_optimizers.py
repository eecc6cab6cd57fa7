"""Element-wise optimizers and optimizers that need each parameter whole (matrix optimizers).

ZeRO hands a torch optimizer 1-D master shards that cut parameters anywhere. That is exact for element-wise optimizers
(Adam, AdamW, SGD, Lion: every state tensor has the shard's shape and each element's update reads only that element),
and wrong for an optimizer whose update mixes the elements of a matrix: Muon orthogonalises each 2-D momentum matrix
by Newton-Schulz iterations, Shampoo and SOAP precondition it by its row and column statistics. Given a shard, Muon
either fails (torch's asserts 2-D) or, reshaped, orthogonalises the wrong matrix (what FSDP2 users hit:
KellerJordan/Muon issue 45).

``torch.optim.Muon`` is recognised by class; any other optimizer declares itself a matrix optimizer with the class
attribute ``zeroshard_whole_matrix = True`` (:data:`WHOLE_MATRIX_ATTR`). Muon steps through
:class:`~zeroshard.optim.sharded_muon.ShardedMuon` (each matrix's Newton-Schulz on one owner rank); another matrix
optimizer has no sharded path yet and is refused before anything is sharded, as are the settings Muon's path lacks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer

WHOLE_MATRIX_ATTR = "zeroshard_whole_matrix"


def needs_whole_matrices(optimizer: Optimizer) -> bool:
    """True for ``torch.optim.Muon`` (and subclasses) and for a class with ``zeroshard_whole_matrix = True``."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's / Fabric's wrappers
    return isinstance(optimizer, torch.optim.Muon) or bool(getattr(type(optimizer), WHOLE_MATRIX_ATTR, False))


def check_matrix_optimizers(optimizers: Sequence[Optimizer], *, stage: int, offload_optimizer: bool) -> None:
    """Refuses, before anything is sharded, a matrix optimizer zeroshard cannot step exactly.

    Raises:
        ValueError: naming the optimizer, the stage and the fix: a marked matrix optimizer other than
            ``torch.optim.Muon`` (no whole-matrix path yet); Muon with ``offload_optimizer=True`` (its momentum would
            live on the host and the owner's Newton-Schulz would run there, on the CPU cores the fused Adam needs).
            (``overlap_step``, which steps buckets during backward, needs offload, so it is refused with it.)
    """
    for oi, opt in enumerate(optimizers):
        if not needs_whole_matrices(opt):
            continue
        name = type(getattr(opt, "_optimizer", opt)).__name__
        where = f"optimizer {oi} ({name}) at ZeRO stage {stage}"
        if not isinstance(getattr(opt, "_optimizer", opt), torch.optim.Muon):
            raise ValueError(
                f"zeroshard: {where} declares {WHOLE_MATRIX_ATTR} = True, so it needs each parameter whole, and "
                "zeroshard has a whole-matrix path for torch.optim.Muon only; it would otherwise receive 1-D flat "
                "shards. Use torch.optim.Muon, or train it without sharding (Lightning's 'ddp')."
            )
        if offload_optimizer:
            raise ValueError(
                f"zeroshard: {where} with offload_optimizer=True is not supported: Muon's Newton-Schulz needs each "
                "matrix whole on its owner rank's device, and offload steps host shards. Set offload_optimizer=False "
                "(Muon keeps one momentum element per parameter element, sharded, like SGD's momentum), or use AdamW."
            )

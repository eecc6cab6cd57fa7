"""The always-on check that every rank all-gathers the same stage-3 unit: a tag carried inside each unit all-gather.

Ranks that take different code paths in forward (``if rank == 1: skip a block``) reach different units at the same
all-gather. When those units have the same size (transformer blocks usually do) the collective succeeds and every rank
goes on with a buffer whose slices come from different units: training on parameters mixed across blocks, silently
(neither DeepSpeed nor FSDP catches it: their issues #7170 and #158719). Here each unit all-gather carries
:data:`TAG_ELEMS` extra elements per rank, holding the unit's index and whether the gather is for forward or backward,
inside the unit's own all-gather: one ``BucketedCollectives.all_gather`` call, one bucket, one collective, in which
every rank's row is its shards of the unit's flat parameters followed by its tag. Every rank compares all ranks' tags
when the handle's wait returns, before the buffer is used; a mismatch raises
:class:`~zeroshard.sharding.collective_errors.DivergedRanksError` on every rank, naming each rank's unit. On CUDA the
tags are compared at the end of the step's backward (one host read per step, no synchronisation inside it), still before
the optimizer step.

Where the tag travels: a unit with several flat parameters (one per optimizer param group, one for frozen parameters)
already gathers through a staging row per rank (copy-in of the shards, copy-out into the full buffers, as FSDP2's
all-gather), and the tag adds 4 elements to it. A unit of one flat parameter takes that staging path for the tag: a
copy of the unit per gather, instead of a second, latency-bound collective (which it was until issue 22). Each rank's
tag cannot sit in its shard's padding without that copy: a flat parameter is padded at its end only (the last rank's
shard), and parameters straddle shard boundaries, so a slot in every rank's shard would cut a parameter's contiguous
view, or pad every shard up to the largest parameter.

Encoding: the index as three base-256 digits and a phase code (1 forward, 3 backward), each an integer in [0, 255],
exact in every float dtype (bfloat16 holds integers up to 256 exactly, float16 up to 2048): up to 2**24 units.

Unit all-gathers run on a process group of their own (:func:`dedicated_group`), so the sequence of all-gathers a rank
issues is only ever matched with other ranks' all-gathers, never with a gradient reduce-scatter that another rank
reached first: the reduce-scatters follow the fixed bucket order on every rank (the reducer launches the buckets in
order, zeros for unused ones), and the all-gathers carry the tags. That removes the mismatch of an all-gather with a
reduce-scatter of another size (gloo aborts the process on those: ``op.preamble.length <= op.nbytes``) that one rank's
extra or missing unit otherwise causes: such ranks now wait in different collectives until the timeout, each naming
its own (:class:`~zeroshard.sharding.collective_errors.CollectiveError`). Two units of different sizes meeting at one
all-gather (a block against the root unit) still make the backend fail before any tag arrives;
``check_gather_order=True`` names those too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TAG_ELEMS = 4

# Read when an engine is built. Only benchmarks/bench_gather_check.py turns it off, to measure what the check costs
# (its engines then gather without tags, on the shard group, as before the check existed).
ENABLED = True


def encode(index: int, backward: bool) -> list[int]:
    """The :data:`TAG_ELEMS` small integers for unit ``index`` gathered for forward or backward."""
    if not 0 <= index < 1 << 24:
        raise ValueError(f"unit index {index} does not fit the gather tag (at most 2**24 units)")
    return [index & 255, (index >> 8) & 255, (index >> 16) & 255, 3 if backward else 1]


def decode(row: list[float]) -> tuple[int, bool] | None:
    """``(index, backward)`` of one rank's tag, or None if the elements are not a tag (not integers in range)."""
    digits = [int(v) for v in row if float(v).is_integer() and 0 <= v <= 255]
    if len(digits) != TAG_ELEMS or digits[3] not in (1, 3):
        return None
    return digits[0] | digits[1] << 8 | digits[2] << 16, digits[3] == 3


def disagreement(tags: torch.Tensor) -> list[tuple[int, int, bool] | None] | None:
    """None if every rank's tag is the same; else each rank's decoded ``(rank, index, backward)`` (None where a
    rank's elements are not a tag).

    Args:
        tags: ``[world_size * TAG_ELEMS]`` gathered tags (any float dtype, any device; read on the host).
    """
    values = tags.tolist()  # one host read of a few elements: cheaper than comparing as tensors (1 us against 11)
    rows = [values[i : i + TAG_ELEMS] for i in range(0, len(values), TAG_ELEMS)]
    if all(row == rows[0] for row in rows):
        return None
    out = []
    for r, row in enumerate(rows):
        d = decode(row)
        out.append(None if d is None else (r, d[0], d[1]))
    return out


def dedicated_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new process group with the same ranks, backend and timeout as ``group``; collective over ``group``'s ranks
    (only they call it, ``use_local_synchronization``), which must create such groups in the same order."""
    ranks = dist.get_process_group_ranks(group)
    backend = dist.get_backend(group)
    timeout = None
    try:
        device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        pass  # a backend without options: the default timeout
    return dist.new_group(ranks, backend=backend, timeout=timeout, use_local_synchronization=True)

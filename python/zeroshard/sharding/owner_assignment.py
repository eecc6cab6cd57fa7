"""Which rank owns each whole matrix of a matrix optimizer (Muon), and where its pieces lie in the rank shards.

A matrix optimizer's update needs each 2-D parameter whole (Newton-Schulz is not element-wise), while ZeRO cuts every
flat parameter into equal 1-D shards that split matrices anywhere. Each matrix therefore gets one owner rank that runs
its Newton-Schulz; owners are chosen to balance those FLOPs, since they dominate the step (Muon's other work is
element-wise and stays on the shards).

Newton-Schulz FLOPs of an ``(n, m)`` matrix, ``a = min(n, m)``, ``b = max(n, m)``, per iteration (torch's
``_zeropower_via_newtonschulz``, which transposes so that ``a`` rows remain): ``X X^T`` 2 a^2 b, ``c G G + b G``
2 a^3, ``(...) X + a X`` 2 a^2 b; so ``steps * (4 a^2 b + 2 a^3)``, about ``n m min(n, m)`` up to a constant.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def ns_flops(shape: Sequence[int], steps: int = 5) -> int:
    """Floating-point operations of ``steps`` Newton-Schulz iterations on a matrix of ``shape`` (module docstring).

    Raises:
        ValueError: if ``shape`` is not 2-D.
    """
    if len(shape) != 2:
        raise ValueError(f"ns_flops: Newton-Schulz needs a 2-D matrix, got shape {tuple(shape)}")
    a, b = min(shape), max(shape)
    return steps * (4 * a * a * b + 2 * a**3)


def assign_owners(shapes: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """One owner rank per matrix, balancing Newton-Schulz FLOPs: longest-processing-time first (largest matrix to the
    least loaded rank; ties to the lower matrix index and the lower rank), so every rank computes the same answer
    from the same shapes with no communication. Its makespan is at most 4/3 of the optimum (Graham 1969).

    Returns:
        ``owners[i]`` in ``[0, world_size)`` for ``shapes[i]``.
    """
    if world_size < 1:
        raise ValueError(f"assign_owners: world_size={world_size}, need >= 1")
    load = [0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i]), i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += ns_flops(shapes[i])
    return owners


class Piece(NamedTuple):
    """The part of one parameter inside one rank's shard: elements ``[start, start + numel)`` of the flattened
    parameter sit at ``[shard_offset, shard_offset + numel)`` of that rank's shard."""

    start: int
    shard_offset: int
    numel: int


def pieces_by_rank(offset: int, numel: int, shard_numel: int, world_size: int) -> list[Piece | None]:
    """Where a parameter at ``[offset, offset + numel)`` of a flat buffer cut into ``world_size`` shards of
    ``shard_numel`` elements lies: one :class:`Piece` per rank (``None`` where its shard holds none of it)."""
    out: list[Piece | None] = []
    for r in range(world_size):
        lo, hi = max(offset, r * shard_numel), min(offset + numel, (r + 1) * shard_numel)
        out.append(Piece(lo - offset, lo - r * shard_numel, hi - lo) if hi > lo else None)
    return out

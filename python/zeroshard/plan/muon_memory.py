"""Device bytes a Muon step adds per rank (:class:`zeroshard.optim.sharded_muon.ShardedMuon`), for the planner.

Resident: Muon keeps one fp32 momentum element per parameter element, sharded like the master (4 bytes per element of
this rank's shard, where Adam keeps 8). Transient, during the optimizer step, on the rank that owns the most matrix
elements (owners by :func:`zeroshard.sharding.owner_assignment.assign_owners`):

* the bf16 Nesterov update of the shard and its concatenated send buffer: ``2 * 2 * shard``;
* the received pieces of its own matrices and the orthogonalised pieces it sends back: ``2 * 2 * owned`` (bf16);
* Newton-Schulz on one whole matrix at a time (torch's ``_zeropower_via_newtonschulz`` on an ``(n, m)`` matrix,
  ``a = min(n, m)``): the assembled input, its normalised copy, the iterate and the next iterate
  (``4 * 2 * n * m``) and the two ``a x a`` Gram matrices (``2 * 2 * a^2``), for the largest matrix it owns.
"""

from __future__ import annotations

from collections.abc import Sequence

from zeroshard.sharding.owner_assignment import assign_owners


def muon_step_bytes(shapes: Sequence[Sequence[int]], shard_group_size: int) -> dict[str, float]:
    """Bytes per rank for Muon over matrices of ``shapes`` sharded over ``shard_group_size`` ranks.

    Returns:
        ``{"momentum": resident fp32 momentum of this rank's shard, "step_temp": the transient peak of the step on the
        busiest owner}`` (module docstring). The Adam state those elements would have kept depends on the state format:
        :func:`zeroshard.plan.memory.muon_adam_state_bytes`.
    """
    k = shard_group_size
    numels = [int(s[0]) * int(s[1]) for s in shapes]
    shard = -(-sum(numels) // k) if numels else 0
    owners = assign_owners([tuple(s) for s in shapes], k)
    step_temp = 0.0
    for r in range(k):
        mine = [i for i, o in enumerate(owners) if o == r]
        owned = sum(numels[i] for i in mine)
        ns = max((8 * numels[i] + 4 * min(shapes[i]) ** 2 for i in mine), default=0)
        step_temp = max(step_temp, 4.0 * shard + 4.0 * owned + ns)
    return {"momentum": 4.0 * shard, "step_temp": step_temp}

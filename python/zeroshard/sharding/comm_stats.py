"""Communication volume: what the engine's collectives sent, and what ZeRO theory says they should send.

Every bucketed collective is counted in C++ (``_C.CommStats``, one per process group): calls, full-buffer bytes, the
bytes this rank sends in a ring (all-gather and reduce-scatter F (N-1)/N, all-reduce 2 F (N-1)/N for a full buffer of F
bytes over N ranks) and, on gloo, the bytes really put on the wire (gloo's reduce-scatter is an all-reduce, twice the
bytes). A step is everything between two ``engine.after_step()`` calls. The whole-matrix exchange of a matrix optimizer
(:mod:`zeroshard.sharding.matrix_exchange`) is counted in Python as ``all_to_all``, in a group of its own (``matrix``).

Theory (Rajbhandari et al. 2020, "ZeRO", section 7, with Psi the bytes of the parameters in the dtype each collective
carries and N the ranks sharing a shard): DDP and stages 1-2 send 2 Psi (N-1)/N per rank and step (a reduce-scatter of
the gradients plus an all-gather of the parameters), stage 3 3 Psi (N-1)/N (the parameters are gathered for forward and
again for backward). Hybrid sharding (shard groups of k ranks, R = world / k replicas) adds the all-reduce of each
rank's gradient shard across the replicas, 2 (Psi / k) (R-1)/R.
"""

from __future__ import annotations

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")  # all_to_all: whole matrices (Muon)
FIELDS = ("calls", "tensor_bytes", "bytes", "wire_bytes")


_ZERO = {"calls": 0, "tensor_bytes": 0, "bytes": 0, "wire_bytes": 0}


def _add(a: dict, b: dict) -> dict:
    out = {}
    for kind in KINDS:
        x, y = a.get(kind, _ZERO), b.get(kind, _ZERO)  # a process group's counters name only the kinds it runs
        row = {f: x[f] + y[f] for f in FIELDS if f != "wire_bytes"}
        wx, wy = x["wire_bytes"], y["wire_bytes"]
        row["wire_bytes"] = None if wx is None or wy is None else wx + wy
        out[kind] = row
    return out


def empty_counters() -> dict:
    return {kind: {"calls": 0, "tensor_bytes": 0, "bytes": 0, "wire_bytes": 0} for kind in KINDS}


def summarize(groups: dict) -> dict:
    """The counts of several ``_C.CommStats`` (``{"shard": stats, "replicate": stats}``) as one dict.

    Returns:
        ``{"steps", "last_step", "current", "total", "groups"}``: the three count sets are ``{kind: {"calls",
        "tensor_bytes", "bytes", "wire_bytes"}}`` summed over the groups (``wire_bytes`` None unless every group's
        backend is known); ``groups[name]`` holds the same per group plus its ``backend`` and ``world_size``. Bytes
        are per rank.
    """
    out = {"steps": 0, "last_step": empty_counters(), "current": empty_counters(), "total": empty_counters()}
    per_group = {}
    for name, stats in groups.items():
        g = {
            "backend": stats.backend,
            "world_size": stats.world_size,
            "steps": stats.steps,
            "last_step": stats.last_step(),
            "current": stats.current(),
            "total": stats.total(),
        }
        per_group[name] = g
        out["steps"] = max(out["steps"], g["steps"])
        for key in ("last_step", "current", "total"):
            out[key] = _add(out[key], g[key])
    out["groups"] = per_group
    return out


def sent_bytes(counters: dict, field: str = "bytes") -> int | None:
    """Bytes over every kind of one count set (``field``: ``bytes``, ``wire_bytes`` or ``tensor_bytes``)."""
    values = [counters[k][field] for k in KINDS]
    return None if any(v is None for v in values) else sum(values)


def theory_bytes(stage: int | str, psi_bytes: float, shard_size: int, replicas: int = 1) -> float:
    """ZeRO's bytes per rank and step (see the module docstring).

    Args:
        stage: ``"ddp"``, 1, 2 or 3.
        psi_bytes: parameter elements times the bytes of the dtype the collectives carry (padded or not, as wanted).
        shard_size: ranks in a shard group (the world size without hybrid sharding; DDP: the world size).
        replicas: shard groups (hybrid sharding); their all-reduce carries one shard, ``psi_bytes / shard_size``.

    Raises:
        ValueError: for another ``stage``.
    """
    if stage not in ("ddp", 1, 2, 3):
        raise ValueError(f"theory_bytes(stage={stage!r}): use 'ddp', 1, 2 or 3")
    n, r = shard_size, replicas
    passes = 3 if stage == 3 else 2
    inner = passes * psi_bytes * (n - 1) / n
    cross = 2 * (psi_bytes / n) * (r - 1) / r
    return inner + cross

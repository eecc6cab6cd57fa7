"""The all-to-all that moves pieces of whole matrices between the shard holders and each matrix's owner, counted.

Every rank sends rank ``d`` one 1-D buffer (the pieces of rank ``d``'s matrices that lie in its shard, or the pieces of
its own matrices that lie in rank ``d``'s shard on the way back) and knows from the shared plan how much it receives.
A piece a rank sends to itself never crosses the wire and is not counted.

Counted per rank and call, as ``all_to_all`` in the counters of :mod:`zeroshard.sharding.comm_stats`: ``tensor_bytes``
the whole input buffer (own pieces included), ``bytes`` what goes to other ranks; ``wire_bytes`` equals ``bytes``
(gloo's and NCCL's all-to-all send each piece once, point to point, with no ring).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

_FIELDS = ("calls", "tensor_bytes", "bytes", "wire_bytes")


def _empty() -> dict:
    return {"all_to_all": dict.fromkeys(_FIELDS, 0)}


class AllToAllStats:
    """Counters of one process group's all-to-all calls in the form of ``_C.CommStats`` (read by
    :func:`zeroshard.sharding.comm_stats.summarize`): ``current`` (the open step), ``last_step``, ``total``."""

    def __init__(self, backend: str, world_size: int) -> None:
        self.backend = backend
        self.world_size = world_size
        self.steps = 0
        self._current, self._last, self._total = _empty(), _empty(), _empty()

    def add(self, tensor_bytes: int, sent_bytes: int) -> None:
        for counters in (self._current, self._total):
            row = counters["all_to_all"]
            row["calls"] += 1
            row["tensor_bytes"] += tensor_bytes
            row["bytes"] += sent_bytes
            row["wire_bytes"] += sent_bytes

    def end_step(self) -> None:
        self._last, self._current = self._current, _empty()
        self.steps += 1

    def current(self) -> dict:
        return copy.deepcopy(self._current)

    def last_step(self) -> dict:
        return copy.deepcopy(self._last)

    def total(self) -> dict:
        return copy.deepcopy(self._total)


@torch.no_grad()
def all_to_all_pieces(
    send: list[torch.Tensor],
    recv_numels: list[int],
    group: dist.ProcessGroup | None,
    stats: AllToAllStats | None = None,
) -> list[torch.Tensor]:
    """Sends ``send[d]`` to rank ``d`` and returns what each rank sent this one.

    Args:
        send: one 1-D tensor per rank of ``group`` (empty where nothing goes), one dtype, on the backend's device.
        recv_numels: elements this rank receives from each rank (known from the shared plan).
        group: the process group (the shard group).
        stats: where the call is counted (module docstring).

    Returns:
        One 1-D tensor per source rank, views of one receive buffer, in ``send``'s dtype.
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    dtype = send[0].dtype
    device = send[0].device
    inp = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(recv_numels), dtype=dtype, device=device)
    if world > 1:
        # gloo's all-to-all takes neither bfloat16 nor int16: move the bits as bytes (a copy, exact)
        k = inp.element_size() if dtype == torch.bfloat16 and dist.get_backend(group) == "gloo" else 1
        wire = torch.uint8 if k > 1 else dtype
        dist.all_to_all_single(
            out.view(wire),
            inp.view(wire),
            [k * int(n) for n in recv_numels],
            [k * t.numel() for t in send],
            group=group,
        )
    else:
        out.copy_(inp)
    if stats is not None:
        size = inp.element_size()
        stats.add(inp.numel() * size, sum(t.numel() for d, t in enumerate(send) if d != me) * size)
    return list(out.split([int(n) for n in recv_numels]))

"""FlatParam: one bucket's parameters packed into a padded 1-D buffer, cut into one equal shard per rank.

The layout (offsets, padding, shard ranges) is computed by the C++ core (``zeroshard._C.FlatParamLayout``). This class
owns
the buffers that follow that layout: the full compute-dtype buffer the module's parameters view, the fp32 master shard
the
optimizer steps, and the gradient buffers. It matches FSDP1's ``FlatParameter`` with ``use_orig_params=True``: the
original ``nn.Parameter`` objects stay in the module (so names, tied weights and ``self.parameters()`` keep working) and
their ``.data`` becomes a view into the flat buffer.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroshard import _C


class FlatParam:
    """Parameters of one bucket, flattened.

    Args:
        names: fully qualified parameter names, in flat order.
        params: the parameters (any shapes, one dtype, one device). Their ``.data`` is replaced by views into
            :attr:`full`, so values are kept.
        rank, world_size: this rank and the number of shards.
        align_elems: alignment of every parameter offset and of the shard size, in elements.
        master_device: where the fp32 master shard lives (the parameters' device, or ``cpu`` for offload).
        pin_memory: allocate host-side shards in page-locked memory (CUDA runs with offload).

    Attributes:
        layout: ``_C.FlatParamLayout``; ``layout.padded_numel == world_size * layout.shard_numel``.
        full: 1-D tensor, ``layout.padded_numel`` elements, the parameters' dtype and device; parameters view it.
        shard: 1-D view of this rank's ``layout.shard_numel`` elements of :attr:`full`.
        master: ``nn.Parameter``, fp32, ``layout.shard_numel`` elements, on ``master_device``. Aliases :attr:`shard`
        when
            the parameters are fp32 and on ``master_device`` (no extra memory, as in FSDP2's sharded parameter).
        grad_shard: fp32 gradient shard (``layout.shard_numel``), filled by the reducer after each synchronised
        backward.
        full_grad: full-size gradient accumulation buffer (allocated on first use, freed after its reduce-scatter at
            stage 2, kept at stage 1).
    """

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        *,
        rank: int,
        world_size: int,
        align_elems: int,
        master_device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        if not params:
            raise ValueError("FlatParam needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"parameters of one bucket must share dtype and device, found dtypes {sorted(map(str, dtypes))} and "
                f"devices {sorted(map(str, devices))} in {names}"
            )
        self.names = names
        self.params = params
        self.rank = rank
        self.world_size = world_size
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.layout = _C.FlatParamLayout([list(p.shape) for p in params], world_size, align_elems)
        with torch.no_grad():
            self.full = self.layout.flatten([p.detach() for p in params], self.dtype, self.device)
            for p, view in zip(params, self.layout.views(self.full)):
                p.data = view
        begin, end = self.layout.shard_range(rank)
        self.shard = self.full[begin:end]

        self.master_device = torch.device(master_device)
        aliases = self.dtype == torch.float32 and self.device == self.master_device
        if aliases:
            master = self.shard
        else:
            master = torch.empty(end - begin, dtype=torch.float32, device=self.master_device, pin_memory=pin_memory)
            master.copy_(self.shard)
        self.master_aliases_shard = aliases
        self.master = nn.Parameter(master, requires_grad=True)
        self.grad_shard = torch.zeros(end - begin, dtype=torch.float32, device=self.device)
        self.full_grad: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        """Elements of the parameters, without padding."""
        return sum(p.numel() for p in self.params)

    def full_grad_views(self) -> list[torch.Tensor]:
        """Per-parameter views of :attr:`full_grad`, allocating it (zeros) on first use."""
        if self.full_grad is None:
            self.full_grad = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
            self._grad_views = self.layout.views(self.full_grad)
        return self._grad_views

    def free_full_grad(self) -> None:
        self.full_grad = None
        self._grad_views = None

    @torch.no_grad()
    def load_master_into_shard(self) -> None:
        """Writes the updated master shard into this rank's slice of :attr:`full` (cast to the parameter dtype)."""
        if not self.master_aliases_shard:
            self.shard.copy_(self.master.detach(), non_blocking=True)

    @torch.no_grad()
    def load_shard_into_master(self) -> None:
        """Refreshes the master shard from :attr:`full` (after the parameters were loaded from a checkpoint)."""
        if not self.master_aliases_shard:
            self.master.detach().copy_(self.shard)

    def __repr__(self) -> str:
        return (
            f"FlatParam({len(self.params)} params, {self.numel} elements, padded {self.layout.padded_numel}, "
            f"shard {self.layout.shard_numel}, {self.dtype}, {self.device})"
        )

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
        offload: optimizer offload: the master is an exact-size host buffer of its own (``_C.empty_host``), never an
            alias of :attr:`shard`, so CPU-only runs take the same upload path as CUDA runs; the gradient shard is
            kept in ``reduce_dtype`` (it is copied to the host as it is) and released after each copy.
        host_shard: parameter offload (stage 3): :attr:`shard` lives in host memory (pinned with ``pin_memory``) in
            the compute dtype; it is copied to the device just before each all-gather.
        keep_full: keep the full buffer allocated (stages 1-2); False frees it after construction (stage 3).
        trainable: False for frozen parameters: no master shard, no gradient buffers.
        compute_dtype: dtype of :attr:`full` (the parameters forward and backward see), e.g. ``torch.bfloat16``;
            default: the parameters' dtype. The master shard is always fp32, taken from the original values.
        reduce_dtype: dtype gradients are accumulated and reduced in; default: ``compute_dtype``.

    Attributes:
        layout: ``_C.FlatParamLayout``; ``layout.padded_numel == world_size * layout.shard_numel``.
        full: 1-D tensor, ``layout.padded_numel`` elements, the parameters' dtype and device; parameters view it.
            With ``keep_full=False`` (stage 3) its memory exists only between :meth:`alloc_full` and :meth:`free_full`.
        shard: this rank's ``layout.shard_numel`` elements: a view of :attr:`full` (stages 1-2) or a tensor of its own
            (stage 3; in host memory with ``host_shard``), the source of every all-gather.
        master: ``nn.Parameter`` (``None`` if not trainable), fp32, ``layout.shard_numel`` elements, on
            ``master_device``. Aliases :attr:`shard` when the parameters are fp32 and on ``master_device`` (no extra
            memory, as in FSDP2's sharded parameter).
        grad_shard: gradient shard (``layout.shard_numel``; fp32, or ``reduce_dtype`` with ``offload``), filled by the
            reducer after each synchronised backward.
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
        offload: bool = False,
        host_shard: bool = False,
        keep_full: bool = True,
        trainable: bool = True,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
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
        self.keep_full = keep_full
        self.trainable = trainable
        source_dtype = params[0].dtype
        self.dtype = compute_dtype or source_dtype
        self.grad_dtype = reduce_dtype or self.dtype
        self.grad_shard_dtype = self.grad_dtype if offload else torch.float32
        self.offload = offload
        self.host_shard = host_shard
        self.device = params[0].device
        self.layout = _C.FlatParamLayout([list(p.shape) for p in params], world_size, align_elems)
        begin, end = self.layout.shard_range(rank)
        with torch.no_grad():
            source = self.layout.flatten([p.detach() for p in params], source_dtype, self.device)
            self.full = source if self.dtype == source_dtype else source.to(self.dtype)
            for p, view in zip(params, self.layout.views(self.full)):
                p.data = view
            # Stage 3 keeps only the shard between uses: a tensor of its own, while `full` keeps its storage object
            # (the parameters' views point into it) but gives its memory back until the next all-gather.
            if keep_full:
                self.shard = self.full[begin:end]
            elif host_shard:
                self.shard = _C.empty_host(end - begin, self.dtype, pin_memory)
                self.shard.copy_(self.full[begin:end])
            else:
                self.shard = self.full[begin:end].clone()
        self.is_gathered = True

        self.master: nn.Parameter | None = None
        self.master_aliases_shard = False
        if trainable:
            self.master_device = torch.device(master_device)
            aliases = self.dtype == torch.float32 and self.device == self.master_device and not offload
            if aliases:
                master = self.shard
            else:
                # from the original (fp32) values, not from the compute-dtype copy: the master keeps full precision
                if offload:
                    master = _C.empty_host(end - begin, torch.float32, pin_memory)
                else:
                    master = torch.empty(end - begin, dtype=torch.float32, device=self.master_device)
                master.copy_(source[begin:end])
            self.master_aliases_shard = aliases
            self.master = nn.Parameter(master, requires_grad=True)
        self._grad_shard: torch.Tensor | None = None
        del source
        if not keep_full:
            self.free_full()
        self.full_grad: torch.Tensor | None = None

    # -- stage 3: full buffer on use only ------------------------------------------------------------------------------

    @property
    def full_nbytes(self) -> int:
        return self.layout.padded_numel * self.full.element_size()

    def free_full(self) -> None:
        """Gives the full buffer's memory back.

        The parameters keep their shapes but their ``.data`` becomes a NaN placeholder of that shape that takes no
        memory (an expanded 1-element tensor): a read outside a gather gives NaNs and a write fails, instead of
        reading freed memory. ``.data`` swaps do not bump the version counter, so tensors autograd saved in forward
        stay valid once :meth:`alloc_full` points the parameters back into the buffer.
        """
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            p.data = _placeholder(p.dtype, p.device).expand(p.shape)
        self.is_gathered = False

    def alloc_full(self) -> None:
        """Re-allocates the full buffer's memory (uninitialised) ahead of an all-gather into it."""
        if self.full.untyped_storage().size() == 0:
            self.full.untyped_storage().resize_(self.full_nbytes)
            for p, view in zip(self.params, self.layout.views(self.full)):
                p.data = view

    @property
    def grad_shard(self) -> torch.Tensor:
        """Gradient shard, allocated (zeros) at the first reduction, so materialising a model costs shards only."""
        if self._grad_shard is None:
            self._grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_shard_dtype, device=self.device)
        return self._grad_shard

    def release_grad_shard(self) -> None:
        """Drops the gradient shard once its copy to the host is enqueued (the copy queue keeps it alive until done)."""
        self._grad_shard = None

    def zero_grad_shard(self) -> None:
        if self._grad_shard is not None:
            self._grad_shard.zero_()

    @property
    def numel(self) -> int:
        """Elements of the parameters, without padding."""
        return sum(p.numel() for p in self.params)

    def full_grad_views(self) -> list[torch.Tensor]:
        """Per-parameter views of :attr:`full_grad`, allocating it (zeros) on first use."""
        if self.full_grad is None:
            self.full_grad = torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype, device=self.device)
            self._grad_views = self.layout.views(self.full_grad)
        return self._grad_views

    def free_full_grad(self) -> None:
        self.full_grad = None
        self._grad_views = None

    @torch.no_grad()
    def load_master_into_shard(self) -> None:
        """Writes the updated master shard into :attr:`shard` (cast to the parameter dtype)."""
        if self.master is not None and not self.master_aliases_shard:
            self.shard.copy_(self.master.detach(), non_blocking=True)

    @torch.no_grad()
    def load_shard_into_master(self) -> None:
        """Refreshes the master shard from :attr:`shard` (after the parameters were loaded from a checkpoint)."""
        if self.master is not None and not self.master_aliases_shard:
            self.master.detach().copy_(self.shard)

    def __repr__(self) -> str:
        return (
            f"FlatParam({len(self.params)} params, {self.numel} elements, padded {self.layout.padded_numel}, "
            f"shard {self.layout.shard_numel}, {self.dtype}, {self.device})"
        )


_PLACEHOLDERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _PLACEHOLDERS:
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
        _PLACEHOLDERS[key] = torch.full((1,), fill, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]

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
        grad_buffer: ``_C.GradBuffer``, the full-size gradient accumulation buffer (:attr:`full_grad`: allocated on
            first use, freed after its reduce-scatter at stages 2-3, kept at stage 1).
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
        self.shapes = [tuple(p.shape) for p in params]
        self.slots: list[list[tuple[dict, str]]] | None = None  # stage 3: where each parameter is registered
        self.placeholders = None  # stage 3: ShardedParameter per parameter, in the slots while freed
        self._snapshot: torch.Tensor | None = None  # the shard when gathered, while writes may be written back
        self._views_of: torch.Tensor | None = None  # the `full` that _storage and _full_views belong to
        self._full_views: list[torch.Tensor] | None = None  # the parameters' views of `full` (stage 3)
        self._nan_views: list[torch.Tensor] | None = None  # each parameter's .data while freed (stage 3)
        self._allocated = True  # whether `full` has its memory (stage 3 frees it between uses)
        self._installs: list[tuple[dict, str, nn.Parameter, torch.Tensor]] = []  # every slot, its param, placeholder
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
        self.grad_buffer = _C.GradBuffer(self.layout, self.grad_dtype, self.device)

    # -- stage 3: full buffer on use only ------------------------------------------------------------------------------

    @property
    def full_nbytes(self) -> int:
        return self.layout.padded_numel * self.full.element_size()

    def free_full(self) -> None:
        """Gives the full buffer's memory back.

        The parameters' own ``.data`` becomes a NaN tensor of their shape that takes no memory (an expanded 1-element
        tensor: internal code keeps the shapes, and a stale use inside autograd reads NaN, not freed memory) and, once
        :meth:`attach` gave the module slots, every slot holds the parameter's
        :class:`~zeroshard.sharding.sharded_param.ShardedParameter` (right shape, no memory; reads and writes go to the
        runtime). ``.data`` swaps do not bump the version counter, so tensors autograd saved in forward stay valid once
        :meth:`alloc_full` points the parameters back into the same storage.
        """
        try:
            self._full_storage().resize_(0)
            self._allocated = False
        except RuntimeError:
            # Not resizable: something outside holds the buffer (``p.numpy()`` inside gathered_parameters). Leave the
            # old memory to it and continue on a fresh storage (allocated, then released at once).
            fresh = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
            fresh.untyped_storage().resize_(0)
            self.full = fresh
            self._allocated = False
        if self._nan_views is None:  # made once: freeing is per unit event
            nan = _nan(self.dtype, self.device)
            self._nan_views = [nan.expand(shape) for shape in self.shapes]
        for p, v in zip(self.params, self._nan_views):
            p.data = v
        self.is_gathered = False

    def alloc_full(self) -> None:
        """Re-allocates the full buffer's memory (uninitialised) ahead of an all-gather into it; the parameters view
        it again. The module slots get the parameters back once the gather is complete (:attr:`is_gathered`)."""
        if not self._allocated:
            self._full_storage().resize_(self._nbytes)
            self._allocated = True
            if self._full_views is None:  # views need the memory to be made; they stay valid across resizes
                self._full_views = self.layout.views(self.full)
            for p, view in zip(self.params, self._full_views):
                p.data = view

    def _full_storage(self) -> torch.UntypedStorage:
        """:attr:`full`'s storage; it, its size and the parameters' views of :attr:`full` are made once per
        :attr:`full` object (a view stays valid across the storage's resizes, as FSDP2's unsharded parameters do), not
        per unit event."""
        if self._views_of is not self.full:
            self._storage = self.full.untyped_storage()
            self._nbytes = self.layout.padded_numel * self.full.element_size()
            self._full_views = None  # made by the next alloc_full, once the storage has its memory
            self._views_of = self.full
        return self._storage

    @torch.no_grad()
    def move_shard(self, dst: torch.Tensor) -> None:
        """Stage 3: :attr:`shard` (and the master, where it aliases the shard) moves into ``dst`` (``shard_numel``
        contiguous elements of the shard's dtype and device, e.g. its slice of the unit's packed row,
        :func:`~zeroshard.sharding.sharded_units.pack_shards`); values are kept."""
        if self.keep_full or self.host_shard:
            raise RuntimeError("move_shard: only a stage-3 device shard has a buffer of its own to move")
        if dst.shape != self.shard.shape or dst.dtype != self.shard.dtype or dst.device != self.shard.device:
            raise ValueError(
                f"move_shard: expected {list(self.shard.shape)} {self.shard.dtype} on {self.shard.device}, got "
                f"{list(dst.shape)} {dst.dtype} on {dst.device}"
            )
        dst.copy_(self.shard)
        self.shard = dst
        if self.master_aliases_shard:
            self.master.data = dst

    @property
    def is_gathered(self) -> bool:
        """Whether :attr:`full` holds the whole parameters (stage 3: between a completed all-gather and the next
        free). Setting it installs the parameters (True) or their placeholders (False) in the module slots."""
        return self._gathered

    @is_gathered.setter
    def is_gathered(self, value: bool) -> None:
        self._gathered = value
        # one flat loop over every slot (a unit event's cost is per parameter: no nested loops, no lookups)
        if value:
            for container, name, p, _ in self._installs:
                container[name] = p
        else:
            for container, name, _, ph in self._installs:
                container[name] = ph

    def attach(self, slots: list[list[tuple[dict, str]]], access) -> None:
        """Stage 3: the module slots of each parameter (``(module._parameters, name)``, several for tied ones) and
        the runtime serving reads and writes of their placeholders while freed."""
        from zeroshard.sharding.sharded_param import ShardedParameter

        self.slots = slots
        self.placeholders = [ShardedParameter(self, i, access) for i in range(len(self.params))]
        self._installs = [
            (container, name, p, ph)
            for p, ph, where in zip(self.params, self.placeholders, slots)
            for container, name in where
        ]
        self.is_gathered = self._gathered  # installs the parameters or their placeholders in every slot

    @torch.no_grad()
    def write_param_shard(self, index: int, src: torch.Tensor) -> None:
        """``params[index] = src`` for this rank's part only: its pieces of :attr:`shard` and of the fp32 master.
        Every rank does the same with its own ``src`` (no communication)."""
        if tuple(src.shape) != self.shapes[index]:
            raise RuntimeError(
                f"cannot copy a tensor of shape {list(src.shape)} into parameter '{self.names[index]}' of shape "
                f"{list(self.shapes[index])}"
            )
        flat = src.detach().reshape(-1)
        separate = self.master is not None and not self.master_aliases_shard
        for pi, p_off, s_off, n in self.layout.shard_slices(self.rank):
            if pi == index:
                piece = flat[p_off : p_off + n]
                self.shard[s_off : s_off + n].copy_(piece)
                if separate:
                    self.master.detach()[s_off : s_off + n].copy_(piece)

    @torch.no_grad()
    def snapshot(self) -> None:
        """Remembers :attr:`shard` as gathered, so that :meth:`write_back` can tell what was written since (a copy of
        this rank's shard; kept only while the unit may be written outside a step)."""
        if self._snapshot is None:
            self._snapshot = self.shard.clone()

    @torch.no_grad()
    def write_back(self) -> None:
        """The gathered values may have been written (outside a step): the elements of this rank's slice of
        :attr:`full` that differ from the :meth:`snapshot` go into :attr:`shard` and the fp32 master. Elements nobody
        wrote keep whatever the shard holds now (an optimizer step in between) and the master its full precision."""
        snap, self._snapshot = self._snapshot, None
        if snap is None:
            return
        begin, end = self.layout.shard_range(self.rank)
        new = self.full[begin:end]
        changed = new.ne(snap.to(new.device))
        if not bool(changed.any()):
            return
        values = new[changed]
        mask = changed.to(self.shard.device)
        self.shard[mask] = values.to(self.shard.device)
        if self.master is not None and not self.master_aliases_shard:
            master = self.master.detach()
            master[changed.to(master.device)] = values.to(master.device, torch.float32)

    @property
    def grad_shard(self) -> torch.Tensor:
        """Gradient shard, allocated (zeros) at the first reduction, so materialising a model costs shards only."""
        if self._grad_shard is None:
            self._grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_shard_dtype, device=self.device)
        return self._grad_shard

    def grad_shard_for_reduction(self) -> tuple[torch.Tensor, bool]:
        """The gradient shard a reduction writes into, and whether it must add to it: False when the shard is
        allocated here (uninitialised, ``layout.shard_numel`` elements of ``grad_shard_dtype``), so the reduction
        stores its result instead of adding it to zeros it would first have to write (the same values: 0 + x = x)."""
        if self._grad_shard is None:
            self._grad_shard = torch.empty(self.layout.shard_numel, dtype=self.grad_shard_dtype, device=self.device)
            return self._grad_shard, False
        return self._grad_shard, True

    def release_grad_shard(self) -> None:
        """Drops the gradient shard once it was handed to the master's ``.grad`` or its copy to the host is enqueued
        (the copy queue keeps it alive until done); the next reduction allocates a fresh one."""
        self._grad_shard = None

    def zero_grad_shard(self) -> None:
        if self._grad_shard is not None:
            self._grad_shard.zero_()

    @property
    def numel(self) -> int:
        """Elements of the parameters, without padding."""
        return sum(p.numel() for p in self.params)

    @property
    def full_grad(self) -> torch.Tensor | None:
        """Full-size gradient accumulation buffer (:attr:`grad_buffer`'s, ``layout.padded_numel`` elements of
        ``grad_dtype``), or None while not allocated."""
        return self.grad_buffer.full

    def full_grad_views(self) -> list[torch.Tensor]:
        """Per-parameter views of :attr:`full_grad`, allocating it on first use; every element reads as accumulated
        (zeros where no gradient arrived since the buffer was allocated or :meth:`reset_full_grad`)."""
        return self.grad_buffer.views()

    def accumulate_grad(self, index: int, grad: torch.Tensor) -> None:
        """Adds ``grad`` (parameter ``index``'s shape; any floating dtype, converted to ``grad_dtype``) into the
        parameter's view of :attr:`full_grad`; call it with grad mode off. The first gradient since the buffer was
        allocated or reset is copied, so the buffer is never zero-filled as a whole (3 MiB here: zeros then an add
        113 us, a copy 68-88 us; issue 22). Backward does the same in C++ (``_C.GradHooks``)."""
        self.grad_buffer.accumulate(index, grad)

    def reset_full_grad(self) -> None:
        """Stage 1, after a reduction: the kept :attr:`full_grad` reads as zeros again, without writing it (the next
        gradients are copied in, :meth:`accumulate_grad`)."""
        self.grad_buffer.reset()

    def free_full_grad(self) -> None:
        self.grad_buffer.release()

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


_NAN: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _nan(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One element (NaN, or 0 for integer dtypes): expanded, the ``.data`` of a freed parameter."""
    key = (dtype, device)
    if key not in _NAN:
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
        _NAN[key] = torch.full((1,), fill, dtype=dtype, device=device)
    return _NAN[key]

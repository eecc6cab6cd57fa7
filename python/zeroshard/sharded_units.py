"""ZeRO stage 3 at run time: each unit's parameters exist whole only while the unit runs.

Forward: a pre-hook all-gathers the unit (or waits for its prefetch) and starts the all-gather of the next unit in the
recorded forward order; a post-hook frees the full buffer and wraps the unit's outputs in an autograd function whose
backward gathers the unit again (and prefetches the unit that runs backward next) before the unit's own backward.
Backward: once the gradient reduction of every trainable flat parameter of a unit has been launched, the unit is freed.
The root unit (parameters no other unit claims: embeddings, final norm, head) stays gathered from the start of a step to
the end of its backward, as FSDP2 does with ``reshard_after_forward=None`` on the root.

Every gather is one bucketed all-gather over the unit's flat parameters. A wait that fails (a collective timeout, a
dead rank) is re-raised naming the unit, and ``check_gather_order=True`` checks before every all-gather that all ranks
gather the same unit, so ranks taking different paths end with an error naming both units, never a silent hang or a
bare collective mismatch (the failure mode of pytorch issue 158719).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zeroshard import _C
from zeroshard.flat_param import FlatParam


class Unit:
    """A unit's flat parameters and gather state."""

    def __init__(
        self, name: str, module: nn.Module, flat_params: list[FlatParam], is_root: bool, persistent: bool = False
    ) -> None:
        self.name = name or "<root>"
        self.module = module
        self.flat_params = flat_params
        self.is_root = is_root
        self.persistent = persistent  # below the persistence threshold: gathered once, never freed
        self.pending = None  # CollectiveHandle of an all-gather in flight
        self.staging: list[torch.Tensor] | None = None  # device copies of host shards feeding that all-gather
        self.launched = 0  # trainable flat parameters whose reduction was launched this backward

    @property
    def trainable(self) -> list[FlatParam]:
        return [fp for fp in self.flat_params if fp.trainable]

    @property
    def is_gathered(self) -> bool:
        return all(fp.is_gathered for fp in self.flat_params)


class _RegatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward gathers the unit before the unit's own backward runs."""

    @staticmethod
    def forward(ctx, runtime: ShardedUnits, index: int, *tensors: torch.Tensor):
        ctx.runtime, ctx.index = runtime, index
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.runtime._pre_backward(ctx.index)
        return (None, None, *grads)


class ShardedUnits:
    """Gather-on-use hooks for a list of units (the first one is the root).

    Args:
        units: units in registration order, root first.
        collectives: ``_C.BucketedCollectives`` on the data-parallel group.
        prefetch: all-gather the next unit (forward and backward order, recorded on the first step) while the current
            one computes.
        check_gather_order: debug setting; before every all-gather, check that all ranks gather the same unit.
    """

    def __init__(
        self, units: list[Unit], collectives: _C.BucketedCollectives, *, prefetch: bool, check_gather_order: bool
    ) -> None:
        self.units = units
        self.collectives = collectives
        self.prefetch = prefetch
        self.check_gather_order = check_gather_order
        self.forward_order: list[int] = []  # recorded on the first forward, then used for prefetch
        self._recording = True
        self.pinned = False  # inside gathered_parameters(): every unit stays whole, hooks do nothing
        self._param_stream: torch.cuda.Stream | None = None  # parameter offload: host-to-device copies + all-gather
        self._handles = []
        for i, unit in enumerate(units):
            if unit.is_root:
                continue
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(i)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(i)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- gather and free -----------------------------------------------------------------------------------------------

    def unshard(self, index: int, *, wait: bool = True) -> None:
        """All-gathers unit ``index`` (or waits for the all-gather already in flight)."""
        unit = self.units[index]
        if unit.pending is None and not unit.is_gathered:
            if self.check_gather_order:
                self._check_same_unit(index)
            for fp in unit.flat_params:
                fp.alloc_full()
            fulls = [fp.full for fp in unit.flat_params]
            bucket = sum(fp.layout.padded_numel for fp in unit.flat_params)
            if any(fp.host_shard and fp.full.is_cuda for fp in unit.flat_params):
                unit.pending, unit.staging = self._gather_from_host(unit, fulls, bucket)
            else:
                unit.pending = self.collectives.all_gather([fp.shard for fp in unit.flat_params], fulls, bucket)
        if wait and unit.pending is not None:
            self._wait(unit)

    def _gather_from_host(self, unit: Unit, fulls: list[torch.Tensor], bucket: int):
        """Parameter offload: host shards -> device staging -> all-gather, on a side stream.

        The host-to-device copies and the all-gather run on ``_param_stream`` so a prefetch does not hold up the
        compute already queued on the current stream; the side stream first waits for that compute, which also
        orders the reuse of staging memory freed after earlier gathers. Returns the handle and the staging tensors,
        kept alive until the wait.
        """
        if self._param_stream is None:
            self._param_stream = torch.cuda.Stream(device=fulls[0].device)
        stream = self._param_stream
        stream.wait_stream(torch.cuda.current_stream(fulls[0].device))
        with torch.cuda.stream(stream):
            staging = [fp.shard.to(fp.full.device, non_blocking=True) for fp in unit.flat_params]
            handle = self.collectives.all_gather(staging, fulls, bucket)
        return handle, staging

    def wait_param_copies(self) -> None:
        """Parameter offload: blocks the host until every host-to-device copy of host shards is done, so the host
        step may overwrite the shards."""
        if self._param_stream is not None:
            self._param_stream.synchronize()

    def _wait(self, unit: Unit) -> None:
        handle, unit.pending = unit.pending, None
        try:
            handle.wait()
        except RuntimeError as e:
            raise RuntimeError(
                f"zeroshard: the all-gather of unit '{unit.name}' failed on rank {self.collectives.rank}: {e}. "
                "If a rank died or took a different code path, run with ZeroStrategy(check_gather_order=True) to "
                "name the first unit where ranks differ."
            ) from e
        unit.staging = None  # the current stream now waits for the gather; later side-stream work waits for it
        for fp in unit.flat_params:
            fp.is_gathered = True

    def reshard(self, index: int, *, force: bool = False) -> None:
        unit = self.units[index]
        if unit.pending is not None:
            self._wait(unit)
        if unit.persistent and not force:
            return
        for fp in unit.flat_params:
            if fp.is_gathered:
                fp.free_full()

    def unshard_all(self) -> None:
        for i in range(len(self.units)):
            self.unshard(i)

    def reshard_all(self) -> None:
        for i in range(len(self.units)):
            self.reshard(i)

    # -- hooks ---------------------------------------------------------------------------------------------------------

    def _make_pre_forward(self, index: int):
        def hook(module, args):
            if self.pinned:
                return
            self._record(index)
            self.unshard(index)
            if self.prefetch and not self._recording:
                nxt = self._neighbour(index, +1)
                if nxt is not None:
                    self.unshard(nxt, wait=False)

        return hook

    def _make_post_forward(self, index: int):
        def hook(module, args, output):
            if self.pinned:
                return output
            if torch._C._current_graph_task_id() != -1:
                return output  # recomputation inside backward (activation checkpointing): keep the unit gathered
            self.reshard(index)
            if not torch.is_grad_enabled():
                return output
            flat, spec = tree_flatten(output)
            idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
            if not idx:
                return output
            wrapped = _RegatherBeforeBackward.apply(self, index, *[flat[i] for i in idx])
            for i, t in zip(idx, wrapped):
                flat[i] = t
            return tree_unflatten(flat, spec)

        return hook

    def _pre_backward(self, index: int) -> None:
        self.unshard(index)
        if self.prefetch:
            nxt = self._neighbour(index, -1)
            if nxt is not None:
                self.unshard(nxt, wait=False)

    def _record(self, index: int) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        if self._recording:
            if index in self.forward_order:  # a second forward began: the first one's order is complete
                self._recording = False
            else:
                self.forward_order.append(index)

    def begin_step(self) -> None:
        """Start of a step: gathers the root unit, which stays gathered until the end of backward."""
        self.unshard(0)

    def _neighbour(self, index: int, step: int) -> int | None:
        order = self.forward_order
        try:
            pos = order.index(index) + step
        except ValueError:
            return None
        return order[pos] if 0 <= pos < len(order) else None

    def on_reduction_launched(self, fp: FlatParam) -> None:
        """GradReducer callback: frees a unit once every trainable flat parameter of it has been reduced."""
        unit = self._unit_of[id(fp)]
        unit.launched += 1
        if not unit.is_root and unit.launched == len(unit.trainable):
            self.reshard(self.units.index(unit))

    def bind_flat_params(self) -> None:
        self._unit_of = {id(fp): u for u in self.units for fp in u.flat_params}

    def end_of_step(self) -> None:
        """After backward: frees every unit and stops recording the forward order."""
        self.reshard_all()
        for unit in self.units:
            unit.launched = 0
        if self.forward_order:
            self._recording = False

    def _check_same_unit(self, index: int) -> None:
        """Debug: before every all-gather, all ranks exchange which unit they are about to gather.

        A rank on another code path reaches a different unit (or a different phase) at the same collective, so the
        exchange itself is matched and the error names both units instead of gloo/NCCL failing on mismatched sizes.
        """
        self._gather_count += 1
        phase = 1 if torch._C._current_graph_task_id() != -1 else 0
        mine = torch.tensor([index, phase], dtype=torch.int64, device=self._check_device)
        everyone = torch.empty(self.collectives.world_size * 2, dtype=torch.int64, device=self._check_device)
        dist.all_gather_into_tensor(everyone, mine, group=self._group)
        pairs = everyone.view(-1, 2).tolist()
        if any(p != pairs[0] for p in pairs):
            where = ", ".join(
                f"rank {r} -> '{self.units[u].name}' ({'backward' if ph else 'forward'})"
                for r, (u, ph) in enumerate(pairs)
            )
            raise RuntimeError(
                f"zeroshard: ranks diverged at all-gather #{self._gather_count}: {where}. Every rank must run the same "
                "units in the same order (ZeRO-3 all-gathers are collective); make the control flow in forward "
                "depend only on what is the same on every rank."
            )

    def attach_group(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """The process group and device for the debug order check."""
        self._group, self._check_device, self._gather_count = group, device, 0

"""Hybrid sharding: shard within groups of k ranks, replicate across the world / k groups.

The layout of PyTorch FSDP's ``HYBRID_SHARD`` (FSDP2: ``fully_shard(mesh=2-D DeviceMesh)``), DeepSpeed's ZeRO++ hpZ
(``zero_hpz_partition_size``) and MiCS (Zhang et al. 2022): parameters, gradients and optimizer state are cut into k
shards inside each *shard group* (typically the GPUs of one node, joined by NVLink), and every shard group holds the
same state, so stage 3's all-gathers and the gradient reduce-scatters stay inside a group. Gradients cross groups once
per step: each rank all-reduces its reduce-scattered gradient shard with the ranks holding the same shard in the
other groups (its *replicate group*), 2 (Psi / k) (R - 1) / R bytes for R groups instead of Psi-sized collectives.

Ranks are laid out as a ``(replicate, shard)`` mesh, FSDP2's order: rank ``r`` is shard rank ``r % k`` of shard group
``r // k``, so consecutive ranks (one node under torchrun) share a shard group. Groups come from torch's
``init_device_mesh`` (or a mesh the user passes), never from our own transport.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeroshard import _C


@dataclass
class DataParallelGroups:
    """The process groups of one data-parallel layout.

    Attributes:
        shard: the ranks that split one copy of the state (k ranks); every bucketed collective runs on it.
        replicate: the ranks holding the same shard in the other shard groups (R = world / k ranks), or None when
            there is one shard group (k = world size: plain ZeRO).
        world: every data-parallel rank (k * R); initial broadcasts and checkpoint barriers run on it.
    """

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    world: dist.ProcessGroup

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else dist.get_world_size(self.replicate)

    @property
    def replicate_rank(self) -> int:
        """Which shard group this rank is in (0 for the first, the one that writes checkpoints)."""
        return 0 if self.replicate is None else dist.get_rank(self.replicate)


def data_parallel_groups(
    process_group: dist.ProcessGroup | None = None,
    shard_group_size: int | None = None,
    device_mesh=None,
    device_type: str = "cpu",
) -> DataParallelGroups:
    """Builds (or takes) the shard and replicate groups; collective when it builds them (every rank must call it).

    Args:
        process_group: plain ZeRO over this group (default: the world group) when neither of the next two is given.
        shard_group_size: k, ranks per shard group; must divide the world size. ``k = world size`` is plain ZeRO.
        device_mesh: a ``torch.distributed.device_mesh.DeviceMesh``: 2-D ``(replicate, shard)`` (FSDP2's HSDP mesh;
            dimension 0 replicates, dimension 1 shards) or 1-D (shard only).
        device_type: ``"cuda"`` or ``"cpu"``, for ``init_device_mesh``.

    Raises:
        ValueError: if ``shard_group_size`` does not divide the world size, if a mesh is not 1-D or 2-D, or if both a
            mesh and a process group or shard group size are given; naming the values.
    """
    if device_mesh is not None:
        if process_group is not None or shard_group_size is not None:
            raise ValueError(
                "ZeroStrategy(device_mesh=...) already fixes the layout: drop shard_group_size / process_group."
            )
        if device_mesh.ndim == 1:
            group = device_mesh.get_group(0)
            return DataParallelGroups(group, None, group)
        if device_mesh.ndim != 2:
            raise ValueError(
                f"ZeroStrategy(device_mesh=...) needs a 1-D (shard) or 2-D (replicate, shard) mesh, got "
                f"{device_mesh.ndim} dimensions {tuple(device_mesh.shape)}"
            )
        return DataParallelGroups(device_mesh.get_group(1), device_mesh.get_group(0), dist.group.WORLD)
    world_group = process_group or dist.group.WORLD
    world = dist.get_world_size(world_group)
    if shard_group_size is None or shard_group_size == world:
        return DataParallelGroups(world_group, None, world_group)
    if process_group is not None:
        raise ValueError(
            "ZeroStrategy(shard_group_size=...) builds its groups from the world group: drop process_group"
        )
    if world % shard_group_size != 0:
        raise ValueError(
            f"ZeroStrategy(shard_group_size={shard_group_size}) must divide the world size ({world}): use one of "
            f"{[k for k in range(1, world + 1) if world % k == 0]}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        device_type, (world // shard_group_size, shard_group_size), mesh_dim_names=("replicate", "shard")
    )
    return DataParallelGroups(mesh.get_group("shard"), mesh.get_group("replicate"), dist.group.WORLD)


class _ReplicatedReduceScatterHandle:
    """A reduce-scatter inside the shard group, then the all-reduce of its result across the replicate group."""

    def __init__(self, inner, replicate: _C.BucketedCollectives, outs, shards, accumulate: bool, bucket: int) -> None:
        self.inner, self.replicate = inner, replicate
        self.outs, self.shards, self.accumulate, self.bucket = outs, shards, accumulate, bucket
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.inner.wait()
        self.replicate.all_reduce(self.outs, self.bucket, 1.0).wait()
        if self.accumulate:
            for shard, out in zip(self.shards, self.outs):
                shard.add_(out)
        self.done = True

    def is_completed(self) -> bool:
        return self.done


class HybridGradReduction:
    """What :class:`~zeroshard.sharding.grad_reducer.GradReducer` needs of its collectives, over two levels.

    ``reduce_scatter`` reduce-scatters within the shard group (scaled by ``1 / world_size``, the whole data-parallel
    world), and its handle's ``wait()`` then all-reduces the resulting shards across the replicate group. With
    ``accumulate`` the fresh shard goes through a temporary, so a gradient already in the shard is not summed over the
    replicas again. The cross-group all-reduce runs in the shards' dtype (fp32 gradient shards by default).
    """

    def __init__(self, shard: _C.BucketedCollectives, replicate: _C.BucketedCollectives) -> None:
        self.shard, self.replicate = shard, replicate
        self.rank = shard.rank
        self.world_size = shard.world_size * replicate.world_size

    def reduce_scatter(self, fulls, shards, bucket_elems: int, scale: float = 1.0, accumulate: bool = False):
        outs = [torch.empty_like(s) for s in shards] if accumulate else list(shards)
        inner = self.shard.reduce_scatter(fulls, outs, bucket_elems, scale, False)
        bucket = max(1, sum(s.numel() for s in shards))
        return _ReplicatedReduceScatterHandle(inner, self.replicate, outs, shards, accumulate, bucket)

"""ZeroConfig: every setting of a zeroshard run, validated when it is built so a bad config fails before training."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from zeroshard.engine.policy_check import check_policy
from zeroshard.engine.step_flags import NONFINITE_MODES
from zeroshard.optim.restore_checks import MODES as OPTIMIZER_STATE_MODES
from zeroshard.optim.state_format import check_state_dtype
from zeroshard.sharding.sharded_units import PREFETCH_BUCKET_SIZE

SUPPORTED_STAGES = (1, 2, 3)
MIN_ALIGN_BYTES = 64  # a cache line, one AVX-512 vector
MAX_ALIGN_BYTES = 2 << 20  # a huge page: padding beyond it buys nothing


def _is_count(value, least: int) -> bool:
    """Whether ``value`` is a plain int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class ZeroConfig:
    """Settings of the ZeRO engine.

    Args:
        stage: ZeRO stage (Rajbhandari et al. 2020, "ZeRO", section 5). 1 shards the fp32 master weights and optimizer
            state; 2 also shards gradients (reduce-scattered in buckets during backward); 3 also shards the
            parameters, all-gathered per unit on use and freed after.
        offload_optimizer: keep master weights and optimizer state in host memory and step them with the fused CPU
            Adam (ZeRO-Offload, Ren et al. 2021), pipelined with the copies (:mod:`zeroshard.offload.offload`): gradient
            shards go device-to-host as each bucket's reduce-scatter finishes, and the step runs in chunks while updated
            compute-dtype weights go host-to-device. Adam/AdamW are converted; other torch optimizers run unpipelined
            on the host copies as they are.
        offload_params: stage 3 with ``offload_optimizer``: the parameter shards live in pinned host memory (compute
            dtype) and are copied to the device just before their all-gather, prefetched with it (ZeRO-Infinity's
            parameter offload, Rajbhandari et al. 2021, section 5). The optimizer step writes them in place.
        offload_chunk_size: elements per chunk of the pipelined host step (each chunk's upload buffer holds this
            many compute-dtype elements; two are allocated).
        overlap_step: with ``offload_optimizer``: step each bucket on a host worker as soon as its gradient shard is
            copied to the host, while backward goes on (:mod:`zeroshard.offload.overlap`); results equal the step after
            backward bit for bit. With gradient clipping or fp16 loss scaling the step waits for the end of backward
            (their factors are global) and folds them into the kernel. Off by default until measured on a GPU.
        reduce_bucket_size: elements per flat parameter / gradient bucket (stages 1-2). Each bucket is one
            reduce-scatter (stage 2) or all-reduce (stage 1). Default 25M elements, like DeepSpeed's ``5e8`` bytes / 20.
        allgather_bucket_size: elements per all-gather of updated parameter shards after the step.
        max_inflight_buckets: reduce-scatters allowed in flight during backward before the oldest is waited on;
            bounds the full-size gradient buffers alive at once (stage 2 memory).
        align_bytes: every parameter and shard boundary in a flat buffer is aligned to this many bytes: a power of
            two from 64 (a cache line / AVX-512 vector) to 2 MiB (a huge page).
        wrap_policy: stage 3 units: a module class or tuple of classes (e.g. the transformer block), a parameter-count
            threshold (int >= 1), or ``callable(name, module) -> bool`` (called with each submodule's qualified name
            and the module). The root is always a unit. Checked here for its kind and a callable's signature; the
            strategies also check at setup that it selects at least one module (:mod:`zeroshard.engine.policy_check`).
        prefetch: stage 3: all-gather the next unit while the current one computes.
        prefetch_bucket_size: stage 3: a prefetch all-gathers the next units together, in one collective, while
            their gathered sizes sum to at most this many elements (always at least the next unit), as DeepSpeed's
            ``stage3_prefetch_bucket_size`` does. Small units then cost one collective per group instead of one each
            (a collective's fixed cost dominates a small unit's); the group is gathered while the unit before it
            computes, so it adds up to this many elements to the gathered parameters. 0 gathers one unit at a time;
            None (default): :data:`PREFETCH_BUCKET_SIZE` at stage 3 (:attr:`prefetch_bucket_elems`).
        param_persistence_threshold: stage 3: units with fewer parameter elements than this stay gathered for the
            whole run (DeepSpeed's ``stage3_param_persistence_threshold``): too small to be worth a collective each.
            An int >= 0; non-zero only at stage 3.
        reduce_dtype: dtype gradients are accumulated and reduced in (a floating ``torch.dtype``); default fp32,
            whatever the compute dtype. ``torch.bfloat16`` halves the gradient traffic of bf16-mixed runs.
        param_init_fn: ``callable(module)`` that initialises a module's own tensors when a model built on the meta
            device is materialised; default: each module's ``reset_parameters()``.
        check_gather_order: stage 3 debug setting: compare the order of gathered units across ranks after every
            backward and raise naming the first difference. ``True`` at stages 1-2 is an error (nothing is gathered).
        shard_group_size: hybrid sharding (:mod:`zeroshard.sharding.hybrid`; FSDP's HYBRID_SHARD, ZeRO++ hpZ, MiCS):
            shard over groups of this many consecutive ranks and replicate across the world / k groups. ``None`` (or
            the world size) shards over every rank. Must divide the world size (checked when the engine is built).
        device_mesh: instead of ``shard_group_size``, a ``DeviceMesh``: 2-D ``(replicate, shard)`` or 1-D (shard).
        nonfinite: what a NaN/inf gradient on any rank does (:mod:`zeroshard.engine.step_flags`), found before any
            master weight changes: ``"error"`` (default) raises ``NonFiniteGradientError`` on every rank, naming the
            step and the first bucket; ``"skip"`` skips the step on every rank (weights and optimizer state unchanged)
            with a warning; ``"ignore"`` steps as torch does. Under fp16 loss scaling the scaler's overflow skip
            handles it. ``"skip"`` cannot be combined with ``overlap_step`` (buckets step before the check).
        optimizer_state: how a checkpoint's optimizer state is restored (:mod:`zeroshard.optim.restore_checks`):
            ``"strict"`` (default) checks it before any state changes (the optimizer class, param group keys, types
            and ranges, parameters per group) and refuses one that does not fit, naming the file, group, key and
            value; ``"reset"`` loads the weights and starts the optimizer fresh (its own hyperparameters, no state),
            warning with exactly what was dropped: the explicit way to resume with another optimizer.
        optimizer_state_dtype: how the Adam moments are kept (:mod:`zeroshard.optim.state_format`): ``torch.float32``
            (default; 8 bytes per parameter), ``torch.bfloat16`` (4) or ``"int8"`` (block-wise 8-bit, 2 + 8/2048),
            on each rank's shards. Applies to the fused Adam only (:mod:`zeroshard.optim.engine_state_format`):
            ``zeroshard.optim.CPUAdam`` / ``DeviceAdam``, or torch's Adam/AdamW (without amsgrad/maximize), which
            the engine replaces by ``OffloadedAdam`` (offload), ``CPUAdam`` (CPU masters) or ``DeviceAdam`` (GPU
            masters, torch ops); any other optimizer with a non-fp32 format is refused when the engine is built.
            With the default, a ``CPUAdam`` keeps its own ``state_dtype``; ``ZeroStrategy(stage="auto")`` may choose
            bf16 or int8 when nothing fits with fp32 and this was not given.

    Raises:
        ValueError: naming the bad setting and the accepted values.
        TypeError: ``device_mesh`` that is not a ``DeviceMesh``.
    """

    stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_chunk_size: int = 4 * 1024 * 1024
    overlap_step: bool = False
    reduce_bucket_size: int = 25_000_000
    allgather_bucket_size: int = 25_000_000
    max_inflight_buckets: int = 2
    align_bytes: int = 64
    wrap_policy: object = None
    prefetch: bool = True
    prefetch_bucket_size: int | None = None
    check_gather_order: bool = False
    param_init_fn: object = None
    reduce_dtype: object = None
    param_persistence_threshold: int = 0
    shard_group_size: int | None = None
    device_mesh: object = None
    nonfinite: str = "error"
    optimizer_state: str = "strict"
    optimizer_state_dtype: object = torch.float32

    def __post_init__(self) -> None:
        if (
            isinstance(self.stage, bool)
            or not isinstance(self.stage, numbers.Integral)
            or self.stage not in SUPPORTED_STAGES
        ):
            kind = (
                f" (a {type(self.stage).__name__}: pass the int {int(self.stage)})"
                if isinstance(self.stage, float) and self.stage in SUPPORTED_STAGES
                else ""
            )
            raise ValueError(
                f"ZeroStrategy(stage={self.stage!r}) is not a ZeRO stage{kind}: use 1 (optimizer state sharded), 2 "
                "(optimizer state and gradients sharded) or 3 (parameters sharded too), as an int, or 'auto' (the "
                "strategies' planner chooses)."
            )
        object.__setattr__(self, "stage", int(self.stage))  # a numpy integer becomes a plain int
        if self.stage != 3 and self.wrap_policy is not None:
            raise ValueError(
                f"ZeroStrategy(wrap_policy={self.wrap_policy!r}) only applies to stage=3 (stages 1-2 keep parameters "
                "whole); drop it or use stage=3."
            )
        check_policy("ZeroStrategy", "wrap_policy", self.wrap_policy, threshold=True)
        if not _is_count(self.param_persistence_threshold, 0):
            raise ValueError(
                f"ZeroStrategy(param_persistence_threshold={self.param_persistence_threshold!r}) must be an int >= 0 "
                "(elements: stage-3 units smaller than this stay gathered; 0, the default, keeps none gathered)."
            )
        if self.prefetch_bucket_size is not None and not _is_count(self.prefetch_bucket_size, 0):
            raise ValueError(
                f"ZeroStrategy(prefetch_bucket_size={self.prefetch_bucket_size!r}) must be an int >= 0 (elements: "
                "stage-3 units prefetched together in one all-gather; 0 gathers one unit at a time) or None (the "
                f"default, {PREFETCH_BUCKET_SIZE:,} at stage 3)."
            )
        for name, value, default in (
            ("check_gather_order", self.check_gather_order, False),
            ("param_persistence_threshold", self.param_persistence_threshold, 0),
            ("prefetch_bucket_size", self.prefetch_bucket_size or None, None),
        ):
            if self.stage != 3 and value != default:
                raise ValueError(
                    f"ZeroStrategy({name}={value!r}) only applies to stage=3 (stages 1-2 gather no units, so it "
                    f"would do nothing at stage={self.stage}); drop it or use stage=3."
                )
        for name in ("reduce_bucket_size", "allgather_bucket_size", "max_inflight_buckets", "offload_chunk_size"):
            value = getattr(self, name)
            if not _is_count(value, 1):
                raise ValueError(f"ZeroStrategy({name}={value!r}) must be a positive integer (a count of elements).")
        if self.reduce_dtype is not None and not (
            isinstance(self.reduce_dtype, torch.dtype) and self.reduce_dtype.is_floating_point
        ):
            raise ValueError(
                f"ZeroStrategy(reduce_dtype={self.reduce_dtype!r}) must be a floating torch.dtype "
                "(torch.float32, torch.bfloat16 or torch.float16) or None."
            )
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ValueError(f"ZeroStrategy(param_init_fn={self.param_init_fn!r}) must be callable(module) or None.")
        for name in ("prefetch", "check_gather_order"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ZeroStrategy({name}={getattr(self, name)!r}) must be True or False.")
        for name in ("offload_optimizer", "offload_params", "overlap_step"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ZeroStrategy({name}={getattr(self, name)!r}) must be True or False.")
        if not isinstance(self.nonfinite, str) or self.nonfinite not in NONFINITE_MODES:
            raise ValueError(
                f"ZeroStrategy(nonfinite={self.nonfinite!r}) must be one of {NONFINITE_MODES}: 'error' (raise on every "
                "rank), 'skip' (skip the step everywhere, with a warning) or 'ignore' (step as torch does)."
            )
        if self.optimizer_state not in OPTIMIZER_STATE_MODES:
            raise ValueError(
                f"ZeroStrategy(optimizer_state={self.optimizer_state!r}) must be 'strict' (restore a checkpoint's "
                "optimizer state, refusing one that does not fit the optimizer) or 'reset' (load the weights, start "
                "the optimizer fresh)."
            )
        try:
            object.__setattr__(self, "optimizer_state_dtype", check_state_dtype(self.optimizer_state_dtype))
        except ValueError:
            raise ValueError(
                f"ZeroStrategy(optimizer_state_dtype={self.optimizer_state_dtype!r}) is not a state format: use "
                "torch.float32 (default), torch.bfloat16 or 'int8' (block-wise 8-bit moments)."
            ) from None
        if self.nonfinite == "skip" and self.overlap_step:
            raise ValueError(
                "ZeroStrategy(nonfinite='skip') cannot skip a step that overlap_step=True has partly taken during "
                "backward: drop overlap_step, or use nonfinite='error' or 'ignore'."
            )
        if self.offload_params and self.stage != 3:
            raise ValueError(
                f"ZeroStrategy(offload_params=True) needs stage=3 (got stage={self.stage}): only stage 3 shards the "
                "parameters. Use stage=3, or drop offload_params and keep offload_optimizer=True."
            )
        if self.overlap_step and not self.offload_optimizer:
            raise ValueError(
                "ZeroStrategy(overlap_step=True) overlaps the offloaded CPU step with backward: it needs "
                "offload_optimizer=True. Set offload_optimizer=True too, or drop overlap_step."
            )
        if self.offload_params and not self.offload_optimizer:
            raise ValueError(
                "ZeroStrategy(offload_params=True) needs offload_optimizer=True: the host step writes the offloaded "
                "parameter shards in place. Set offload_optimizer=True too."
            )
        if (
            isinstance(self.align_bytes, bool)
            or not isinstance(self.align_bytes, int)
            or not MIN_ALIGN_BYTES <= self.align_bytes <= MAX_ALIGN_BYTES
            or self.align_bytes & (self.align_bytes - 1)
        ):
            raise ValueError(
                f"ZeroStrategy(align_bytes={self.align_bytes!r}) must be a power of two from {MIN_ALIGN_BYTES} (one "
                f"cache line) to {MAX_ALIGN_BYTES} (a 2 MiB huge page): every parameter is padded to it, so a larger "
                "one only wastes memory."
            )

        if self.shard_group_size is not None and not _is_count(self.shard_group_size, 1):
            raise ValueError(
                f"ZeroStrategy(shard_group_size={self.shard_group_size!r}) must be a positive integer (ranks per shard "
                "group, dividing the world size) or None (shard over every rank)."
            )
        if self.device_mesh is not None and self.shard_group_size is not None:
            raise ValueError("ZeroStrategy: give either shard_group_size or device_mesh, not both.")
        if self.device_mesh is not None and not isinstance(self.device_mesh, DeviceMesh):
            raise TypeError(
                f"ZeroStrategy(device_mesh={self.device_mesh!r}) is a {type(self.device_mesh).__name__}: pass a "
                "torch.distributed.device_mesh.DeviceMesh, e.g. init_device_mesh('cuda', (replicas, shard_size), "
                "mesh_dim_names=('replicate', 'shard')), or shard_group_size=<ranks per shard group>."
            )

    @property
    def prefetch_bucket_elems(self) -> int:
        """The prefetch bucket in effect: ``prefetch_bucket_size``, or its default (stage 3 only) when None."""
        if self.prefetch_bucket_size is not None:
            return self.prefetch_bucket_size
        return PREFETCH_BUCKET_SIZE if self.stage == 3 else 0

    def align_elems(self, element_size: int) -> int:
        """Alignment in elements for a buffer of ``element_size``-byte elements."""
        return max(1, self.align_bytes // element_size)

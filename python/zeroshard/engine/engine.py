"""ZeroEngine: ZeRO stages 1-3 for one module and its optimizers (one, or several such as a GAN's).

The engine owns the flat parameters (buckets), the gradient reducer and the optimizer rewiring. The Lightning strategy
calls it at four points: :meth:`ZeroEngine.__init__` at setup, :meth:`finish_backward` after each backward,
:meth:`after_step` after each optimizer step, and the state-dict methods for checkpoints. It is usable without Lightning
too (see ``tests/python``): build it after creating the optimizer, then run ``loss.backward()``, ``optimizer.step()``,
``engine.after_step(optimizer)`` as usual.

Per step (stage 2): backward hooks reduce-scatter each bucket's gradient into fp32 gradient shards (bucketed, overlapped
with backward) -> the shards become the master shards' ``.grad`` -> the optimizer steps the master shards (on the host
with ``offload_optimizer``) -> updated shards are written into this rank's slice of each flat buffer -> bucketed
all-gather of the flat buffers, which the module's parameters view.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from zeroshard import _C
from zeroshard.engine.config import ZeroConfig
from zeroshard.engine.module_grads import ModuleGrads
from zeroshard.engine.step_flags import confirm_nonfinite, exchange_flags, loss_scaling_pending, nonfinite_found
from zeroshard.engine.unused_params import UnusedParams
from zeroshard.init.init_plan import check_plan, plan_init, run_plan
from zeroshard.meta_init import check_no_meta, has_meta, materialize_module_, replacement
from zeroshard.offload.offload import (
    OffloadedAdam,
    OptimizerOffload,
    check_host_budget,
    host_bytes_needed,
    threads_per_rank,
)
from zeroshard.optim.engine_state_format import adam_class_without_offload, apply_state_dtype, resolve_state_dtype
from zeroshard.optim.matrix_optimizers import check_matrix_optimizers, needs_whole_matrices
from zeroshard.optim.optim_state import (
    check_consolidated_state_dict,
    consolidated_state_dict,
    load_consolidated_state_dict,
)
from zeroshard.optim.sharded_muon import ShardedMuon
from zeroshard.optim.sharded_optimizer import OptimizerSet
from zeroshard.optim.small_state import apart_rule, fp32_state_masters, min_8bit_size_of
from zeroshard.pretrained import apply_recorded_pretrained
from zeroshard.sharding import gather_check
from zeroshard.sharding.buckets import BucketPlan, plan_buckets
from zeroshard.sharding.collective_errors import named_collective
from zeroshard.sharding.comm_stats import summarize
from zeroshard.sharding.flat_param import FlatParam
from zeroshard.sharding.gather_check import dedicated_group
from zeroshard.sharding.gloo_exit import drain_gloo_workers_at_exit
from zeroshard.sharding.grad_reducer import GradReducer
from zeroshard.sharding.hybrid import HybridGradReduction, data_parallel_groups
from zeroshard.sharding.managed import register_engine
from zeroshard.sharding.matrix_exchange import AllToAllStats
from zeroshard.sharding.sharded_param import real_parameter
from zeroshard.sharding.sharded_units import ShardedUnits, Unit
from zeroshard.sharding.units import plan_units


class ZeroEngine:
    """Shards the optimizer state and, at stage 2, the gradients of ``module`` across ``process_group`` (stage 3: the
    parameters too).

    Args:
        module: the model, already on its compute device. Its trainable parameters become views into flat buffers.
        optimizer: a fresh torch optimizer over ``module``'s parameters (any class; param groups kept), or a sequence
            of them over disjoint parameters (a GAN's generator and discriminator): each gets the master shards of its
            own param groups; no flat parameter mixes optimizers.
        config: :class:`~zeroshard.engine.config.ZeroConfig`.
        process_group: the data-parallel group (default: the world group). Must be initialised. With
            ``config.shard_group_size`` or ``config.device_mesh`` (hybrid sharding, :mod:`zeroshard.sharding.hybrid`)
            the engine builds its shard and replicate groups from the world group instead.
        compute_dtype: dtype of the parameters forward and backward run with (``torch.bfloat16`` for bf16-mixed);
            default: the parameters' own. Master weights and optimizer state stay fp32.
        local_world_size: ranks on this host (default ``LOCAL_WORLD_SIZE`` from the environment, else 1). With
            offload, each rank steps with ``cores / local_world_size`` threads and the host-memory check counts every
            local rank.

    Gradients follow ``param.grad`` semantics on the master shards: each synchronised backward adds the reduced
    gradient shard into ``master.grad`` (``None`` -> the shard itself), so gradients accumulate across backward passes
    until that optimizer's ``zero_grad`` or :meth:`after_step` (which clears them, as DeepSpeed's ``engine.step()``
    does). A backward that reaches parameters of several optimizers gives each of them its gradient, as under DDP. A
    master whose ``requires_grad`` is False (Lightning's ``toggle_optimizer`` toggles the masters, which are what the
    optimizer holds) receives no gradient, as a parameter with ``requires_grad=False`` receives none under DDP.

    Attributes:
        optimizers: the optimizers to step, in the order given: each rewired onto its master shards, or its
            :class:`~zeroshard.offload.offload.OffloadedAdam` replacement when offloading Adam/AdamW, or the
            :class:`~zeroshard.optim.sharded_muon.ShardedMuon` replacing a ``torch.optim.Muon``.
        optimizer: the only optimizer (``optimizers[0]``); an error when there are several.
        offload: the :class:`~zeroshard.offload.offload.OptimizerOffload` (``None`` without ``offload_optimizer``).

    Raises:
        RuntimeError: if torch.distributed is not initialised, or the optimizer already holds state.
        ValueError: if the optimizer holds parameters that are not in ``module``, or (offload) if the host memory the
            offload needs on this host exceeds what is available; raised before any shard is allocated.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer | Sequence[Optimizer],
        config: ZeroConfig,
        process_group: dist.ProcessGroup | None = None,
        compute_dtype: torch.dtype | None = None,
        local_world_size: int | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ZeroEngine needs torch.distributed: call torch.distributed.init_process_group (Lightning's Trainer "
                "does it for ZeroStrategy)"
            )
        self.config = config
        self.module = module
        self.compute_dtype = compute_dtype
        self.reduce_dtype = config.reduce_dtype or torch.float32
        device_type = "cuda" if dist.get_backend(process_group) == "nccl" else "cpu"
        drain_gloo_workers_at_exit(process_group)  # the collectives below hold gloo workers until exit
        groups = data_parallel_groups(process_group, config.shard_group_size, config.device_mesh, device_type)
        self.groups = groups
        self.process_group = groups.shard  # every bucketed collective runs in the shard group
        self.collectives = _C.BucketedCollectives(self.process_group)
        self.rank = self.collectives.rank  # rank inside the shard group: which shard this rank holds
        self.world_size = self.collectives.world_size  # ranks per shard group (the number of shards)
        self.replicate_collectives = _C.BucketedCollectives(groups.replicate) if groups.replicate else None
        self.replicate_rank, self.replicate_size = groups.replicate_rank, groups.replicate_size
        self.steps = 0  # after_step calls so far (trainer.global_step with one optimizer); named in errors
        self._comm_stats = {"shard": self.collectives.stats}
        if self.replicate_collectives is not None:
            self._comm_stats["replicate"] = self.replicate_collectives.stats
        if local_world_size is None:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.local_world_size = local_world_size
        self.offload: OptimizerOffload | None = None
        self.cpu_threads: int | None = None
        if config.offload_optimizer:
            # ranks on one host share its cores: each steps its shard with its own share (no oversubscription)
            self.cpu_threads = threads_per_rank(local_world_size)
            torch.set_num_threads(self.cpu_threads)

        self.optim = OptimizerSet(optimizer if isinstance(optimizer, Optimizer) else list(optimizer))
        _check_overlap(config, self.optim)
        _check_matrix(config, self.optim)
        # each optimizer's moment format (ZeroConfig.optimizer_state_dtype), refused here if it cannot keep it
        self.state_dtypes = self._state_dtypes(self.optim)
        self.original_groups = self.optim.original_groups()  # every optimizer's groups, numbered in one sequence
        self.sharded: ShardedUnits | None = None
        if config.stage == 3:
            self.flat_params, groups = self._build_units()
        else:
            self.flat_params, groups = self._build_buckets()
        self.optim.rewire(self.flat_params, groups)
        for opt, fmt in zip(self.optim.optimizers, self.state_dtypes):
            apply_state_dtype(opt, fmt)  # a CPUAdam; with offload, OffloadedAdam below is built in ``fmt``
        if not config.offload_optimizer:
            _replace_adam(self.optim, self.state_dtypes)  # CPUAdam on CPU masters, DeviceAdam on GPU masters
        self._shard_matrix_optimizers(self.optim)  # Muon: whole matrices on owner ranks
        # int8: the flat parameters of small parameters keep fp32 moments (zeroshard.optim.small_state)
        fp32_masters = self._fp32_state_masters(self.flat_params, groups)
        if config.offload_optimizer:
            device = self._device()
            self.offload = OptimizerOffload(
                self.flat_params,
                device=device,
                pin=device.type == "cuda",
                chunk_elems=config.offload_chunk_size,
                overlap_step=config.overlap_step,
                threads=self.cpu_threads,
            )
            self.optim.offload_adam(
                OffloadedAdam, self.state_dtypes, offload=self.offload, fp32_state_params=fp32_masters
            )
        # Adam/AdamW step through the offload pipeline; any other optimizer steps the host masters as it is
        self.pipelined = all(isinstance(opt, OffloadedAdam) for opt in self.optimizers)
        self.reducer = GradReducer(
            self.flat_params,
            self.collectives
            if self.replicate_collectives is None
            else HybridGradReduction(self.collectives, self.replicate_collectives),
            stage=config.stage,
            max_inflight=config.max_inflight_buckets,
            groups=self._reduction_groups(),
            on_complete=self.sharded.on_grads_complete if self.sharded else None,
            on_reduced=self.offload.gradient_reduced if self.offload else None,
            on_finished=self._on_backward_finished,
        )
        self.reducer.step_fn = lambda: self.steps
        self.reducer.check_finite = config.nonfinite != "ignore"
        self.skipped_steps = 0  # steps skipped for a non-finite gradient (nonfinite="skip")
        # parameters no rank used keep grad=None semantics, as under DDP (zeroshard.engine.unused_params)
        self.unused_params = UnusedParams(self)
        # the model's param.grad between backward and step, as under DDP (zeroshard.engine.module_grads)
        self.module_grads = ModuleGrads(self)
        register_engine(module, self)
        # load_pretrained() called on the meta model (or a submodule of it): each rank now reads only its shards' pieces
        self.pretrained_reports = apply_recorded_pretrained(self)

    def _shard_matrix_optimizers(self, optim: OptimizerSet) -> None:
        """Replaces each ``torch.optim.Muon`` by a :class:`~zeroshard.optim.sharded_muon.ShardedMuon` over its master
        shards (the strategies point LR schedulers at it, as for a replaced Adam); its all-to-alls are counted in
        ``comm_stats()["groups"]["matrix"]``."""
        for oi, opt in enumerate(optim.optimizers):
            if needs_whole_matrices(opt):
                stats = self._comm_stats.get("matrix")
                if stats is None:
                    stats = AllToAllStats(dist.get_backend(self.process_group), self.world_size)
                    self._comm_stats["matrix"] = stats
                optim.optimizers[oi] = ShardedMuon(opt, optim.flat_params_of(opt), self.process_group, stats)

    def _state_dtypes(self, optim: OptimizerSet) -> list:
        """The moment format of each optimizer of ``optim`` (:func:`resolve_state_dtype`; ValueError if one cannot)."""
        offload = self.config.offload_optimizer
        setting = self.config.optimizer_state_dtype
        return [resolve_state_dtype(setting, opt, offload, oi) for oi, opt in enumerate(optim.optimizers)]

    def _group_state_dtype(self, group_index: int):
        """The moment format of the optimizer that owns global param group ``group_index``."""
        return self.state_dtypes[self.optim.group_optimizer[group_index]]

    def _plan_state_dtype(self, plan: BucketPlan):
        """The moment format of a planned flat parameter: fp32 for one of small parameters set apart under int8."""
        return torch.float32 if plan.apart else self._group_state_dtype(plan.group_index)

    def _int8_thresholds(self) -> list[int | None]:
        """Per global param group: its optimizer's ``min_8bit_size`` where its moments are int8, else None."""
        opts, fmts = self.optim.optimizers, self.state_dtypes
        return [min_8bit_size_of(opts[oi]) if fmts[oi] == "int8" else None for oi in self.optim.group_optimizer]

    def _fp32_state_masters(self, flat_params: list[FlatParam], group_of_flat: list[int]) -> list[torch.Tensor]:
        """Under int8: tells each fused Adam which master shards keep fp32 moments (those of flat parameters of small
        parameters, :mod:`zeroshard.optim.small_state`) and returns them, for ``OffloadedAdam``; else ``[]``."""
        thresholds = self._int8_thresholds()
        masters = fp32_state_masters(flat_params, [thresholds[g] for g in group_of_flat])
        for opt, fmt in zip(self.optim.optimizers, self.state_dtypes):
            if fmt == "int8" and hasattr(opt, "keep_fp32_state"):
                opt.keep_fp32_state(masters)
        return masters

    def _flat_param(self, plan: BucketPlan, *, keep_full: bool, trainable: bool = True) -> FlatParam:
        offload = self.config.offload_optimizer
        device = plan.params[0].device
        return FlatParam(
            plan.names,
            plan.params,
            rank=self.rank,
            world_size=self.world_size,
            align_elems=self.config.align_elems(plan.params[0].element_size()),
            master_device=torch.device("cpu") if offload else device,
            pin_memory=offload and device.type == "cuda",
            offload=offload,
            host_shard=self.config.offload_params,
            keep_full=keep_full,
            trainable=trainable,
            compute_dtype=self.compute_dtype,
            reduce_dtype=self.reduce_dtype if trainable else None,
        )

    def _build_buckets(self) -> tuple[list[FlatParam], list[int]]:
        """Stages 1-2: buckets of ``reduce_bucket_size`` elements, parameters kept whole (meta models materialised)."""
        if has_meta(self.module):
            materialize_module_(self.module, self._device(), param_init_fn=self.config.param_init_fn)
            self.original_groups = [[replacement(p) for p in group] for group in self.original_groups]
        apart = apart_rule(self._int8_thresholds())
        plans, skipped = plan_buckets(self.module, self.original_groups, self.config.reduce_bucket_size, apart)
        self._check_offload_budget([(plan.params, True, self._plan_state_dtype(plan)) for plan in plans])
        if skipped:
            warnings.warn(
                f"{len(skipped)} trainable parameters are in no optimizer param group and stay unsharded with local "
                f"gradients: {skipped[:5]}{' ...' if len(skipped) > 5 else ''}",
                stacklevel=3,
            )
        self._broadcast(list(self.module.parameters()) + list(self.module.buffers()))
        flat = [self._flat_param(plan, keep_full=True) for plan in plans]
        if self.compute_dtype is not None:  # frozen and optimizer-less parameters compute in the same dtype
            bucketed = {id(p) for plan in plans for p in plan.params}
            with torch.no_grad():
                for p in self.module.parameters():
                    if id(p) not in bucketed and p.is_floating_point():
                        p.data = p.data.to(self.compute_dtype)
        return flat, [plan.group_index for plan in plans]

    def _build_units(self) -> tuple[list[FlatParam], list[int]]:
        """Stage 3: per unit, materialise (meta models), broadcast from rank 0, keep this rank's shard only.

        Meta modules are materialised by the plan of :mod:`zeroshard.init.init_plan` (``reset_parameters`` in
        ``module.modules()`` order, Hugging Face models in their eager order), so values equal an eager build with the
        same seed (see :mod:`zeroshard.meta_init`); each unit is flattened and sharded as soon as its last module is
        done, so no more than the root unit and one other unit are whole at a time.
        """
        apart = apart_rule(self._int8_thresholds())
        plans = plan_units(self.module, self.config.wrap_policy, self.original_groups, apart)
        self._check_offload_budget(
            [(b.params, True, self._plan_state_dtype(b)) for plan in plans for b in plan.buckets]
            + [(plan.frozen.params, False, torch.float32) for plan in plans if plan.frozen]
        )
        device = self._device()
        built: dict[int, Unit] = {}

        def build(i: int) -> None:
            plan = plans[i]
            for b in plan.buckets + ([plan.frozen] if plan.frozen else []):
                b.params = [replacement(p) for p in b.params]
            plan = plans[i]
            params = [p for b in plan.buckets for p in b.params] + (plan.frozen.params if plan.frozen else [])
            self._broadcast(params)
            fps = [self._flat_param(b, keep_full=False) for b in plan.buckets]
            if plan.frozen is not None:
                fps.append(self._flat_param(plan.frozen, keep_full=False, trainable=False))
            numel = sum(fp.numel for fp in fps)
            persistent = numel < self.config.param_persistence_threshold
            built[i] = Unit(plan.name, plan.module, fps, is_root=plan.module is self.module, persistent=persistent)

        if has_meta(self.module):
            unit_of = {id(m): i for i, plan in enumerate(plans) for m in plan.modules}
            left = [len({id(m) for m in plan.modules}) for plan in plans]
            steps = plan_init(self.module, self.config.param_init_fn)
            # a dry run on meta: every tensor initialised, no unit written after it was sharded; raises before any
            # allocation, naming every module at fault
            check_plan(self.module, steps, unit_of=unit_of, unit_names=[p.name or "<root>" for p in plans])

            def done(m: nn.Module) -> None:
                i = unit_of.get(id(m))
                if i is None:  # a wrapped module left with no parameters of its own (e.g. all tied to the root)
                    return
                left[i] -= 1
                if left[i] == 0:
                    build(i)

            run_plan(self.module, steps, device, on_module=done)
            check_no_meta(self.module)
            self.original_groups = [[replacement(p) for p in group] for group in self.original_groups]
        else:
            for i in range(len(plans)):
                build(i)
        self._broadcast(list(self.module.buffers()))
        units = [built[i] for i in range(len(plans))]
        # unit all-gathers on a group of their own: they only ever meet other ranks' all-gathers (see gather_check)
        if gather_check.ENABLED:
            self.gather_collectives = _C.BucketedCollectives(dedicated_group(self.process_group))
            self._comm_stats["shard_gather"] = self.gather_collectives.stats
        else:
            self.gather_collectives = self.collectives
        self.sharded = ShardedUnits(
            units,
            self.gather_collectives,
            prefetch=self.config.prefetch,
            check_gather_order=self.config.check_gather_order,
            prefetch_bucket_size=self.config.prefetch_bucket_elems,
        )
        # backward completes units in reverse forward order, the root (embeddings and head together) last
        ordered = [(b, fp) for i in reversed(range(len(units))) for b, fp in zip(plans[i].buckets, units[i].trainable)]
        self.sharded.bind_flat_params()
        self.sharded.attach_group(self.process_group, _comm_device(self.process_group))
        self.sharded.step_fn = lambda: self.steps
        return [fp for _, fp in ordered], [b.group_index for b, _ in ordered]

    def _reduction_groups(self) -> list[list[int]] | None:
        """Stage 3: the flat parameters of one unit (one per optimizer param group, consecutive in backward order)
        are reduced in one reduce-scatter while together they fit in ``reduce_bucket_size`` elements; stages 1-2
        reduce each bucket on its own (None)."""
        if self.sharded is None:
            return None
        groups: list[list[int]] = []
        prev, size = None, 0
        for fi, fp in enumerate(self.flat_params):
            unit = self.sharded.unit_of(fp)
            n = fp.layout.padded_numel
            if unit is prev and size + n <= self.config.reduce_bucket_size:
                groups[-1].append(fi)
                size += n
            else:
                groups.append([fi])
                prev, size = unit, n
        return groups

    def _check_offload_budget(self, flat: list[tuple[list[torch.Tensor], bool, object]]) -> None:
        """Offload: fails before anything is allocated if the host buffers of every local rank do not fit.
        ``flat``: ``(parameters, trainable, moment format)`` per flat parameter."""
        if not self.config.offload_optimizer:
            return
        world = self.world_size
        shards = [(-(-sum(p.numel() for p in params) // world), trainable, fmt) for params, trainable, fmt in flat]
        dtype = self.compute_dtype or (flat[0][0][0].dtype if flat else torch.float32)
        nbytes = host_bytes_needed(
            shards,
            grad_bytes=self.reduce_dtype.itemsize,
            param_bytes=dtype.itemsize,
            offload_params=self.config.offload_params,
            chunk_elems=self.config.offload_chunk_size,
        )
        check_host_budget(nbytes, self.local_world_size, f"zeroshard offload on rank {self.rank}")
        self.offload_host_bytes = nbytes

    def _device(self) -> torch.device:
        """The compute device: NCCL's current CUDA device, else the CPU."""
        return _comm_device(self.process_group)

    # -- training step ------------------------------------------------------------------------------------------------

    @property
    def require_grad_sync(self) -> bool:
        return self.reducer.require_grad_sync

    @require_grad_sync.setter
    def require_grad_sync(self, value: bool) -> None:
        """False during non-final micro-batches of gradient accumulation: gradients accumulate, nothing is reduced."""
        self.reducer.require_grad_sync = value

    def begin_step(self) -> None:
        """Before a training/validation step: stage 3 gathers the root unit (it stays until the end of backward)."""
        if self.sharded is not None:
            self.sharded.begin_step()

    def end_eval_step(self) -> None:
        """After a step without backward: stage 3 frees the root unit (and the last unit, if its forward kept it)."""
        if self.sharded is not None:
            self.sharded.end_eval_step()

    def finish_backward(self) -> None:
        """Completes the gradient reduction (idempotent; the autograd engine usually did it already)."""
        self.reducer.finish_backward()

    @torch.no_grad()
    def _on_backward_finished(self, synced: bool) -> None:
        """Adds each reduced gradient shard into its master's ``.grad`` (fp32, the master's device) and, at stage 3,
        frees every unit."""
        if self.sharded is not None:
            self.sharded.end_of_step()
        if synced:
            self._hand_gradients_to_masters()
            self._check_step_flags()
        self.module_grads.install(synced)

    def _check_step_flags(self) -> None:
        """One all-reduce of the non-finite flags and used-parameter bitmap (:mod:`zeroshard.engine.step_flags`), then
        unused parameters are kept out of the step and a non-finite gradient raises or skips the step (per
        ``config.nonfinite``) on every rank, before any master weight changes. Under fp16 loss scaling the scaler's
        overflow check handles it (the same flag: it skips the step everywhere)."""
        bad, used = self.reducer.take_flags()
        if self.reducer.check_finite:
            bad = confirm_nonfinite(bad, self.flat_params, self._local_gradient)
        world = self.groups.world
        sizes = [len(fp.params) for fp in self.flat_params]
        flags = exchange_flags(bad, used, sizes, world, _comm_device(world), step=self.steps)
        self.unused_params.backward_done(flags.unused)
        if flags.first_nonfinite is None or self.config.nonfinite == "ignore" or loss_scaling_pending():
            return
        # no optimizer may use these gradients: drop them all (a step then changes nothing), then raise or skip
        for fp in self.flat_params:
            fp.master.grad = None
        if self.offload is not None:
            self.offload.gradients_consumed()
        self.unused_params.step_done(self.flat_params)
        fp = self.flat_params[flags.first_nonfinite]
        if nonfinite_found(
            self.config.nonfinite, self.steps, flags.first_nonfinite, fp.names, fp.numel, self.config.overlap_step
        ):
            self.skipped_steps += 1

    def _hand_gradients_to_masters(self) -> None:
        if self.offload is not None and self.sharded is not None:
            self.sharded.wait_param_copies()  # backward's gathers may still read the host shards the step writes
        for fp in self.flat_params:
            if self.offload is None:  # without offload the master lives with its gradient shard
                grad = fp.grad_shard
                fp.release_grad_shard()  # handed over: the next backward reduces into a fresh shard
            elif isinstance(self.optim.optimizer_of(fp), OffloadedAdam):
                continue  # OffloadedAdam reads the host gradient shard in its step, chunk by chunk
            else:  # another optimizer reads .grad: wait for the copy, fp32 as .grad must be
                grad = self.offload.take_gradient(fp)
            master = fp.master
            if grad is None or not master.requires_grad:
                continue  # a master toggled off (toggle_optimizer) gets no gradient, as under DDP
            if master.grad is None:
                master.grad = grad
            else:
                master.grad.add_(grad)

    def _local_gradient(self, fp: FlatParam) -> torch.Tensor | None:
        """This rank's reduced gradient shard of ``fp`` as the step will read it (``None`` if it has none)."""
        if fp.master is not None and fp.master.grad is not None:
            return fp.master.grad
        if self.offload is not None and self.offload.has_gradient(fp):
            return self.offload.wait_for_gradients([fp])[0]
        return None

    def adopt_optimizers(self, optimizers: Sequence[Optimizer]) -> bool:
        """Takes ``optimizers`` in place of the :class:`~zeroshard.optim.sharded_optimizer.PendingOptimizer` this
        engine was built with: a model set up before its optimizer existed (Fabric's ``setup_module`` then
        ``setup_optimizers``, LitGPT's order). Their parameters may be the module's placeholders (stage 3).

        Returns ``False``, changing nothing, when their param groups do not fit the flat parameters already built
        (each flat parameter's parameters in one group, every trainable parameter of the groups in a flat parameter):
        the caller then builds a new engine. Flat parameters never mix param groups, so no cheaper regrouping exists.

        Raises:
            ValueError: for several optimizers with ``overlap_step`` (as at construction), or a parameter in two.
        """
        new = OptimizerSet(list(optimizers))
        groups = [[real_parameter(p) for p in group] for group in new.original_groups()]
        group_of = {id(p): gi for gi, group in enumerate(groups) for p in group}
        group_of_flat = []
        for fp in self.flat_params:
            found = {group_of.get(id(p)) for p in fp.params}
            if len(found) != 1 or None in found:
                return False
            group_of_flat.append(found.pop())
        held = {id(p) for fp in self.flat_params for p in fp.params}
        if any(p.requires_grad and id(p) not in held for group in groups for p in group):
            return False
        _check_overlap(self.config, new)
        _check_matrix(self.config, new)
        state_dtypes = self._state_dtypes(new)
        self.optim, self.original_groups, self.state_dtypes = new, groups, state_dtypes
        new.rewire(self.flat_params, group_of_flat)
        for opt, fmt in zip(new.optimizers, state_dtypes):
            apply_state_dtype(opt, fmt)
        if self.offload is None:
            _replace_adam(new, state_dtypes)
        self._shard_matrix_optimizers(new)
        # flat parameters built for another optimizer: those of small parameters only keep fp32 moments under int8
        fp32_masters = self._fp32_state_masters(self.flat_params, group_of_flat)
        if self.offload is not None:
            new.offload_adam(OffloadedAdam, state_dtypes, offload=self.offload, fp32_state_params=fp32_masters)
        self.pipelined = all(isinstance(opt, OffloadedAdam) for opt in self.optimizers)
        self.module_grads.hook_optimizers()
        self.unused_params.hook_optimizers()
        return True

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers to step, in the order given at construction."""
        return self.optim.optimizers

    @property
    def optimizer(self) -> Optimizer:
        """The engine's only optimizer.

        Raises:
            RuntimeError: with several optimizers (use :attr:`optimizers`).
        """
        if len(self.optimizers) != 1:
            raise RuntimeError(f"this engine has {len(self.optimizers)} optimizers: use engine.optimizers")
        return self.optimizers[0]

    @torch.no_grad()
    def after_step(self, optimizer: Optimizer | None = None, clear_grads: bool = True) -> None:
        """After ``optimizer.step()``: clears that optimizer's gradients (as ``zero_grad(set_to_none=True)``;
        DeepSpeed's ``engine.step()`` does the same), writes its updated master shards into the parameter shards, and
        stages 1-2 all-gather them. ``None``: every optimizer (the only one, usually). ``clear_grads=False`` keeps the
        gradients until the optimizer's ``zero_grad()``, as a DDP parameter's ``.grad`` (the Trainer adapter: Lightning
        zeroes them before each backward, and a step without backward, as in SWA's batch-norm epoch, reuses them as
        under ``ddp``).

        Raises:
            ValueError: if ``optimizer`` is not one of :attr:`optimizers`.
        """
        stepped = self.optim.flat_params_of(optimizer)
        self.module_grads.clear(stepped)  # consumed by this step, as DDP's zero_grad would drop them
        self.reducer.consume()
        if self.sharded is not None:
            # units still gathered (written outside a step, or a step without backward) hold the old values: free them
            # (writing back only what was written to them) before the shards change
            self.sharded.reshard_all()
        if self.offload is not None:
            self.offload.gradients_consumed(stepped)
        for fp in stepped:
            if clear_grads:
                fp.master.grad = None
            if not isinstance(self.optim.optimizer_of(fp), OffloadedAdam):  # the pipeline wrote its shards already
                fp.load_master_into_shard()
        if self.sharded is not None:
            ids = {id(fp) for fp in stepped}
            for i, unit in enumerate(self.sharded.units):
                if unit.persistent and any(id(fp) in ids for fp in unit.flat_params):
                    self.sharded.reshard(i, force=True)  # gathered again, with the new values, at its next use
        self.unused_params.step_done(stepped)
        self._gather_full_params(stepped)
        for stats in self._comm_stats.values():
            stats.end_step()
        self.steps += 1

    def comm_stats(self) -> dict:
        """Bytes this rank sent through the engine's collectives, per kind (all-gather, reduce-scatter, all-reduce),
        for the last step (everything between the last two :meth:`after_step` calls), the open one and in total; per
        process group (``shard``, and ``replicate`` with hybrid sharding) and summed. See
        :mod:`zeroshard.sharding.comm_stats` for the fields (``bytes``: ring volume we ask of the process group;
        ``wire_bytes``: what gloo really sends).
        """
        return summarize(self._comm_stats)

    # -- global gradient norm -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips every optimizer's master gradients by their global norm across all shards; returns the norm before
        clipping. One optimizer: an :class:`~zeroshard.offload.offload.OffloadedAdam` folds the coefficient into its
        step (:func:`clip_master_grads_`). Gradients replaced on the model (``p.grad = t``) are written first."""
        self.module_grads.sync()
        if len(self.optimizers) == 1:
            return clip_master_grads_(self.optimizers[0], max_norm, norm_type, self.process_group, step=self.steps)
        grads = [g for opt in self.optimizers for g in master_gradients(opt)]
        return clip_grads_(grads, max_norm, norm_type, self.process_group, step=self.steps)

    # -- checkpoints --------------------------------------------------------------------------------------------------

    def optimizer_state_dict(self, optimizer: Optimizer | None = None) -> dict:
        """Consolidated state of ``optimizer`` (default: the only one) in torch's format on rank 0 (``{}``
        elsewhere), numbered as torch numbers that optimizer's parameters; collective."""
        oi = self.optim.index(optimizer or self.optimizer)
        return consolidated_state_dict(
            self.optimizers[oi],
            self.optim.flat_params_of(self.optimizers[oi]),
            self.original_groups[self.optim.group_slice(oi)],
            self.collectives,
        )

    def load_optimizer_state_dict(
        self, state_dict: dict, optimizer: Optimizer | None = None, source: str = "the optimizer state dict"
    ) -> None:
        """Loads a consolidated (or plain torch) state dict into ``optimizer`` (default: the only one); each rank keeps
        its shards. Checked first, or dropped with ``optimizer_state="reset"`` (:func:`load_consolidated_state_dict`;
        errors name ``source``)."""
        oi = self.optim.index(optimizer or self.optimizer)
        load_consolidated_state_dict(
            self.optimizers[oi],
            self.optim.flat_params_of(self.optimizers[oi]),
            self.original_groups[self.optim.group_slice(oi)],
            state_dict,
            self.config.optimizer_state,
            source,
        )

    def check_optimizer_state_dict(
        self, state_dict: dict, optimizer: Optimizer | None = None, source: str = "the optimizer state dict"
    ) -> None:
        """Checks, changing nothing, what :meth:`load_optimizer_state_dict` would load (nothing with
        ``optimizer_state="reset"``), so that a checkpoint is refused before its weights load.

        Raises:
            OptimizerRestoreError (a ``ValueError``): naming ``source``, the group, the key and the value.
        """
        if self.config.optimizer_state == "reset":
            return
        oi = self.optim.index(optimizer or self.optimizer)
        check_consolidated_state_dict(self.optimizers[oi], self.original_groups[self.optim.group_slice(oi)], state_dict,
                                      source)  # fmt: skip

    @torch.no_grad()
    def after_params_loaded(self) -> None:
        """Refreshes master shards after the module's parameters were overwritten (e.g. ``load_state_dict``)."""
        for fp in self.flat_params:
            fp.load_shard_into_master()

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        self.module_grads.remove_hooks()
        self.unused_params.remove_hooks()
        if self.sharded is not None:
            self.sharded.remove_hooks()

    # -- full parameters ----------------------------------------------------------------------------------------------

    @contextmanager
    def gathered(self, writeback: bool = True) -> Iterator[None]:
        """Every parameter whole on this rank for the duration (stage 3 gathers all units; collective). With
        ``writeback``, what this rank wrote into them goes back into its shards (and fp32 masters) on exit.

        On exit only the units this call gathered are freed: inside a training step the root unit (and any unit a
        forward left gathered for its backward) stays as the step needs it; nested calls keep the outer one's."""
        sharded = self.sharded
        if sharded is None:
            yield
            return
        sharded.release_accessed()
        before = [unit.is_gathered or unit.pending is not None for unit in sharded.units]
        pinned = sharded.pinned
        with sharded.activity("gathered_parameters()"):
            sharded.unshard_all()
        if writeback:
            for unit in sharded.units:
                sharded.may_write(unit)
        sharded.pinned = True
        try:
            yield
        finally:
            sharded.pinned = pinned
            for i, was_gathered in enumerate(before):
                if not was_gathered:
                    sharded.reshard(i)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()`` as CPU copies on rank 0 (``{}`` elsewhere); collective.

        Stage 3 gathers one unit at a time, so no rank ever holds more than one unit whole on its device.
        """
        refs = self.module.state_dict(keep_vars=True)  # references only: no data is read
        out: dict[str, torch.Tensor] = {}
        if self.sharded is not None:
            keys_of: dict[int, list[str]] = {}
            for k, v in refs.items():
                keys_of.setdefault(id(real_parameter(v)), []).append(k)
            for i, unit in enumerate(self.sharded.units):
                self.sharded.unshard(i, reason="the full state dict (gathered unit by unit to rank 0)")
                if self.rank == 0:
                    for fp in unit.flat_params:
                        for p in fp.params:
                            for k in keys_of.get(id(p), []):
                                out[k] = p.detach().cpu().clone()
                self.sharded.reshard(i)
        if self.rank != 0:
            return {}
        return {k: out[k] if k in out else v.detach().cpu().clone() for k, v in refs.items()}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Loads a full state dict; stage 3 gathers one unit at a time and keeps only this rank's shard.

        Raises:
            KeyError: (``strict``) naming missing and unexpected keys, before anything is written.
        """
        if self.sharded is None:
            self.module.load_state_dict(state_dict, strict=strict)
            self.after_params_loaded()
            return
        refs = self.module.state_dict(keep_vars=True)
        missing, unexpected = sorted(set(refs) - set(state_dict)), sorted(set(state_dict) - set(refs))
        if strict and (missing or unexpected):
            raise KeyError(f"state dict mismatch: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
        key_of = {id(real_parameter(v)): k for k, v in refs.items() if k in state_dict}
        self.sharded.release_accessed()
        for i, unit in enumerate(self.sharded.units):
            self.sharded.unshard(i, reason="loading a full state dict")
            for fp in unit.flat_params:
                for p in fp.params:
                    if id(p) in key_of:
                        p.data.copy_(state_dict[key_of[id(p)]])
                begin, end = fp.layout.shard_range(fp.rank)
                fp.shard.copy_(fp.full[begin:end])
                fp.load_shard_into_master()
            self.sharded.reshard(i)
        params = {id(p) for u in self.sharded.units for fp in u.flat_params for p in fp.params}
        for k, v in refs.items():
            if id(real_parameter(v)) not in params and k in state_dict:
                v.data.copy_(state_dict[k])

    # -- loading from per-parameter sources ------------------------------------------------------------------------

    @torch.no_grad()
    def load_shards_from(self, read: Callable[[str, int, int, torch.Tensor], bool]) -> None:
        """Fills this rank's parameter shards (and master shards) from a per-parameter source; collective.

        Each rank asks only for the pieces of each parameter that fall into its own shards, so it reads about 1/N of
        the source. ``read(name, start, end, out)`` copies elements ``[start, end)`` of parameter ``name`` (flattened,
        in its own dtype) into the 1-D tensor ``out`` (cast as needed) and returns False if the source lacks ``name``
        (the parameter keeps its current values). Stages 1-2 then all-gather the full parameters; stage 3 gathers
        them on use.
        """
        if self.sharded is not None:
            self.sharded.release_accessed()
        for fp in self.all_flat_params:
            # into the fp32 master when it is separate (mixed precision), so loading loses nothing to bf16 rounding
            separate = fp.master is not None and not fp.master_aliases_shard
            target = fp.master.detach() if separate else fp.shard
            for pi, p_off, s_off, n in fp.layout.shard_slices(fp.rank):
                read(fp.names[pi], p_off, p_off + n, target[s_off : s_off + n])
            if separate:
                fp.load_master_into_shard()
            if self.sharded is not None:
                fp.is_gathered = False
                fp.free_full()
        self._gather_full_params()

    @property
    def all_flat_params(self) -> list[FlatParam]:
        """Every flat parameter, frozen ones included, in a fixed order (units at stage 3, buckets at stages 1-2)."""
        return [fp for u in self.sharded.units for fp in u.flat_params] if self.sharded else list(self.flat_params)

    def _gather_full_params(self, flat_params: list[FlatParam] | None = None) -> None:
        """Stages 1-2: every rank's shards into the full buffers of ``flat_params`` (default: all; bucketed
        all-gather); stage 3 gathers on use."""
        flat_params = self.flat_params if flat_params is None else flat_params
        if self.sharded is None and flat_params:
            with self._named("parameter all-gather", lambda: f"{len(flat_params)} buckets after the optimizer step"):
                self.collectives.all_gather(
                    [fp.shard for fp in flat_params],
                    [fp.full for fp in flat_params],
                    self.config.allgather_bucket_size,
                ).wait()

    def _named(self, collective: str, what):
        """Re-raises a failure of the block as a CollectiveError naming ``collective``, ``what``, step and rank."""
        return named_collective(collective, what, step=self.steps, rank=self.rank, world_size=self.world_size)

    def unsharded_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Parameters no flat parameter holds (frozen or optimizer-less ones at stages 1-2): whole on every rank."""
        held = {id(p) for fp in self.all_flat_params for p in fp.params}
        return [(n, p) for n, p in self.module.named_parameters() if id(real_parameter(p)) not in held]

    # -- helpers ------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values to every rank, as DDP does at construction."""
        if dist.get_world_size(self.groups.world) == 1:
            return
        for t in tensors:  # over every data-parallel rank: replicas must start equal too
            dist.broadcast(t.data, group=self.groups.world, group_src=0)

    def memory_summary(self) -> dict[str, int]:
        """Bytes of model state this rank holds, by kind: ``params`` (whole at stages 1-2, shards at 3), ``master``
        (fp32 copies that do not alias the parameter shards), ``grads`` (shards, plus full buffers alive at the
        time), ``optimizer_state``. Trainable flat parameters only."""
        out = {"params": 0, "master": 0, "grads": 0, "optimizer_state": 0}
        for fp in self.flat_params:
            held = fp.full if fp.keep_full else fp.shard
            out["params"] += held.numel() * held.element_size()
            if not fp.master_aliases_shard:
                out["master"] += fp.master.numel() * 4
            out["grads"] += fp.layout.shard_numel * 4  # the fp32 gradient shard
            if fp.full_grad is not None:  # stage 1 keeps its full gradient buffer between steps
                out["grads"] += fp.full_grad.numel() * fp.full_grad.element_size()
            for v in self.optim.optimizer_of(fp).state.get(fp.master, {}).values():
                if torch.is_tensor(v):
                    out["optimizer_state"] += v.numel() * v.element_size()
        return out


def _check_overlap(config: ZeroConfig, optim: OptimizerSet) -> None:
    if config.overlap_step and len(optim.optimizers) > 1:
        raise ValueError(
            "ZeroStrategy(overlap_step=True) steps buckets during backward, which needs one optimizer; got "
            f"{len(optim.optimizers)} (a loop that steps only some of them, like a GAN's, cannot know "
            "during backward which will step). Drop overlap_step, or use one optimizer with several param groups."
        )


def _check_matrix(config: ZeroConfig, optim: OptimizerSet) -> None:
    """A matrix optimizer (Muon) never receives flat shards: refused here unless it has a whole-matrix path."""
    check_matrix_optimizers(
        optim.optimizers,
        stage=config.stage,
        offload_optimizer=config.offload_optimizer,
    )


def master_gradients(optimizer: Optimizer) -> list[torch.Tensor]:
    """This rank's gradient shards for ``optimizer``'s parameters: the host gradient shards of an
    :class:`~zeroshard.offload.offload.OffloadedAdam` (waiting for their copies), else each parameter's ``.grad``."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer wraps it
    if isinstance(optimizer, OffloadedAdam):
        return optimizer.gradients()
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


@torch.no_grad()
def _replace_adam(optim: OptimizerSet, state_dtypes: list) -> None:
    """Without offload: each Adam the format or the masters' device needs instead of the user's
    (:func:`~zeroshard.optim.engine_state_format.adam_class_without_offload`)."""
    classes = [
        adam_class_without_offload(opt, fmt, optim.master_device(oi))
        for oi, (opt, fmt) in enumerate(zip(optim.optimizers, state_dtypes))
    ]
    optim.replace_adam(classes, state_dtypes)


def clip_master_grads_(
    optimizer: Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
    *,
    step: int | None = None,
) -> torch.Tensor:
    """Clips ``optimizer``'s master gradients by their global norm (:func:`clip_grads_`); returns the norm.

    An :class:`~zeroshard.offload.offload.OffloadedAdam` keeps the coefficient and multiplies by it in its next step,
    and the norm accounts for an fp16 unscale it was handed the same way: no pass over the host gradients for either.
    """
    opt = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer wraps it
    if isinstance(opt, OffloadedAdam):
        grads = opt.gradients()
        return clip_grads_(
            grads, max_norm, norm_type, group, prescale=opt.grad_unscale, apply=opt.fold_grad_clip, step=step
        )
    return clip_grads_(master_gradients(optimizer), max_norm, norm_type, group, step=step)


@torch.no_grad()
def clip_grad_norm_(
    shards: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clips the ``.grad`` of ``shards`` (see :func:`clip_grads_`)."""
    return clip_grads_([s.grad for s in shards if s.grad is not None], max_norm, norm_type, group)


@torch.no_grad()
def clip_grads_(
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
    *,
    prescale: float = 1.0,
    apply: Callable[[torch.Tensor], None] | None = None,
    step: int | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients sharded across ``group``.

    Each rank holds a disjoint part of the gradients (padding is zero), so the global 2-norm is the square root of the
    all-reduced sum of the local sums of squares (inf-norm: the all-reduced max). Clipping then scales every shard by
    ``min(1, max_norm / (norm + 1e-6))``, as torch does.

    Args:
        grads: this rank's gradient shards (any device and floating dtype), scaled in place.
        max_norm: the largest allowed global norm.
        norm_type: 2.0 or ``inf``.
        prescale: a factor still to be applied to the gradients (a power of two: fp16's ``1 / loss_scale``); the
            norm is that of the scaled gradients.
        apply: called with the coefficient (0-dim fp32) instead of scaling ``grads`` in place.
        step: the optimizer step, named if the all-reduce fails.

    Returns:
        The global norm before clipping, a 0-dim fp32 tensor on the first gradient's device (CPU if none).

    Raises:
        ValueError: for another ``norm_type``.
        CollectiveError: the all-reduce failed or timed out (naming it, the step and the rank).
    """
    device = grads[0].device if grads else torch.device("cpu")
    backend_device = _comm_device(group)
    if norm_type == 2.0:
        local = torch.zeros((), dtype=torch.float64, device=backend_device)
        for g in grads:
            local += g.double().pow(2).sum().to(backend_device)
        with _named_norm_all_reduce(group, step):
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local.sqrt().float()
    elif norm_type == float("inf"):
        local = torch.zeros((), dtype=torch.float32, device=backend_device)
        for g in grads:
            local = torch.maximum(local, g.abs().max().float().to(backend_device))
        with _named_norm_all_reduce(group, step):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        raise ValueError(f"clip_grad_norm_(norm_type={norm_type}) is not supported: use 2.0 or inf")
    if prescale != 1.0:
        total = total * prescale  # exact for a power of two
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if apply is not None:
        apply(clip_coef)
        return total.to(device)
    for g in grads:
        g.mul_(clip_coef.to(g.device))
    return total.to(device)


def _named_norm_all_reduce(group: dist.ProcessGroup | None, step: int | None):
    return named_collective(
        "gradient-norm all-reduce",
        "every rank's gradient-shard norm",
        step=step,
        rank=dist.get_rank(group),
        world_size=dist.get_world_size(group),
    )


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""ZeroStrategy: zeroshard's ZeRO engine as a strategy for ``lightning.Trainer`` (the Trainer adapter).

It subclasses Lightning's ``DDPStrategy`` for everything that is not ZeRO: the launcher (``devices=N`` re-runs the
script per rank, or ``torchrun`` sets the ranks), process-group set-up (gloo on CPU, NCCL on CUDA), the distributed
sampler, ``self.log(..., sync_dist=True)``, barriers and broadcasts. Instead of wrapping the model in
``DistributedDataParallel`` it has its :class:`~zeroshard.strategies.strategy_core.StrategyCore` build a
:class:`~zeroshard.engine.engine.ZeroEngine` over the LightningModule and the optimizers from ``configure_optimizers``
(the same place Lightning's ``DeepSpeedStrategy`` builds its engine). :class:`zeroshard.ZeroFabricStrategy` is the same
core behind Fabric's API.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from zeroshard.checkpoint.sharded_checkpoint import is_sharded_checkpoint, load_sharded, save_sharded
from zeroshard.checkpoint.trainer_state import lightning_weights_only
from zeroshard.engine.config import ZeroConfig
from zeroshard.engine.engine import ZeroEngine
from zeroshard.meta_init import has_meta, materialize_module_
from zeroshard.pretrained import apply_recorded_whole
from zeroshard.sharding.managed import engine_of
from zeroshard.strategies.launcher import ZeroMultiProcessingLauncher
from zeroshard.strategies.precision import ZeroPrecision
from zeroshard.strategies.process_group import init_and_destroy_at_exit
from zeroshard.strategies.setup_checks import check_callbacks
from zeroshard.strategies.strategy_core import StrategyCore, broadcast_module_states, replace_optimizers
from zeroshard.strategies.strategy_settings import as_timeout, register_names

# ``tensor_init_context()`` called without an argument: Lightning's ``configure_model`` path (``trainer.init_module``
# passes ``empty_init`` explicitly).
_FROM_CONFIGURE_MODEL: Any = object()

_SHARDED_LOADED = "_zeroshard_sharded_checkpoint_loaded"


class ZeroStrategy(DDPStrategy):
    """ZeRO stage 1/2/3 data parallelism with optional CPU offload of the optimizer, for ``lightning.Trainer``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2))
        trainer = Trainer(accelerator="cuda", devices=8, strategy="zeroshard_stage_2_offload")

    Args:
        stage: ZeRO stage: 1 shards optimizer state and fp32 master weights; 2 also shards gradients; 3 also shards
            the parameters, all-gathered per unit on use (Rajbhandari et al. 2020, "ZeRO", section 5). ``"auto"``:
            the planner (:mod:`zeroshard.plan`) picks stage, offload and shard group size at setup, the fastest that
            fits this job's memory with a margin, and logs the choice and the runners-up (``strategy.auto_plan``).
        offload_optimizer: master weights and optimizer state in host memory, stepped by the fused CPU Adam in a
            pipeline with the copies (Adam/AdamW are converted; ZeRO-Offload, Ren et al. 2021;
            :mod:`zeroshard.offload.offload`).
            Each rank then uses ``cores / ranks per host`` CPU threads.
        offload_params: stage 3 with ``offload_optimizer``: parameter shards live in pinned host memory and are copied
            in just before their (prefetched) all-gather.
        offload_chunk_size: elements per chunk of the pipelined host step.
        overlap_step: with ``offload_optimizer``: step each bucket on the host as soon as its gradient arrives,
            during backward (:mod:`zeroshard.offload.overlap`); with ``gradient_clip_val`` or ``precision="16-mixed"``
            the step runs after backward instead, with clipping and unscaling folded into it.
        reduce_bucket_size: elements per gradient bucket (one collective each).
        allgather_bucket_size: elements per all-gather of updated parameters.
        max_inflight_buckets: gradient reductions in flight during backward.
        wrap_policy: stage 3 units: a module class (e.g. your transformer block), a tuple of classes, a parameter
            count threshold, or ``callable(name, module) -> bool``. Parameters outside every unit form the root unit.
        prefetch: stage 3: all-gather the next unit while the current one computes.
        prefetch_bucket_size: stage 3: a prefetch all-gathers the next units together, in one collective, while their
            sizes sum to at most this many elements (DeepSpeed's ``stage3_prefetch_bucket_size``); 0: one unit at a
            time. Default (None): 2,000,000, so small units share collectives and large ones keep their own.
        check_gather_order: stage 3 debug setting: after each backward, compare the units each rank gathered and
            raise naming the first one that differs (ranks that took different code paths).
        param_init_fn: initialises a module's own tensors when a model built on the meta device is materialised
            (default: ``reset_parameters()``).
        param_persistence_threshold: stage 3: units smaller than this many elements stay gathered (no collectives).
        reduce_dtype: dtype gradients are reduced in; default fp32 (``torch.bfloat16`` halves bf16-mixed traffic).
        shard_group_size: hybrid sharding: shard over groups of this many consecutive ranks (e.g. the GPUs of a node)
            and replicate across the groups; gradients are reduce-scattered in the group, then all-reduced across
            groups over the shard only (:mod:`zeroshard.sharding.hybrid`). Default: shard over every rank.
        device_mesh: instead of ``shard_group_size``, a 2-D ``(replicate, shard)`` ``DeviceMesh`` (FSDP2's HSDP form).
        nonfinite: a NaN/inf gradient on any rank, found after the reduction and before any master weight changes:
            ``"error"`` (default) raises ``NonFiniteGradientError`` on every rank, naming the step and the first
            bucket; ``"skip"`` skips the step on every rank with a warning (weights and optimizer state unchanged; the
            Trainer counts the step, as for an fp16 overflow skip); ``"ignore"`` steps as torch does. Under
            ``precision="16-mixed"`` the loss scaler's overflow skip handles it (:mod:`zeroshard.engine.step_flags`).
        plan_options: with ``stage="auto"``: ``margin`` (fraction of memory kept free, default 0.1), ``micro_batch``
            and ``seq_len`` (for the activation estimate), ``cluster`` (a :class:`zeroshard.plan.Cluster`).
        activation_checkpointing: a module class, tuple of classes or ``callable(name, module) -> bool``: those modules
            recompute their forward in backward (``torch.utils.checkpoint``, non-reentrant).
        offload_activations: keep the checkpointed modules' saved inputs in host memory (pinned on CUDA).
        state_dict_type: ``"sharded"`` (default): ``save_checkpoint`` writes a directory where each rank writes its own
            shards, atomically, loadable at any world size and stage with each rank reading only what it needs
            (:mod:`zeroshard.checkpoint.sharded_checkpoint`; ``python -m zeroshard.consolidate`` turns it into plain
            files). ``"full"``: one consolidated file (gathered unit by unit to rank 0's CPU), in torch's optimizer
            format.
        optimizer_state: (keyword, like every ``ZeroConfig`` field) ``"strict"`` (default): a checkpoint's optimizer
            state is checked before any state changes (class, param group keys, types, ranges, parameters per group)
            and refused, naming the file, group, key and value, when it does not fit; ``"reset"``: load the weights
            and start the optimizer fresh, warning with what was dropped (to resume with another optimizer;
            :mod:`zeroshard.optim.restore_checks`).
        optimizer_state_dtype: (keyword) how the Adam moments are kept on each rank's shards: ``torch.float32``
            (default, 8 bytes per parameter), ``torch.bfloat16`` (4) or ``"int8"`` (block-wise 8-bit, 2 + 8/2048;
            :mod:`zeroshard.optim.state_format`). Needs the fused Adam: ``zeroshard.optim.CPUAdam`` from
            ``configure_optimizers``, or torch's Adam/AdamW (stepped by ``OffloadedAdam``, ``CPUAdam`` or, on GPU
            master shards without offload, ``DeviceAdam``); any other optimizer is refused at setup
            (:mod:`zeroshard.optim.engine_state_format`). A bad value fails here. Unset with ``stage="auto"``: bf16
            or int8 when no configuration fits with fp32 moments (said in the log line of the choice).
        process_group_backend: ``"gloo"`` or ``"nccl"``; default by device.
        timeout: collective timeout, a ``timedelta`` or seconds (int/float); a rank that stops answering ends the job
            with an error after it.
        start_method: Lightning's launcher: ``"popen"`` (re-run the script per rank), ``"spawn"``, ``"fork"``.
        **aliases: Lightning's ``DeepSpeedStrategy``/``FSDPStrategy`` spellings with the same meaning:
            ``offload_parameters`` (= ``offload_params``), ``cpu_checkpointing`` (= ``offload_activations``),
            ``auto_wrap_policy`` (= ``wrap_policy``; a set of classes, ``ModuleWrapPolicy`` or
            ``partial(transformer_auto_wrap_policy, transformer_layer_cls=...)``), ``activation_checkpointing_policy``
            (= ``activation_checkpointing``), ``offload_optimizer_device="cpu"``, ``offload_params_device="cpu"``.
            Their other arguments (``cpu_offload``, ``sharding_strategy``, ``mixed_precision``, ...) raise an error
            naming the setting to use (:mod:`zeroshard.strategies.strategy_settings`).

    Several optimizers (a GAN with manual optimization) share one engine, each with the master shards of its own param
    groups; gradients behave as ``param.grad`` does under DDP (:class:`~zeroshard.engine.engine.ZeroEngine`), and
    ``toggle_optimizer`` works. After a ``bf16-mixed``/``16-mixed`` fit at stages 1-2 the module's parameters are fp32
    again (the master weights), as under DDP; at stage 3 they stay sharded in the compute dtype.

    Raises:
        ValueError: at construction, for an unknown stage or an impossible setting, naming it (and for a DeepSpeed/FSDP
            argument with no equivalent, naming ours); TypeError for an unknown argument.
        ValueError: when the Trainer is built, for a precision this version does not support.
    """

    strategy_name = "zeroshard"

    def __init__(
        self,
        stage: int | str = 2,
        offload_optimizer: bool = False,
        reduce_bucket_size: int = 25_000_000,
        allgather_bucket_size: int = 25_000_000,
        max_inflight_buckets: int = 2,
        *,
        offload_params: bool = False,
        offload_chunk_size: int = 4 * 1024 * 1024,
        overlap_step: bool = False,
        wrap_policy=None,
        prefetch: bool = True,
        prefetch_bucket_size: int | None = None,
        check_gather_order: bool = False,
        param_init_fn=None,
        reduce_dtype: torch.dtype | None = None,
        param_persistence_threshold: int = 0,
        shard_group_size: int | None = None,
        device_mesh=None,
        nonfinite: Literal["error", "skip", "ignore"] = "error",
        plan_options: dict | None = None,
        activation_checkpointing=None,
        offload_activations: bool = False,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **aliases: Any,
    ) -> None:
        self._core = StrategyCore(
            type(self).__name__,
            dict(
                stage=stage,
                offload_optimizer=offload_optimizer,
                offload_params=offload_params,
                offload_chunk_size=offload_chunk_size,
                overlap_step=overlap_step,
                reduce_bucket_size=reduce_bucket_size,
                allgather_bucket_size=allgather_bucket_size,
                max_inflight_buckets=max_inflight_buckets,
                wrap_policy=wrap_policy,
                prefetch=prefetch,
                prefetch_bucket_size=prefetch_bucket_size,
                check_gather_order=check_gather_order,
                param_init_fn=param_init_fn,
                reduce_dtype=reduce_dtype,
                param_persistence_threshold=param_persistence_threshold,
                shard_group_size=shard_group_size,
                device_mesh=device_mesh,
                nonfinite=nonfinite,
                plan_options=plan_options,
                activation_checkpointing=activation_checkpointing,
                offload_activations=offload_activations,
                state_dict_type=state_dict_type,
                **aliases,
            ),
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=as_timeout(type(self).__name__, timeout),
            start_method=start_method,
        )
        self._state_dict_type = self._core.state_dict_type

    @property
    def zero_config(self) -> ZeroConfig:
        return self._core.config

    @property
    def _engine(self) -> ZeroEngine | None:
        return self._core.engine

    @_engine.setter
    def _engine(self, engine: ZeroEngine | None) -> None:
        self._core.engine = engine

    # -- precision ----------------------------------------------------------------------------------------------------

    @property
    def precision_plugin(self) -> ZeroPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Accepts the plugin Lightning builds from ``Trainer(precision=...)`` and turns it into a ZeroPrecision."""
        self._precision_plugin = ZeroPrecision.from_lightning(
            plugin, Precision, MixedPrecision, "ZeroStrategy", "Trainer"
        )

    # -- setup and teardown -------------------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method != "popen":  # spawn/fork: stage 3 hands back a gathered state dict
            self._launcher = ZeroMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_distributed(self) -> None:
        init_and_destroy_at_exit(super().setup_distributed)

    def setup(self, trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device = self.root_device.type
        assert self.lightning_module is not None
        if not has_meta(self.lightning_module):
            self.model_to_device()  # a meta model is materialised on the device by the engine, unit by unit
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # several optimizers need manual optimization (Lightning checks it)
            self._build_engine()
        elif self._engine is None or self._engine.sharded is None:
            previous = engine_of(self.lightning_module)
            if previous is not None and previous.sharded is not None:
                self._engine = previous  # a model sharded by an earlier fit (another Trainer): its shards serve
            else:
                self._engine = None
                if has_meta(self.lightning_module):  # validate/test/predict with no fit: whole parameters everywhere
                    materialize_module_(
                        self.lightning_module, self.root_device, param_init_fn=self.zero_config.param_init_fn
                    )
                    apply_recorded_whole(self.lightning_module)  # zeroshard.load_pretrained called on the meta model
                self._sync_module_states()
        # else: a stage-3 engine from an earlier fit keeps serving validate/test/predict with sharded parameters
        self.setup_precision_plugin()

    def _build_engine(self) -> None:
        assert self.lightning_module is not None
        optimizers = [self._unwrap(opt) for opt in self.optimizers]
        trainer = self.lightning_module.trainer
        engine = self._core.build_engine(
            self.lightning_module,
            optimizers,
            compute_dtype=self.precision_plugin.compute_dtype,
            local_world_size=self.num_processes,
            device=self.root_device.type,
            grad_accum=trainer.accumulate_grad_batches if trainer is not None else 1,
        )
        if trainer is not None:
            check_callbacks(type(self).__name__, engine.config.stage, trainer.callbacks)
        self.precision_plugin.grad_norm_group = engine.process_group  # the shards' group, one replica of the state
        self.precision_plugin.module_grads = engine.module_grads
        if engine.offload is not None:  # clip coefficient / fp16 overflow are global: no bucket steps before them
            engine.offload.global_scale_expected = (
                trainer is not None and bool(trainer.gradient_clip_val)
            ) or self.precision_plugin.scaler is not None
        if any(new is not old for new, old in zip(engine.optimizers, optimizers)):
            replace_optimizers(
                optimizers, engine.optimizers, [config.scheduler for config in self.lr_scheduler_configs]
            )
            self.optimizers = list(engine.optimizers)

    @property
    def auto_plan(self) -> dict | None:
        """With ``stage="auto"``: the planner's report of the configuration chosen at setup (``choice``,
        ``runners_up``, every row, ``message``); ``None`` before setup or with a fixed stage."""
        return self._core.auto_plan

    def _sync_module_states(self) -> None:
        assert self.lightning_module is not None
        broadcast_module_states(self.lightning_module)

    def teardown(self) -> None:
        # The engine stays so that `trainer.save_checkpoint` after `fit` still finds the sharded optimizer state. At
        # stage 3 its gather hooks stay too: the parameters exist only as shards, and validate/test use them.
        if self._engine is not None and self._engine.sharded is None:
            self._engine.remove_hooks()
            # stages 1-2 after fit: the module's parameters in their own dtype again, as under DDP
            trainer = getattr(self.lightning_module, "_trainer", None)
            if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                self._core.restore_full_precision()
        module = self._lightning_module
        if module is not None and (has_meta(module) or (self._engine is not None and self._engine.sharded)):
            # Lightning's teardown moves the module to the CPU. A model still (partly) on meta after a failed setup
            # cannot be copied (that second error would hide the first), and a stage-3 model lives in the engine's
            # shards: leave both where they are.
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        super().teardown()

    @property
    def engine(self) -> ZeroEngine | None:
        """The engine built at ``fit`` setup (``None`` before, and outside fitting)."""
        return self._engine

    # -- training step ------------------------------------------------------------------------------------------------

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skips gradient communication for the non-final micro-batches of gradient accumulation."""
        with self._core.no_backward_sync():
            yield

    def tensor_init_context(self, empty_init: bool | None = _FROM_CONFIGURE_MODEL):
        """Builds on the meta device with ``trainer.init_module(empty_init=True)``, and for ``configure_model`` at
        stage 3 (each rank then allocates only its shards); otherwise Lightning's default. Under ``configure_model``
        the values equal the eager build's; under ``empty_init=True`` modules get their ``reset_parameters()`` at setup
        (Lightning's meaning of empty init, FSDP's behaviour), see :meth:`StrategyCore.meta_init_context`.

        This replaces a ``model_sharded_context`` override: Lightning warns in ``trainer.init_module`` for any strategy
        that has one ("cannot fully support proper instantiation"), while ``init_module(empty_init=True)`` is fully
        supported here: the engine materialises the meta model unit by unit at setup.
        """
        if empty_init is _FROM_CONFIGURE_MODEL:
            if self.zero_config.stage == 3:
                return self._core.meta_init_context()
            empty_init = None
        if empty_init:
            return self._core.meta_init_context(empty_init=True)
        return super().tensor_init_context(empty_init)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the engine's shards (any stage, either format), so the engine must exist first."""
        return True

    def training_step(self, *args: Any, **kwargs: Any):
        if self._engine is not None:
            self._engine.begin_step()
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        return self._eval_step(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        return self._eval_step(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        return self._eval_step(super().predict_step, *args, **kwargs)

    def _eval_step(self, step, *args: Any, **kwargs: Any):
        if self._engine is None:
            return step(*args, **kwargs)
        self._engine.begin_step()
        try:
            return step(*args, **kwargs)
        finally:
            self._engine.end_eval_step()

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        pass

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self._engine is not None:
            self._engine.finish_backward()

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._engine is not None:
            self._engine.after_step(self._unwrap(optimizer), clear_grads=False)  # Lightning calls zero_grad
        return output

    # -- checkpoints --------------------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self._state_dict_type == "sharded" and self._engine is not None:
            if storage_options is not None:
                raise TypeError("ZeroStrategy(state_dict_type='sharded') does not take storage_options")
            trainer_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            save_sharded(self._engine, self.broadcast(str(filepath)), trainer_state)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        weights_only = lightning_weights_only(weights_only)  # Lightning 2.6 drops it when restoring after setup
        if is_sharded_checkpoint(checkpoint_path):  # any directory: one that is no checkpoint gets a clear error
            if self._engine is None:  # validate/test/predict on a fresh Trainer: the whole model, on every rank
                # Imported here: if importing zeroshard imported the CLI module, `python -m zeroshard.consolidate`
                # would warn that it was imported before it ran.
                from zeroshard.consolidate import lightning_checkpoint

                return lightning_checkpoint(checkpoint_path, weights_only=weights_only)
            state = load_sharded(self._engine, checkpoint_path, weights_only=weights_only)
            return {**state, "state_dict": {}, "optimizer_states": [], _SHARDED_LOADED: True}
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._check_optimizer_states(checkpoint, checkpoint_path)
        return checkpoint

    def _check_optimizer_states(self, checkpoint: Mapping[str, Any], path) -> None:
        """A fit restores the optimizers after the model: their saved state is checked first, so that a checkpoint
        whose optimizer state does not fit changes nothing (:mod:`zeroshard.optim.restore_checks`)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        states = checkpoint.get("optimizer_states")
        if self._engine is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        if not isinstance(states, list) or len(states) != len(self._engine.optimizers):
            return  # load_optimizer_state_dict (or Lightning) says what is wrong, when it gets there
        for i, (state, optimizer) in enumerate(zip(states, self._engine.optimizers)):
            self._engine.check_optimizer_state_dict(state, optimizer, f"checkpoint {path}, optimizer_states[{i}]")

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full parameters and buffers as CPU copies on rank 0 (``{}`` elsewhere); stage 3 gathers unit by unit."""
        assert self.lightning_module is not None
        if self._engine is not None and self._state_dict_type == "sharded":
            return {}  # each rank writes its own shards in save_checkpoint
        if self._engine is not None:
            return self._engine.full_state_dict()
        if not self.is_global_zero:
            return {}
        return {k: v.detach().cpu().clone() for k, v in self.lightning_module.state_dict().items()}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Consolidated optimizer state in torch's format (rank 0); collective, every rank must call it."""
        optimizer = self._unwrap(optimizer)
        if self._engine is not None and any(optimizer is opt for opt in self._engine.optimizers):
            if self._state_dict_type == "sharded":
                return {}
            return self._engine.optimizer_state_dict(optimizer)
        return super().optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        if checkpoint.get(_SHARDED_LOADED):
            return
        if self._engine is not None:
            self._engine.load_full_state_dict(checkpoint["state_dict"], strict=strict)
        else:
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if checkpoint.get(_SHARDED_LOADED):
            return
        if self._engine is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        states = checkpoint["optimizer_states"]
        if len(states) != len(self._engine.optimizers):
            raise ValueError(
                f"the checkpoint holds {len(states)} optimizer states, configure_optimizers returned "
                f"{len(self._engine.optimizers)} optimizers: build the same optimizers as the run that saved it"
            )
        path = getattr(getattr(self.lightning_module, "_trainer", None), "ckpt_path", None)  # named in errors
        for i, (state, optimizer) in enumerate(zip(states, self._engine.optimizers)):
            source = f"checkpoint {path or '(path unknown)'}, optimizer_states[{i}]"
            self._engine.load_optimizer_state_dict(state, optimizer, source=source)

    @staticmethod
    def _unwrap(optimizer: Optimizer) -> Optimizer:
        return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

    # -- registry -----------------------------------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Registers :data:`zeroshard.strategies.strategy_settings.REGISTERED_NAMES` (``zeroshard_stage_{1,2,3}``,
        ``zeroshard_stage_{2,3}_offload``: optimizer offload, ``zeroshard_stage_3_offload_params``: optimizer and
        parameter offload)."""
        register_names(cls, strategy_registry)

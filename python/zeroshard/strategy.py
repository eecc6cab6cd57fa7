"""ZeroStrategy: zeroshard's ZeRO engine as a Lightning strategy.

It subclasses Lightning's ``DDPStrategy`` for everything that is not ZeRO: the launcher (``devices=N`` re-runs the
script per rank, or ``torchrun`` sets the ranks), process-group set-up (gloo on CPU, NCCL on CUDA), the distributed
sampler, ``self.log(..., sync_dist=True)``, barriers and broadcasts. Instead of wrapping the model in
``DistributedDataParallel`` it builds a :class:`~zeroshard.engine.ZeroEngine` over the LightningModule and the optimizer
from ``configure_optimizers`` (the same place Lightning's ``DeepSpeedStrategy`` builds its engine).
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

from zeroshard.activation_checkpointing import apply_activation_checkpointing
from zeroshard.config import ZeroConfig
from zeroshard.engine import ZeroEngine
from zeroshard.meta_init import has_meta, init_meta_context
from zeroshard.precision import ZeroPrecision
from zeroshard.sharded_checkpoint import is_sharded_checkpoint, load_sharded, save_sharded

_SHARDED_LOADED = "_zeroshard_sharded_checkpoint_loaded"


class ZeroStrategy(DDPStrategy):
    """ZeRO stage 1/2/3 data parallelism with optional CPU offload of the optimizer, for ``lightning.Trainer``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2))
        trainer = Trainer(accelerator="cuda", devices=8, strategy="zeroshard_stage_2_offload")

    Args:
        stage: ZeRO stage: 1 shards optimizer state and fp32 master weights; 2 also shards gradients; 3 also shards
            the parameters, all-gathered per unit on use (Rajbhandari et al. 2020, "ZeRO", section 5).
        offload_optimizer: master weights and optimizer state in host memory, stepped by the fused CPU Adam in a
            pipeline with the copies (Adam/AdamW are converted; ZeRO-Offload, Ren et al. 2021;
            :mod:`zeroshard.offload`).
            Each rank then uses ``cores / ranks per host`` CPU threads.
        offload_params: stage 3 with ``offload_optimizer``: parameter shards live in pinned host memory and are copied
            in just before their (prefetched) all-gather.
        offload_chunk_size: elements per chunk of the pipelined host step.
        reduce_bucket_size: elements per gradient bucket (one collective each).
        allgather_bucket_size: elements per all-gather of updated parameters.
        max_inflight_buckets: gradient reductions in flight during backward.
        wrap_policy: stage 3 units: a module class (e.g. your transformer block), a tuple of classes, a parameter
            count threshold, or ``callable(name, module) -> bool``. Parameters outside every unit form the root unit.
        prefetch: stage 3: all-gather the next unit while the current one computes.
        check_gather_order: stage 3 debug setting: after each backward, compare the units each rank gathered and
            raise naming the first one that differs (ranks that took different code paths).
        param_init_fn: initialises a module's own tensors when a model built on the meta device is materialised
            (default: ``reset_parameters()``).
        param_persistence_threshold: stage 3: units smaller than this many elements stay gathered (no collectives).
        reduce_dtype: dtype gradients are reduced in; default fp32 (``torch.bfloat16`` halves bf16-mixed traffic).
        activation_checkpointing: a module class, tuple of classes or ``callable(name, module) -> bool``: those modules
            recompute their forward in backward (``torch.utils.checkpoint``, non-reentrant).
        offload_activations: keep the checkpointed modules' saved inputs in host memory (pinned on CUDA).
        state_dict_type: ``"sharded"`` (default): ``save_checkpoint`` writes a directory where each rank writes its own
            shards, atomically, loadable at any world size and stage with each rank reading only what it needs
            (:mod:`zeroshard.sharded_checkpoint`; ``python -m zeroshard.consolidate`` turns it into plain files).
            ``"full"``: one consolidated file (gathered unit by unit to rank 0's CPU), in torch's optimizer format.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default by device.
        timeout: collective timeout; a rank that stops answering ends the job with an error after it.
        start_method: Lightning's launcher: ``"popen"`` (re-run the script per rank), ``"spawn"``, ``"fork"``.

    Raises:
        ValueError: at construction, for an unknown stage or an impossible setting, naming it.
        ValueError: when the Trainer is built, for a precision this version does not support.
        RuntimeError: at setup, if ``configure_optimizers`` returns more than one optimizer.
    """

    strategy_name = "zeroshard"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        reduce_bucket_size: int = 25_000_000,
        allgather_bucket_size: int = 25_000_000,
        max_inflight_buckets: int = 2,
        *,
        offload_params: bool = False,
        offload_chunk_size: int = 4 * 1024 * 1024,
        wrap_policy=None,
        prefetch: bool = True,
        check_gather_order: bool = False,
        param_init_fn=None,
        reduce_dtype: torch.dtype | None = None,
        param_persistence_threshold: int = 0,
        activation_checkpointing=None,
        offload_activations: bool = False,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.zero_config = ZeroConfig(
            stage=stage,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            offload_chunk_size=offload_chunk_size,
            reduce_bucket_size=reduce_bucket_size,
            allgather_bucket_size=allgather_bucket_size,
            max_inflight_buckets=max_inflight_buckets,
            wrap_policy=wrap_policy,
            prefetch=prefetch,
            check_gather_order=check_gather_order,
            param_init_fn=param_init_fn,
            reduce_dtype=reduce_dtype,
            param_persistence_threshold=param_persistence_threshold,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._engine: ZeroEngine | None = None
        if activation_checkpointing is None and offload_activations:
            raise ValueError(
                "ZeroStrategy(offload_activations=True) needs activation_checkpointing=<module class or policy>."
            )
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"ZeroStrategy(state_dict_type={state_dict_type!r}) must be 'full' or 'sharded'.")
        self._state_dict_type = state_dict_type
        self._activation_checkpointing = activation_checkpointing
        self._offload_activations = offload_activations

    # -- precision ----------------------------------------------------------------------------------------------------

    @property
    def precision_plugin(self) -> ZeroPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Accepts the plugin Lightning builds from ``Trainer(precision=...)`` and turns it into a ZeroPrecision."""
        if plugin is None or isinstance(plugin, ZeroPrecision):
            self._precision_plugin = plugin
        elif type(plugin) is Precision:
            self._precision_plugin = ZeroPrecision("32-true")
        elif isinstance(plugin, MixedPrecision):
            self._precision_plugin = ZeroPrecision(plugin.precision, device=plugin.device)
        else:
            raise ValueError(
                f"ZeroStrategy cannot use the precision plugin {type(plugin).__name__} "
                f"(precision={getattr(plugin, 'precision', '?')!r}): use Trainer(precision='32-true', 'bf16-mixed' or "
                "'16-mixed')."
            )

    # -- setup and teardown -------------------------------------------------------------------------------------------

    def setup(self, trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device = self.root_device.type
        assert self.lightning_module is not None
        if not has_meta(self.lightning_module):
            self.model_to_device()  # a meta model is materialised on the device by the engine, unit by unit
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise RuntimeError(
                    f"ZeroStrategy shards one optimizer; configure_optimizers returned {len(self.optimizers)}. "
                    "Put all parameters into one optimizer with several param groups."
                )
            self._build_engine(self._unwrap(self.optimizers[0]))
        elif self._engine is None or self._engine.sharded is None:
            self._engine = None
            self._sync_module_states()
        # else: a stage-3 engine from an earlier fit keeps serving validate/test/predict with sharded parameters
        self.setup_precision_plugin()

    def _build_engine(self, optimizer: Optimizer) -> None:
        assert self.lightning_module is not None
        previous = getattr(self.lightning_module, "_zeroshard_engine", None)
        if previous is not None and previous.sharded is not None:
            previous.sharded.unshard_all()  # a new fit re-shards from whole parameters
            previous.remove_hooks()
        if self._activation_checkpointing is not None:
            apply_activation_checkpointing(
                self.lightning_module, self._activation_checkpointing, offload_to_cpu=self._offload_activations
            )
        engine = ZeroEngine(
            self.lightning_module,
            optimizer,
            self.zero_config,
            compute_dtype=self.precision_plugin.compute_dtype,
            local_world_size=self.num_processes,
        )
        if engine.optimizer is not optimizer:
            for config in self.lr_scheduler_configs:
                config.scheduler.optimizer = engine.optimizer
            self.optimizers = [engine.optimizer]
        self._engine = engine

    @torch.no_grad()
    def _sync_module_states(self) -> None:
        if not torch.distributed.is_initialized() or self.world_size == 1:
            return
        assert self.lightning_module is not None
        for t in list(self.lightning_module.parameters()) + list(self.lightning_module.buffers()):
            torch.distributed.broadcast(t.data, src=0)

    def teardown(self) -> None:
        # The engine stays so that `trainer.save_checkpoint` after `fit` still finds the sharded optimizer state. At
        # stage 3 its gather hooks stay too: the parameters exist only as shards, and validate/test use them.
        if self._engine is not None and self._engine.sharded is None:
            self._engine.remove_hooks()
        super().teardown()

    @property
    def engine(self) -> ZeroEngine | None:
        """The engine built at ``fit`` setup (``None`` before, and outside fitting)."""
        return self._engine

    # -- training step ------------------------------------------------------------------------------------------------

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skips gradient communication for the non-final micro-batches of gradient accumulation."""
        if self._engine is None:
            yield
            return
        self._engine.require_grad_sync = False
        try:
            yield
        finally:
            self._engine.require_grad_sync = True

    def tensor_init_context(self, empty_init: bool | None = None):
        """``trainer.init_module(empty_init=True)`` builds on the meta device; otherwise Lightning's default."""
        if empty_init:
            return init_meta_context()
        return super().tensor_init_context(empty_init)

    def model_sharded_context(self):
        """Stage 3 builds ``configure_model``'s layers on the meta device; each rank then allocates only its shards."""
        if self.zero_config.stage == 3:
            return init_meta_context()
        return super().model_sharded_context()

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
            self._engine.after_step()
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
        if is_sharded_checkpoint(checkpoint_path):
            if self._engine is None:
                raise RuntimeError(
                    f"{checkpoint_path} is a sharded checkpoint; it loads during trainer.fit(ckpt_path=...)"
                )
            state = load_sharded(self._engine, checkpoint_path)
            return {**state, "state_dict": {}, "optimizer_states": [], _SHARDED_LOADED: True}
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

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
        if self._engine is not None and optimizer is self._engine.optimizer:
            if self._state_dict_type == "sharded":
                return {}
            return self._engine.optimizer_state_dict()
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
        if len(states) != 1:
            raise ValueError(f"the checkpoint holds {len(states)} optimizer states; ZeroStrategy runs one optimizer")
        self._engine.load_optimizer_state_dict(states[0])

    @staticmethod
    def _unwrap(optimizer: Optimizer) -> Optimizer:
        return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

    # -- registry -----------------------------------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Registers ``zeroshard_stage_{1,2,3}``, ``zeroshard_stage_{2,3}_offload`` (optimizer offload) and
        ``zeroshard_stage_3_offload_params`` (optimizer and parameter offload)."""
        entries = (
            ("zeroshard_stage_1", "ZeRO stage 1: optimizer state sharded", {"stage": 1}),
            ("zeroshard_stage_2", "ZeRO stage 2: optimizer state and gradients sharded", {"stage": 2}),
            (
                "zeroshard_stage_2_offload",
                "ZeRO stage 2 with master weights and optimizer state offloaded to the CPU (fused CPUAdam)",
                {"stage": 2, "offload_optimizer": True},
            ),
            ("zeroshard_stage_3", "ZeRO stage 3: parameters, gradients and optimizer state sharded", {"stage": 3}),
            (
                "zeroshard_stage_3_offload",
                "ZeRO stage 3 with master weights and optimizer state offloaded to the CPU (pipelined fused CPU Adam)",
                {"stage": 3, "offload_optimizer": True},
            ),
            (
                "zeroshard_stage_3_offload_params",
                "ZeRO stage 3 with the optimizer and the parameter shards offloaded to (pinned) host memory",
                {"stage": 3, "offload_optimizer": True, "offload_params": True},
            ),
        )
        for name, description, params in entries:
            strategy_registry.register(name, cls, description=description, override=True, **params)

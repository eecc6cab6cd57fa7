"""ZeroFabricStrategy: zeroshard's ZeRO engine as a Lightning Fabric strategy (the Fabric adapter).

The same :class:`~zeroshard.strategies.strategy_core.StrategyCore` as the Trainer's :class:`~zeroshard.ZeroStrategy`,
behind Fabric's strategy API. It subclasses Fabric's ``DDPStrategy`` for launch, process groups and collectives; where
that wraps the module in ``DistributedDataParallel``, this builds a :class:`~zeroshard.engine.engine.ZeroEngine` over
the module and its optimizers::

    fabric = L.Fabric(accelerator="cuda", devices=8, strategy=ZeroFabricStrategy(stage=3, wrap_policy=Block))
    # or strategy="zeroshard_stage_2" (the names are registered for Fabric too)
    fabric.launch()
    with fabric.init_module(empty_init=True):        # meta device: nothing allocated until setup
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(model, optimizer)  # materialise unit by unit, shard, rewire the optimizer
    for i, batch in enumerate(loader):
        with fabric.no_backward_sync(model, enabled=(i + 1) % accumulate != 0):
            fabric.backward(loss_fn(model(batch)))
        if (i + 1) % accumulate == 0:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": i})   # sharded directory, every rank writes

``fabric.save`` writes the Trainer's sharded checkpoint format (:mod:`zeroshard.checkpoint.sharded_checkpoint`), with
the state's other entries where the Trainer keeps its loop state; ``fabric.load`` restores it at any world size and
stage.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _apply_filter, _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module
from torch.optim import Optimizer

from zeroshard.checkpoint.sharded_checkpoint import is_sharded_checkpoint, load_sharded, save_sharded
from zeroshard.engine.engine import ZeroEngine, master_gradients
from zeroshard.meta_init import has_meta, materialize_module_
from zeroshard.optim.sharded_optimizer import PendingOptimizer
from zeroshard.sharding.runtime_hook import RuntimeHook
from zeroshard.sharding.sharded_param import real_parameter
from zeroshard.strategies.fabric_precision import ZeroFabricPrecision
from zeroshard.strategies.process_group import init_and_destroy_at_exit
from zeroshard.strategies.strategy_core import StrategyCore, broadcast_module_states, replace_optimizers
from zeroshard.strategies.strategy_settings import as_timeout, register_names

# Key of the sharded checkpoint's trainer state that records which entries of Fabric's state were the model and the
# optimizers (their tensors are in the rank files).
_FABRIC_OBJECTS = "zeroshard_fabric_objects"


class ZeroFabricStrategy(DDPStrategy):
    """ZeRO stage 1/2/3 data parallelism with optional CPU offload, for ``lightning.Fabric``.

    Args:
        stage: ZeRO stage (1: optimizer state sharded; 2: gradients too; 3: parameters too).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, process_group_backend, timeout,
            start_method: as Fabric's ``DDPStrategy`` (``timeout`` also takes seconds, an int or float).
        precision: a :class:`~zeroshard.strategies.fabric_precision.ZeroFabricPrecision`; default: from
            ``Fabric(precision=...)`` (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``).
        **settings: every other setting of :class:`~zeroshard.ZeroStrategy` by keyword (``offload_optimizer``,
            ``offload_params``, ``wrap_policy``, ``activation_checkpointing``, ``state_dict_type``, ...), with the same
            DeepSpeed/FSDP aliases (:mod:`zeroshard.strategies.strategy_settings`).

    Set up the model with its optimizers together (``fabric.setup(model, opt1, opt2, ...)``), or a model alone and then
    one optimizer created over its parameters (``fabric.setup(model)`` then ``fabric.setup_optimizers(opt)``, LitGPT's
    order; a meta-device model is materialised in the first call). ``fabric.setup(model)`` with no optimizer replicates
    an eagerly built model (inference); a meta-device one is materialised and, at stage 3, sharded.

    With ``bf16-mixed``/``16-mixed`` the set-up module's parameters are in the compute dtype (the fp32 master weights
    are the optimizer's); ``fabric.save`` writes the fp32 masters.

    Raises:
        ValueError, TypeError: at construction, for a bad or unknown setting, naming it.
        ValueError: when Fabric is built, for a precision other than 32-true, bf16-mixed and 16-mixed.
    """

    def __init__(
        self,
        stage: int | str = 2,
        *,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision: FabricPrecision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **settings: Any,
    ) -> None:
        self._core = StrategyCore(type(self).__name__, {"stage": stage, **settings})
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=as_timeout(type(self).__name__, timeout),
            start_method=start_method,
        )
        self._backward_sync_control = _ZeroBackwardSyncControl(self._core)
        self._module: Module | None = None  # set up alone, waiting for its optimizer
        self._root_hooks: list = []

    @property
    def engine(self) -> ZeroEngine | None:
        """The engine built when the model was set up with its optimizers (``None`` before)."""
        return self._core.engine

    # -- precision ----------------------------------------------------------------------------------------------------

    @property
    def precision(self) -> ZeroFabricPrecision:
        plugin = self._precision
        return plugin if plugin is not None else ZeroFabricPrecision()

    @precision.setter
    def precision(self, plugin: FabricPrecision | None) -> None:
        """Accepts the plugin Fabric builds from ``Fabric(precision=...)`` and turns it into a ZeroFabricPrecision."""
        self._precision = ZeroFabricPrecision.from_lightning(
            plugin, FabricPrecision, MixedPrecision, "ZeroFabricStrategy", "Fabric"
        )

    def setup_environment(self) -> None:
        init_and_destroy_at_exit(super().setup_environment)
        self.precision.device = self.root_device.type

    # -- set-up -------------------------------------------------------------------------------------------------------

    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler=None):
        """Shards ``module`` and ``optimizers`` (one engine; a meta-device model is materialised unit by unit).

        Returns the module and the optimizers to step: the given ones rewired onto master shards, or, with
        ``offload_optimizer``, the ``OffloadedAdam`` replacing an Adam/AdamW (``scheduler`` is pointed at it).
        """
        engine = self._build_engine(module, optimizers)
        replace_optimizers(optimizers, engine.optimizers, [scheduler])
        return module, list(engine.optimizers), scheduler

    def setup_module(self, module: Module) -> Module:
        """Sets ``module`` up before its optimizer exists; the optimizer, created over the returned module's
        parameters, is then set up with ``fabric.setup_optimizers`` (LitGPT's order).

        A model built eagerly keeps rank 0's values everywhere and is sharded when its optimizer is set up; alone it
        stays replicated. A model on the meta device (``fabric.init_module(empty_init=True)``) is materialised here:
        at stages 1-2 whole on every rank, at stage 3 unit by unit into this rank's shards, so no rank ever holds it
        whole (the engine is built with a :class:`~zeroshard.optim.sharded_optimizer.PendingOptimizer` and takes the
        real optimizer in its place, :meth:`~zeroshard.engine.engine.ZeroEngine.adopt_optimizers`).
        """
        if has_meta(module) and self._core.config.stage == 3:
            self._build_engine(module, [PendingOptimizer(module.parameters())])
        else:
            if has_meta(module):
                materialize_module_(module, self.root_device, param_init_fn=self._core.config.param_init_fn)
            broadcast_module_states(module)
        self._module = module
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Shards the module set up with ``fabric.setup_module`` and this optimizer; returns the optimizer to step.

        At stage 3 with a model that was on the meta device, the optimizer takes the place of the pending one; if its
        param groups split the flat parameters already built (e.g. weight decay on some parameters of a unit), the
        model is gathered whole once and re-sharded by those groups, with a warning.

        Raises:
            RuntimeError: if no module was set up first, or an optimizer already was (several optimizers are set up
                together with the model: ``fabric.setup(model, opt1, opt2)``).
        """
        if self._module is None:
            raise RuntimeError(
                "set up the model first (`fabric.setup_module(model)`), or both: fabric.setup(model, opt)"
            )
        engine = self.engine
        if engine is not None and any(isinstance(o, PendingOptimizer) for o in engine.optimizers):
            if engine.adopt_optimizers([optimizer]):
                return engine.optimizers[0]
            rank_zero_warn(
                f"{type(optimizer).__name__}'s param groups split the flat parameters ZeroFabricStrategy built in "
                "fabric.setup(model): the model is gathered whole once and re-sharded by them. To skip this, set the "
                "model and optimizer up together: `model, optimizer = fabric.setup(model, optimizer)`."
            )
            for group in optimizer.param_groups:
                group["params"] = [real_parameter(p) for p in group["params"]]
        elif engine is not None:
            raise RuntimeError(
                "ZeroFabricStrategy builds one engine over the model and all its optimizers: set several optimizers up "
                "together with the model, `model, opt1, opt2 = fabric.setup(model, opt1, opt2)`."
            )
        return self._build_engine(self._module, [optimizer]).optimizers[0]

    def _build_engine(self, module: Module, optimizers: list[Optimizer]) -> ZeroEngine:
        engine = self._core.build_engine(
            module,
            optimizers,
            compute_dtype=self.precision.compute_dtype,
            local_world_size=self.num_processes,
            device=self.root_device.type,
        )
        self.precision.grad_norm_group = engine.process_group  # the shards' group, one replica of the state
        self.precision.module_grads = engine.module_grads
        if engine.offload is not None:  # fp16's overflow check is global: with overlap_step no bucket steps before it
            engine.offload.global_scale_expected = self.precision.scaler is not None
        for handle in self._root_hooks:
            handle.remove()
        self._root_hooks = []
        if engine.sharded is not None:
            # stage 3: the root unit (parameters outside every wrapped module) is gathered when the model's forward
            # starts and stays until the end of backward (the Trainer adapter does this in training_step)
            self._root_hooks = [
                module.register_forward_pre_hook(RuntimeHook(lambda m, args: engine.begin_step())),
                module.register_forward_hook(
                    RuntimeHook(lambda m, args, out: None if torch.is_grad_enabled() else engine.end_eval_step())
                ),
            ]
        return engine

    def module_to_device(self, module: Module) -> None:
        if not has_meta(module):  # a meta model is materialised on the device by the engine, unit by unit
            module.to(self.root_device)

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` builds on the meta device (the engine materialises it at setup, each
        rank allocating only its shards at stage 3); otherwise Fabric's default."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(self._core.meta_init_context(empty_init=True))
        stack.enter_context(self.precision.module_init_context())
        return stack

    # -- step ---------------------------------------------------------------------------------------------------------

    def backward(self, tensor: torch.Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        if self.engine is not None:
            self.engine.finish_backward()

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        """Steps ``optimizer`` on its master shards, then writes them into the parameters (and clears its
        gradients, see :meth:`ZeroEngine.after_step`)."""
        output = self.precision.optimizer_step(optimizer, **kwargs)
        if self.engine is not None:
            self.engine.after_step(optimizer)
        return output

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clips ``optimizer``'s gradient shards by their global norm across ranks; returns the norm before clipping.

        Raises:
            RuntimeError: (``error_if_nonfinite``) if that norm is inf or NaN, as torch's ``clip_grad_norm_``.
        """
        if self.engine is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        norm = self.precision._clip_norm(optimizer, max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients is non-finite ({float(norm)}); "
                "pass error_if_nonfinite=False to clip anyway (fp16 runs skip such steps)."
            )
        return norm

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamps ``optimizer``'s gradient shards to ``[-clip_val, clip_val]`` (elementwise, so shards clip alone)."""
        if self.engine is None:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self.precision.unscale_gradients(optimizer)
        self.engine.module_grads.sync()  # gradients replaced on the model first
        for grad in master_gradients(optimizer):
            grad.clamp_(-clip_val, clip_val)
        return None

    # -- checkpoints --------------------------------------------------------------------------------------------------

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The full state dict, CPU copies on rank 0 (``{}`` elsewhere); collective for a set-up module."""
        if self.engine is not None and module is self.engine.module:
            return self.engine.full_state_dict()
        return super().get_module_state_dict(module)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Consolidated state in torch's format on rank 0 (``{}`` elsewhere); collective."""
        if self.engine is not None and any(optimizer is opt for opt in self.engine.optimizers):
            return self.engine.optimizer_state_dict(optimizer)
        return super().get_optimizer_state(optimizer)

    def save_checkpoint(
        self,
        path,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``state_dict_type="sharded"`` (default): a sharded checkpoint directory, the Trainer's format (each rank
        writes its shards; the model and every optimizer of the engine are saved; the state's other entries go where
        the Trainer keeps its loop state). ``"full"``: one ``torch.save`` file from rank 0 with the consolidated model
        and optimizer state dicts, as Fabric's DDP writes.

        Raises:
            ValueError: if ``state`` holds no module set up by this strategy with its optimizers.
            TypeError: for ``storage_options``; NotImplementedError: for ``filter`` with sharded checkpoints.
        """
        if self.engine is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        if storage_options is not None:
            raise TypeError("ZeroFabricStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(path)))
        if self._core.state_dict_type == "full":
            converted: dict[str, Any] = {}
            for key, obj in state.items():
                if isinstance(obj, Module):
                    value = self.get_module_state_dict(obj)
                elif isinstance(obj, Optimizer):
                    value = self.get_optimizer_state(obj)
                else:
                    value = obj.state_dict() if isinstance(obj, _Stateful) else obj
                _apply_filter(key, filter or {}, value, converted)
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint=converted, path=path)
            return None
        if filter is not None:
            raise NotImplementedError("ZeroFabricStrategy: filter= needs state_dict_type='full'")
        objects = self._objects_in(state)
        metadata = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in state.items() if k not in objects}
        save_sharded(self.engine, path, {**metadata, _FABRIC_OBJECTS: objects})
        return None

    def load_checkpoint(
        self,
        path,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restores ``state`` in place from a sharded directory (saved at any world size and stage, by Fabric or by the
        Trainer) or a full file; returns the checkpoint's entries that ``state`` did not ask for.

        A sharded checkpoint restores the model and every optimizer of the engine at once.

        Raises:
            ValueError: if a sharded checkpoint is given no model set up by this strategy to load into.
            KeyError: (``strict``) if ``state`` asks for an entry the checkpoint lacks.
        """
        path = Path(self.broadcast(str(path)))
        if self.engine is None:
            return super().load_checkpoint(path, state, strict, weights_only)
        if not is_sharded_checkpoint(path):
            return self._load_full(path, state, strict, weights_only)
        if isinstance(state, Optimizer) or not state:
            raise ValueError(
                "a sharded checkpoint loads into the set-up model and its optimizers: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        if isinstance(state, Module):
            self._objects_in({"model": state})
            load_sharded(self.engine, path, weights_only=weights_only)
            return {}
        objects = self._objects_in(state)
        saved = load_sharded(self.engine, path, weights_only=weights_only)
        saved_objects = saved.pop(_FABRIC_OBJECTS, None)  # None: written by the Trainer
        if strict and saved_objects is not None:
            _validate_keys_for_strict_loading(objects, saved_objects, strict)
        _validate_keys_for_strict_loading([k for k in state if k not in objects], saved, strict)
        for key, obj in state.items():
            if key in objects or key not in saved:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(saved.pop(key))
            else:
                state[key] = saved.pop(key)
        return saved

    def _load_full(self, path: Path, state, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        engine = self.engine
        assert engine is not None
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if not state:
            return checkpoint
        if isinstance(state, Module):
            engine.load_full_state_dict(checkpoint, strict=strict)
            return {}
        if isinstance(state, Optimizer):
            engine.load_optimizer_state_dict(checkpoint, state, source=f"checkpoint {path}")
            return {}
        _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict)
        for key, obj in state.items():  # optimizer state checked before the model loads (restore_checks)
            if isinstance(obj, Optimizer) and key in checkpoint:
                engine.check_optimizer_state_dict(checkpoint[key], obj, source=f"checkpoint {path} ({key!r})")
        for key, obj in state.items():
            if key not in checkpoint:
                continue
            if isinstance(obj, Module):
                engine.load_full_state_dict(checkpoint.pop(key), strict=strict)
            elif isinstance(obj, Optimizer):
                engine.load_optimizer_state_dict(checkpoint.pop(key), obj, source=f"checkpoint {path} ({key!r})")
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint.pop(key))
            else:
                state[key] = checkpoint.pop(key)
        return checkpoint

    def _objects_in(self, state: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``state`` that are the engine's module (``"module"``) or optimizers (their index).

        Raises:
            ValueError: if the module is missing, or a module/optimizer in ``state`` is not the engine's.
        """
        engine = self.engine
        assert engine is not None
        objects: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                if obj is not engine.module:
                    raise ValueError(f"state[{key!r}] is not the model set up with ZeroFabricStrategy's optimizers")
                objects[key] = "module"
            elif isinstance(obj, Optimizer):
                objects[key] = engine.optim.index(obj)
        if "module" not in objects.values():
            raise ValueError(
                "ZeroFabricStrategy checkpoints hold the set-up model and its optimizers: put the model in the state, "
                "e.g. fabric.save(path, {'model': model, 'optimizer': optimizer})"
            )
        return objects

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Registers the same names as :class:`~zeroshard.ZeroStrategy` in Fabric's registry."""
        register_names(cls, strategy_registry)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: backward passes inside only accumulate gradients, with no communication."""

    def __init__(self, core: StrategyCore) -> None:
        self._core = core

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        engine = self._core.engine
        if engine is None:
            return nullcontext()  # a model set up without optimizers has no gradients to synchronise
        if module is not engine.module:
            raise TypeError(
                f"no_backward_sync needs the model set up with ZeroFabricStrategy, got {type(module).__name__}"
            )
        return self._core.no_backward_sync(enabled)

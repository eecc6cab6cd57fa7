"""StrategyCore: what zeroshard's Trainer strategy and Fabric strategy share.

Lightning has two strategy APIs: ``lightning.pytorch`` (the Trainer calls hooks on the strategy) and
``lightning.fabric`` (the user's loop passes modules and optimizers to it). :class:`zeroshard.ZeroStrategy` and
:class:`zeroshard.ZeroFabricStrategy` are thin adapters, one per API, each subclassing that API's ``DDPStrategy`` for
launch, process groups and collectives. Everything about ZeRO lives here once: the settings, building the
:class:`~zeroshard.engine.engine.ZeroEngine` over a module and its optimizers, skipping gradient sync during
accumulation, meta-device init, and giving the module its full-precision parameters back after training.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer

from zeroshard.engine.engine import ZeroEngine
from zeroshard.meta_init import init_meta_context
from zeroshard.optim.sharded_optimizer import fused_adam_kind
from zeroshard.sharding.managed import engine_of
from zeroshard.strategies.activation_checkpointing import apply_activation_checkpointing
from zeroshard.strategies.auto_plan import auto_config, check_auto_settings
from zeroshard.strategies.setup_checks import check_model_settings, warn_single_unit
from zeroshard.strategies.strategy_settings import parse_settings


class StrategyCore:
    """Settings and engine of one zeroshard strategy.

    Args:
        owner: the adapter's class name (for messages).
        settings: keyword settings (see :mod:`zeroshard.strategies.strategy_settings`): every
            :class:`~zeroshard.engine.config.ZeroConfig` field, ``activation_checkpointing``, ``offload_activations``,
            ``state_dict_type``, and the DeepSpeed/FSDP spellings accepted as aliases.

    Attributes:
        config: the validated :class:`~zeroshard.engine.config.ZeroConfig`.
        engine: the engine built by :meth:`build_engine` (``None`` before).

    Raises:
        ValueError, TypeError: at construction, for a bad or unknown setting (see
            :func:`~zeroshard.strategies.strategy_settings.parse_settings`).
    """

    def __init__(self, owner: str, settings: dict[str, Any]) -> None:
        settings = dict(settings)
        self.owner = owner
        self.plan_options: dict | None = settings.pop("plan_options", None)
        self.auto = settings.get("stage") == "auto"
        # stage="auto" may choose the state format only when the user did not
        self.state_dtype_given = settings.get("optimizer_state_dtype") is not None
        self.auto_plan: dict | None = None
        if self.auto:
            check_auto_settings(settings)
            # validated as stage 3 (which takes every setting, wrap_policy included) until the planner chooses at
            # setup; configure_model therefore builds on the meta device, as stage 3 may be chosen
            settings["stage"] = 3
        self.config, extra = parse_settings(owner, settings)
        self.activation_checkpointing = extra["activation_checkpointing"]
        self.offload_activations: bool = extra["offload_activations"]
        self.state_dict_type: str = extra["state_dict_type"]
        self.engine: ZeroEngine | None = None
        self._param_dtypes: dict[str, torch.dtype] = {}

    def build_engine(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        *,
        compute_dtype: torch.dtype | None,
        local_world_size: int,
        device: str = "cpu",
        grad_accum: int = 1,
    ) -> ZeroEngine:
        """Shards ``module`` and ``optimizers`` (a model built on the meta device is materialised unit by unit).

        A stage-3 engine already built over ``module`` (an earlier ``fit``) gives its parameters back whole first.
        The returned engine's ``optimizers`` replace the given ones (Adam/AdamW become ``OffloadedAdam`` with
        ``offload_optimizer``: point LR schedulers at them, see :func:`replace_optimizers`). With ``stage="auto"`` the
        planner (:mod:`zeroshard.strategies.auto_plan`) first picks the configuration for this job's ``device`` type
        (``"cuda"``/``"cpu"``), world size and ``grad_accum`` (micro-batches per step); its report is
        :attr:`auto_plan`.

        Raises:
            ValueError: before anything changes, for a ``wrap_policy`` or ``activation_checkpointing`` that selects no
                module of ``module``, or ``reduce_dtype=torch.float16`` without a float16 compute dtype
                (:func:`~zeroshard.strategies.setup_checks.check_model_settings`). Stage 3 without ``wrap_policy`` warns
                once (:func:`~zeroshard.strategies.setup_checks.warn_single_unit`).
        """
        # settings that mean nothing for this model or precision fail before anything changes
        check_model_settings(self.owner, module, self.config, self.activation_checkpointing, compute_dtype)
        previous = engine_of(module)
        if previous is not None and previous.sharded is not None:
            previous.sharded.unshard_all()  # a new fit re-shards from whole parameters
            previous.remove_hooks()
        if self.activation_checkpointing is not None:
            apply_activation_checkpointing(
                module, self.activation_checkpointing, offload_to_cpu=self.offload_activations
            )
        if self.auto:
            self.config, self.auto_plan = auto_config(
                module,
                self.config,
                wrap_policy=self.config.wrap_policy,
                world_size=dist.get_world_size(),
                local_world_size=local_world_size,
                device=device,
                compute_dtype=compute_dtype,
                activation_checkpointing=self.activation_checkpointing is not None,
                grad_accum=grad_accum,
                options=self.plan_options,
                choose_state_dtype=not self.state_dtype_given
                and all(fused_adam_kind(opt) is not None for opt in optimizers),
            )
            rank_zero_info(self.auto_plan["message"])
        warn_single_unit(self.owner, module, self.config)
        self._param_dtypes = {name: p.dtype for name, p in module.named_parameters()}
        self.engine = ZeroEngine(
            module, list(optimizers), self.config, compute_dtype=compute_dtype, local_world_size=local_world_size
        )
        return self.engine

    @contextmanager
    def no_backward_sync(self, enabled: bool = True) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients locally, with no communication (the non-final micro-batches
        of gradient accumulation, like DDP's ``no_sync``)."""
        if self.engine is None or not enabled:
            yield
            return
        self.engine.require_grad_sync = False
        try:
            yield
        finally:
            self.engine.require_grad_sync = True

    def meta_init_context(self, empty_init: bool = False):
        """Builds modules on the meta device; the engine allocates and initialises them, each rank its shards.

        ``empty_init=True`` (``init_module(empty_init=True)``): modules with a ``reset_parameters()`` get it at setup,
        as FSDP does and as LitGPT's ``initialize_weights`` expects (it overrides those methods after the build);
        otherwise (``configure_model``) the values equal the eager build's (:mod:`zeroshard.meta_init`)."""
        return init_meta_context(empty_init=empty_init)

    @torch.no_grad()
    def restore_full_precision(self) -> None:
        """Stages 1-2, after training with a low-precision compute dtype: the module's parameters get their own
        dtype (fp32, usually) back, as under DDP with ``bf16-mixed``.

        Trainable parameters take the fp32 master weights (all-gathered, exact); frozen ones are the compute-dtype
        copy cast back (the engine kept no other). The engine's flat buffers stay as they were, so a sharded
        checkpoint written afterwards is the same. The parameters no longer view them: call this once training with
        this engine is over (its gradient hooks removed). Stage 3 keeps its shards (validate/test run on them).
        """
        engine = self.engine
        if engine is None or engine.sharded is not None or engine.compute_dtype in (None, torch.float32):
            return
        dtypes = {id(p): self._param_dtypes.get(name) for name, p in engine.module.named_parameters()}
        restored = set()
        for fp in engine.flat_params:
            full = torch.empty(fp.layout.padded_numel, dtype=torch.float32, device=fp.device)
            engine.collectives.all_gather([fp.master.detach().to(fp.device)], [full], full.numel()).wait()
            for p, view in zip(fp.params, fp.layout.views(full)):
                p.data = view if dtypes[id(p)] in (None, torch.float32) else view.to(dtypes[id(p)])
                restored.add(id(p))
        for p in engine.module.parameters():
            original = dtypes.get(id(p))
            if id(p) not in restored and original is not None and p.dtype != original:
                p.data = p.data.to(original)


def replace_optimizers(old: Sequence[Optimizer], new: Sequence[Optimizer], schedulers: Sequence[Any]) -> None:
    """Points LR schedulers built on an optimizer the engine replaced (``OffloadedAdam``) at its replacement."""
    swapped = {id(o): n for o, n in zip(old, new) if o is not n}
    for scheduler in schedulers:
        if scheduler is not None and id(getattr(scheduler, "optimizer", None)) in swapped:
            scheduler.optimizer = swapped[id(scheduler.optimizer)]


@torch.no_grad()
def broadcast_module_states(module: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank (what DDP does at construction); for runs without an engine."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)

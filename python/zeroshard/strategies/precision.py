"""ZeroPrecision: Lightning's precision plugin for zeroshard: compute dtype, shard-aware clipping and loss scaling.

Lightning's generic plugins clip with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, which under
zeroshard are this rank's master shards only: each rank would see a different, partial norm (the reason Lightning's
``FSDPPrecision`` refuses norm clipping altogether). This plugin clips by the global norm across all shards, and for
fp16 it scales the loss with a :class:`~zeroshard.engine.loss_scaler.ShardedLossScaler` whose overflow check spans all
ranks.

Mixed precision is Lightning's ``FSDPPrecision`` for ``"bf16-mixed"``/``"16-mixed"``: forward (and the loss computed
in ``training_step``) runs under ``torch.autocast(device_type, dtype=compute dtype)``, floating-point inputs are
converted to fp32, and autocast picks each op's dtype; while the engine holds the parameters they are stored,
all-gathered and computed in the compute dtype (FSDP's ``MixedPrecision(param_dtype=...)``), gradients are reduced in
the engine's ``reduce_dtype`` (fp32 by default), and the master weights and optimizer state are fp32 shards. So the ops
autocast keeps in fp32 (cross-entropy and the other losses; on CUDA also softmax, layer norm and reductions) run in fp32
as under Lightning's own ``-mixed``. Without an engine (the module's own fp32 parameters, e.g. ``trainer.validate``
after a stage-1/2 fit restored them) the same autocast runs over fp32 parameters, as under Lightning's
``MixedPrecision``. No ``torch.set_default_dtype``: tensors created in forward are fp32, as under Lightning.

Layer norm on CPU: CUDA's autocast casts a layer norm's input and low-precision weight to fp32; CPU's does not list
layer norm, and its kernel takes a bf16 (fp16) input with a weight of the same dtype but raises ``RuntimeError: mixed
dtype (CPU): expect parameter to have scalar type of Float`` for an fp32 input with a bf16 weight. Activations computed
from the engine's parameters are in the compute dtype, so this meets only a model that feeds fp32 tensors (its float
inputs, fp32 tensors created in forward) straight into a norm on CPU: cast them to the norm's ``weight.dtype`` there.

:class:`PrecisionCore` is shared with the Fabric plugin
(:class:`zeroshard.strategies.fabric_precision.ZeroFabricPrecision`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from torch.optim import Optimizer

from zeroshard.engine.engine import clip_master_grads_, master_gradients
from zeroshard.engine.loss_scaler import ShardedLossScaler
from zeroshard.optim.sharded_optimizer import unwrap_optimizer

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_COMPUTE_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class PrecisionCore:
    """What zeroshard's Trainer and Fabric precision plugins share: the compute dtype, autocast in forward, inputs in
    fp32, the fp16 loss scaler, and shard-aware unscaling and clipping.

    ``device`` is the device type autocast runs on (``"cpu"`` or ``"cuda"``), set by the strategy at setup.
    """

    def __init__(
        self,
        precision: Literal["32-true", "bf16-mixed", "16-mixed"] = "32-true",
        device: str = "cuda",
        scaler: ShardedLossScaler | None = None,
    ) -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(f"zeroshard does not support precision={precision!r}: use one of {SUPPORTED_PRECISIONS}.")
        self.precision = precision
        self.device = device
        self.scaler = (scaler or ShardedLossScaler()) if precision == "16-mixed" else None
        # the group whose shards make up one copy of the gradients (the engine's shard group; hybrid sharding
        # replicates them across groups, which a norm over every rank would count once per replica); set by the
        # strategy when it builds the engine
        self.grad_norm_group: dist.ProcessGroup | None = None
        # the engine's ModuleGrads (set with the engine): gradients replaced on the model go into the shards before
        # unscaling and clipping read them
        self.module_grads = None

    @classmethod
    def from_lightning(cls, plugin, base: type, mixed: type, owner: str, flag: str):
        """The plugin Lightning builds from ``Trainer/Fabric(precision=...)`` (``base`` for 32-true, ``mixed`` for
        ``*-mixed``) as an instance of ``cls``; ``None`` and ``cls`` instances unchanged.

        Raises:
            ValueError: for any other plugin (``bf16-true``, ``64-true``, ...), naming it and the supported flags.
        """
        if plugin is None or isinstance(plugin, cls):
            return plugin
        if type(plugin) is base:
            return cls("32-true")
        if isinstance(plugin, mixed):
            return cls(plugin.precision, device=plugin.device)
        raise ValueError(
            f"{owner} cannot use the precision plugin {type(plugin).__name__} "
            f"(precision={getattr(plugin, 'precision', '?')!r}): use {flag}(precision='32-true', 'bf16-mixed' or "
            "'16-mixed')."
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return _COMPUTE_DTYPES[self.precision]

    def forward_context(self) -> AbstractContextManager:
        """``"bf16-mixed"``/``"16-mixed"``: ``torch.autocast(self.device, dtype=compute_dtype)``, as Lightning's
        ``FSDPPrecision.forward_context`` (which names ``"cuda"``; here the strategy's device type); ``"32-true"``:
        nothing."""
        if self.precision == "32-true":
            return nullcontext()
        return torch.autocast(self.device, dtype=self.compute_dtype)

    def convert_input(self, data: Any) -> Any:
        """``"-mixed"``: floating-point tensors of a batch (any float dtype) become fp32, as Lightning's
        ``FSDPPrecision.convert_input`` does (autocast then casts per op); other tensors and ``"32-true"`` batches are
        returned unchanged."""
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=torch.float32)

    def _unscale_and_check(self, optimizer) -> bool:
        """fp16: unscales this rank's gradient shards of ``optimizer``; True if any rank saw an inf/NaN
        (collective)."""
        self._sync_module_grads()
        fold = getattr(unwrap_optimizer(optimizer), "fold_grad_unscale", None)  # OffloadedAdam: folded into its step
        return self.scaler.unscale_and_check(master_gradients(optimizer), _group(), fold=fold)

    def _clip_norm(self, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the master-shard gradients of ``optimizer`` by their global norm across ranks; returns the norm."""
        self._sync_module_grads()
        group = self.grad_norm_group or _group()
        return clip_master_grads_(optimizer, float(max_norm), float(norm_type), group)

    def _sync_module_grads(self) -> None:
        """Gradients replaced on the model since backward (``p.grad = t``) into this rank's shards
        (:meth:`~zeroshard.engine.module_grads.ModuleGrads.sync`)."""
        if self.module_grads is not None:
            self.module_grads.sync()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class ZeroPrecision(PrecisionCore, Precision):
    """Precision plugin of :class:`~zeroshard.ZeroStrategy`.

    Args:
        precision: ``"32-true"`` (fp32 throughout), ``"bf16-mixed"`` (bf16 parameters, ``torch.autocast`` to bf16, fp32
            master weights), ``"16-mixed"`` (the same in fp16, with dynamic loss scaling). On CPU, where
            ``torch.autocast("cpu", dtype=torch.float16)`` runs but Lightning turns ``Trainer(accelerator="cpu",
            precision="16-mixed")`` into bf16-mixed with a warning, pass
            ``ZeroStrategy(precision_plugin=ZeroPrecision("16-mixed", device="cpu"))``.
        device: the device type the strategy runs on (``"cuda"`` or ``"cpu"``), set by the strategy at setup.
        scaler: the loss scaler for ``"16-mixed"``; default :class:`~zeroshard.engine.loss_scaler.ShardedLossScaler()`.

    Raises:
        ValueError: for another precision, naming the supported ones.
    """

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        tensor = super().pre_backward(tensor, module)
        return self.scaler.scale_loss(tensor) if self.scaler is not None else tensor

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Runs the closure (backward), then, for fp16, unscales and checks every shard: an overflow on any rank skips
        the step everywhere."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        overflow = self._unscale_and_check(optimizer)
        self._after_closure(model, optimizer)
        if not overflow:
            optimizer.step(**kwargs)
        self.scaler.update(overflow)
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clips the master-shard gradients of ``optimizer`` by their global 2-norm across ranks."""
        if _group() is None:
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        self._clip_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clamps the master-shard gradients of ``optimizer`` elementwise (Lightning's), after writing gradients
        replaced on the model into them."""
        self._sync_module_grads()
        super().clip_grad_by_value(optimizer, clip_val)


def _group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None

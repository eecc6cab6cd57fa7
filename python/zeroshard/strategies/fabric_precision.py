"""ZeroFabricPrecision: the precision plugin of :class:`zeroshard.ZeroFabricStrategy` (Lightning Fabric).

The same mixed precision as the Trainer's :class:`~zeroshard.strategies.precision.ZeroPrecision` (both are a
:class:`~zeroshard.strategies.precision.PrecisionCore`, whose module docstring has the details): the forward of a model
from ``fabric.setup`` (and code under ``fabric.autocast()``) runs under ``torch.autocast`` to the compute dtype, as
Fabric's ``FSDPPrecision``; parameters are in the compute dtype while the engine holds them, master weights fp32,
floating inputs converted to the compute dtype (as Fabric's own ``MixedPrecision`` does), and a loss scaler whose fp16
overflow check spans every shard. Here in Fabric's API: ``backward`` scales the loss, ``unscale_gradients`` (called by
``fabric.clip_gradients``) unscales once per step, ``optimizer_step`` skips the step on every rank if any rank
overflowed, and ``convert_output`` casts floating outputs to the default dtype (fp32 unless changed), as Fabric's own
``MixedPrecision`` and ``FSDPPrecision`` do.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning_utilities import apply_to_collection
from torch.nn import Module
from torch.optim import Optimizer

from zeroshard.strategies.precision import PrecisionCore


class ZeroFabricPrecision(PrecisionCore, FabricPrecision):
    """Precision plugin of :class:`~zeroshard.ZeroFabricStrategy`.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"`` (bf16 parameters, ``torch.autocast`` to bf16, fp32 master weights)
            or ``"16-mixed"`` (the same in fp16, with dynamic loss scaling).
        device: the device type (``"cuda"`` or ``"cpu"``), set by the strategy.
        scaler: the loss scaler for ``"16-mixed"``; default :class:`~zeroshard.engine.loss_scaler.ShardedLossScaler()`.

    Raises:
        ValueError: for another precision, naming the supported ones.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._overflow: dict[int, bool] = {}  # id(optimizer) -> overflow, for gradients unscaled before the step

    def convert_input(self, data: Any) -> Any:
        """``"-mixed"``: floating-point tensors of the model's input become the compute dtype, as Fabric's own
        ``MixedPrecision.convert_input`` does (Fabric's DDP ``bf16-mixed`` hands the model bf16 inputs; the Trainer
        plugin keeps fp32, as the Trainer's does); ``"32-true"``: unchanged."""
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self.compute_dtype)

    def convert_output(self, data: Any) -> Any:
        """``"-mixed"``: floating-point tensors of the model's output become ``torch.get_default_dtype()`` (fp32 unless
        changed), as Fabric's ``MixedPrecision.convert_output``; ``"32-true"``: unchanged."""
        if self.precision == "32-true":
            return data
        return apply_to_collection(
            data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=torch.get_default_dtype()
        )

    def backward(self, tensor: torch.Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale_loss(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """fp16: unscales ``optimizer``'s gradient shards once per step and remembers whether any rank overflowed."""
        if self.scaler is not None and id(optimizer) not in self._overflow:
            self._overflow[id(optimizer)] = self._unscale_and_check(optimizer)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        """Steps, or for fp16 skips the step on every rank when any rank's gradients overflowed."""
        if self.scaler is None:
            return optimizer.step(**kwargs)
        self.unscale_gradients(optimizer)
        overflow = self._overflow.pop(id(optimizer))
        output = None if overflow else optimizer.step(**kwargs)
        self.scaler.update(overflow)
        return output

"""ZeroPrecision: Lightning's precision plugin for zeroshard: compute dtype, shard-aware clipping and loss scaling.

Lightning's generic plugins clip with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, which under
zeroshard are this rank's master shards only: each rank would see a different, partial norm (the reason Lightning's
``FSDPPrecision`` refuses norm clipping altogether). This plugin clips by the global norm across all shards, and for
fp16 it scales the loss with a :class:`~zeroshard.loss_scaler.ShardedLossScaler` whose overflow check spans all ranks.

Mixed precision follows FSDP2's ``MixedPrecisionPolicy``: parameters are stored, all-gathered and computed in the
compute dtype, gradients are reduced in the engine's ``reduce_dtype`` (fp32 by default), and the master weights and
optimizer state stay fp32 shards. Floating-point inputs are cast to the compute dtype and tensors created in forward
default to it, as in Lightning's ``bf16-true``. There is no ``torch.autocast``: its fp32 ops (layer norm) reject
low-precision parameters, and FSDP2 does without it too.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from torch.optim import Optimizer

from zeroshard.engine import clip_grads_, master_gradients
from zeroshard.loss_scaler import ShardedLossScaler

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_COMPUTE_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ZeroPrecision(Precision):
    """Precision plugin of :class:`~zeroshard.ZeroStrategy`.

    Args:
        precision: ``"32-true"`` (fp32 throughout), ``"bf16-mixed"`` (bf16 parameters and compute, fp32 master
            weights), ``"16-mixed"`` (fp16, with dynamic loss scaling).
        device: the device type the strategy runs on (``"cuda"`` or ``"cpu"``), set by the strategy at setup.
        scaler: the loss scaler for ``"16-mixed"``; default :class:`~zeroshard.loss_scaler.ShardedLossScaler()`.

    Raises:
        ValueError: for another precision, naming the supported ones.
    """

    def __init__(
        self,
        precision: Literal["32-true", "bf16-mixed", "16-mixed"] = "32-true",
        device: str = "cuda",
        scaler: ShardedLossScaler | None = None,
    ) -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"ZeroStrategy does not support precision={precision!r}: use one of {SUPPORTED_PRECISIONS}."
            )
        self.precision = precision
        self.device = device
        self.scaler = (scaler or ShardedLossScaler()) if precision == "16-mixed" else None

    @property
    def compute_dtype(self) -> torch.dtype:
        return _COMPUTE_DTYPES[self.precision]

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Tensors created during forward default to the compute dtype (as Lightning's ``bf16-true`` does)."""
        if self.precision == "32-true":
            yield
            return
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.compute_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def convert_input(self, data: Any) -> Any:
        """Floating-point tensors of a batch are cast to the compute dtype (FSDP2's ``cast_forward_inputs``)."""
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self.compute_dtype)

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        tensor = super().pre_backward(tensor, module)
        return self.scaler.scale_loss(tensor) if self.scaler is not None else tensor

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Runs the closure (backward), then, for fp16, unscales and checks every shard: an overflow on any rank skips
        the step everywhere."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        grads = master_gradients(optimizer)
        overflow = self.scaler.unscale_and_check(grads, _group())
        self._after_closure(model, optimizer)
        if not overflow:
            optimizer.step(**kwargs)
        self.scaler.update(overflow)
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clips the master-shard gradients of ``optimizer`` by their global 2-norm across ranks."""
        group = _group()
        if group is None:
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        clip_grads_(master_gradients(optimizer), float(clip_val), 2.0, group)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def _group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None

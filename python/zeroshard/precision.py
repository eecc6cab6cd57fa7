"""ZeroPrecision: Lightning's precision plugin for zeroshard, with shard-aware gradient clipping.

Lightning's generic plugins clip with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, which under
zeroshard are this rank's master shards only: each rank would see a different, partial norm. This plugin clips by the
global norm across all shards (the reason Lightning's ``FSDPPrecision`` refuses norm clipping altogether).
"""

from __future__ import annotations

from typing import Literal

import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from zeroshard.engine import clip_grad_norm_

SUPPORTED_PRECISIONS = ("32-true",)
_ALL_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


class ZeroPrecision(Precision):
    """Precision plugin of :class:`~zeroshard.ZeroStrategy`.

    Args:
        precision: Lightning's precision flag. ``"32-true"``: fp32 parameters, gradients and master weights.

    Raises:
        ValueError: for a precision this version does not support, naming the supported ones.
    """

    def __init__(self, precision: Literal["32-true"] = "32-true") -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"ZeroStrategy does not support precision={precision!r} yet: use one of {SUPPORTED_PRECISIONS}."
            )
        self.precision = precision

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clips the master-shard gradients of ``optimizer`` by their global 2-norm across ranks."""
        group = dist.group.WORLD if dist.is_initialized() else None
        if group is None:
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        clip_grad_norm_(list(self.main_params(optimizer)), float(clip_val), 2.0, group)

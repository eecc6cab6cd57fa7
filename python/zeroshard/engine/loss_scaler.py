"""Dynamic loss scaling for fp16 that sees every shard.

torch's ``GradScaler`` checks the gradients of the parameters it is given; under ZeRO each rank holds only its shard
of the gradients, so one rank could step while another skips. Here the inf/NaN flag is all-reduced (MAX) over the
group first: an overflow anywhere skips the step on every rank, and the master weights and optimizer state stay
bit-for-bit unchanged. The schedule is Micikevicius et al. 2018 ("Mixed Precision Training", section 3.2) with
DeepSpeed's hysteresis: the scale halves after ``hysteresis`` consecutive overflows and doubles after
``growth_interval`` clean steps, never below ``min_scale``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.engine.engine import _comm_device
from zeroshard.engine.step_flags import clear_scaled_losses, note_scaled_loss
from zeroshard.sharding.collective_errors import named_collective


class ShardedLossScaler:
    """Dynamic loss scale for fp16 training with sharded gradients.

    Args:
        init_scale: first scale (a power of two).
        growth_factor, backoff_factor: multipliers after ``growth_interval`` clean steps / an overflow.
        growth_interval: clean steps before the scale grows.
        hysteresis: overflows in a row before the scale shrinks (DeepSpeed's ``hysteresis``).
        min_scale: the scale never goes below this.

    Raises:
        ValueError: for a non-positive scale or interval, or factors on the wrong side of 1.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ) -> None:
        if init_scale <= 0 or min_scale <= 0 or growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"ShardedLossScaler: init_scale={init_scale}, min_scale={min_scale}, growth_interval={growth_interval},"
                f" hysteresis={hysteresis} must all be positive"
            )
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                f"ShardedLossScaler: growth_factor={growth_factor} must be > 1 and "
                f"backoff_factor={backoff_factor} in (0, 1)"
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self._clean_steps = 0
        self._overflows_in_a_row = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``. Until :meth:`unscale_and_check` the engines leave non-finite gradients to it (its overflow
        skip is their ``nonfinite`` check: one flag, one skip on every rank)."""
        note_scaled_loss()
        return loss * self.scale

    @torch.no_grad()
    def unscale_and_check(
        self, grads: list[torch.Tensor], group: dist.ProcessGroup | None, fold: Callable[[float], None] | None = None
    ) -> bool:
        """Divides the gradient shards by the scale in place (or hands ``1 / scale`` to ``fold``, e.g.
        ``OffloadedAdam.fold_grad_unscale``, which multiplies inside its step); returns True if any rank saw an inf or
        NaN (collective)."""
        clear_scaled_losses()
        device = _comm_device(group) if dist.is_initialized() else torch.device("cpu")
        found = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            found = torch.maximum(found, (~torch.isfinite(g)).any().float().to(device))
        if dist.is_initialized():
            with named_collective(
                "fp16 overflow all-reduce",
                "the inf/NaN flags of the gradient shards",
                step=None,
                rank=dist.get_rank(group),
                world_size=dist.get_world_size(group),
            ):
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        overflow = bool(found.item())
        if not overflow:
            inv = 1.0 / self.scale
            if fold is not None:
                fold(inv)
                return overflow
            for g in grads:
                g.mul_(inv)
        return overflow

    def update(self, overflow: bool) -> None:
        """Adjusts the scale after a step (or a skipped one)."""
        if overflow:
            self.skipped_steps += 1
            self._clean_steps = 0
            self._overflows_in_a_row += 1
            if self._overflows_in_a_row >= self.hysteresis:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self._overflows_in_a_row = 0
        else:
            self._overflows_in_a_row = 0
            self._clean_steps += 1
            if self._clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self._clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "overflows_in_a_row": self._overflows_in_a_row,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_in_a_row = int(state["overflows_in_a_row"])
        self.skipped_steps = int(state["skipped_steps"])

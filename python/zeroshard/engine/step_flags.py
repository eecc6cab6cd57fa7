"""One small all-reduce per synchronised backward: buckets with a non-finite gradient, and parameters any rank used.

Two facts about a step are global while each rank sees only its part:

* a NaN/inf in rank 1's local gradient lands, after the reduce-scatter, only in the shard its owner holds; each rank
  checks the shards it holds (:class:`~zeroshard.sharding.grad_reducer.GradReducer` flags each bucket as its
  reduction completes), and the flags are combined here;
* a parameter that got no gradient on this rank may have got one on another. DDP with ``find_unused_parameters=True``
  all-reduces a bitmap of the locally used parameters for the same reason.

Both travel in one float32 tensor (one element per bucket, then one per parameter), all-reduced with MAX over the
data-parallel group: 4 bytes per parameter tensor (not per element), one collective per step, none per parameter.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeroshard.sharding.collective_errors import describe_bucket, named_collective

NONFINITE_MODES = ("error", "skip", "ignore")

# losses scaled by a ShardedLossScaler whose unscale-and-check has not run yet: its overflow check owns non-finite
# gradients then (fp16 overflows are expected; it skips the step everywhere and lowers the scale)
_scaled_losses = 0


def note_scaled_loss() -> None:
    """Called by :meth:`ShardedLossScaler.scale_loss`."""
    global _scaled_losses
    _scaled_losses += 1


def clear_scaled_losses() -> None:
    """Called by :meth:`ShardedLossScaler.unscale_and_check`, which has then seen the gradients."""
    global _scaled_losses
    _scaled_losses = 0


def loss_scaling_pending() -> bool:
    """True while a scaled loss's gradients await the loss scaler's overflow check."""
    return _scaled_losses > 0


class NonFiniteGradientError(FloatingPointError):
    """A gradient of this step is NaN or infinite on some rank (``ZeroStrategy(nonfinite="error")``). Raised on every
    rank before any master weight changed; names the step and the first bucket (or stage-3 unit) affected."""


@dataclass
class StepFlags:
    """The combined flags of one synchronised backward.

    Attributes:
        first_nonfinite: index of the first bucket whose reduced gradient holds a NaN/inf on some rank, or ``None``.
        unused: per bucket, the indices (in the bucket) of parameters no rank produced a gradient for.
    """

    first_nonfinite: int | None
    unused: list[list[int]]


@torch.no_grad()
def confirm_nonfinite(bad: torch.Tensor, flat_params: list, gradient_of) -> torch.Tensor:
    """Clears the flags of buckets whose gradient shard is finite after all: the reducer flags a non-finite sum, which
    an fp32 overflow of finite elements gives too. Reads ``bad`` (one element per bucket) to the host; re-checks only
    flagged buckets, with ``gradient_of(flat_param)`` (the shard as the step reads it, or ``None``: kept flagged).
    Returns the flags on the host."""
    host = bad.cpu()
    for fi in torch.nonzero(host).flatten().tolist():
        grad = gradient_of(flat_params[fi])
        if grad is not None and bool(torch.isfinite(grad).all()):
            host[fi] = 0.0
    return host


@torch.no_grad()
def exchange_flags(
    bad: torch.Tensor,
    used: list[set[int]],
    sizes: list[int],
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    step: int,
) -> StepFlags:
    """All-reduces (MAX) this rank's flags with every rank's; collective on ``group``.

    Args:
        bad: float32, one element per bucket: 1 where this rank's reduced gradient shard holds a NaN/inf.
        used: per bucket, the indices of parameters that got a gradient on this rank since the last reduction.
        sizes: parameters per bucket.
        group: the data-parallel group (every rank whose gradients are averaged).
        device: the device ``group``'s backend communicates on.
        step: the optimizer step, named if the all-reduce fails.

    Raises:
        CollectiveError: the all-reduce failed or timed out (naming it, the step and the rank).
    """
    n = len(sizes)
    local = [0.0] * sum(sizes)  # built as a list: one tensor op instead of one per bucket
    offset = 0
    for fi, size in enumerate(sizes):
        if len(used[fi]) == size:
            local[offset : offset + size] = [1.0] * size
        else:
            for pi in used[fi]:
                local[offset + pi] = 1.0
        offset += size
    flags = torch.cat((bad.to(device, torch.float32), torch.tensor(local, dtype=torch.float32).to(device)))
    world_size = dist.get_world_size(group)
    if world_size > 1:
        with named_collective(
            "step-flags all-reduce",
            "the non-finite gradient flags and used-parameter bitmap",
            step=step,
            rank=dist.get_rank(group),
            world_size=world_size,
        ):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    values = flags.tolist()
    first = next((fi for fi in range(n) if values[fi] != 0.0), None)
    unused: list[list[int]] = [[] for _ in sizes]
    if 0.0 in values[n:]:  # some parameter got no gradient on any rank
        offset = n
        for fi, size in enumerate(sizes):
            unused[fi] = [pi for pi in range(size) if values[offset + pi] == 0.0]
            offset += size
    return StepFlags(first, unused)


def nonfinite_found(mode: str, step: int, bucket: int, names: list[str], numel: int, overlap_step: bool) -> bool:
    """Acts on a non-finite gradient found on some rank (every rank calls it, with the same arguments): ``"error"``
    raises, ``"skip"`` warns and returns True (the caller has dropped the step's gradients).

    Raises:
        NonFiniteGradientError: with ``mode="error"``, naming the step, the bucket and the fix.
    """
    where = describe_bucket(bucket, names, numel)
    early = (
        " With overlap_step=True, buckets stepped during backward on a rank whose own shard was finite have already "
        "changed."
        if overlap_step
        else ""
    )
    if mode == "error":
        raise NonFiniteGradientError(
            f"zeroshard: a NaN or infinite gradient at step {step}, first in {where} (on some rank; every rank raises)."
            f" No master weight or optimizer state changed.{early} Find the cause (learning rate, data, loss), or pass "
            "ZeroStrategy(nonfinite='skip') to skip such steps with a warning (nonfinite='ignore' steps them as torch "
            "does)."
        )
    warnings.warn(
        f"zeroshard: skipped step {step} on every rank: a NaN or infinite gradient, first in {where}. Master weights "
        f"and optimizer state are unchanged (nonfinite='skip').{early}",
        stacklevel=2,
    )
    return True

"""Errors of failed collectives that say what was being communicated, where, when and on which rank.

A collective that fails (a rank died: ``Connection reset by peer``) or times out (a rank stopped answering: gloo's
``Timed out waiting 20000ms for recv``, NCCL's watchdog) raises a bare backend error from deep inside a hook. The
engine re-raises it (``raise ... from err``, so the backend's error stays the ``__cause__``) as a
:class:`CollectiveError` naming the collective, the gradient bucket or stage-3 unit, the optimizer step and the rank,
and saying what to look at. How long a silent rank is waited for is the process group's timeout
(``ZeroStrategy(timeout=timedelta(...))``; Lightning's default is 30 minutes).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any


class CollectiveError(RuntimeError):
    """A zeroshard collective failed or timed out on this rank.

    Attributes:
        collective: what was being communicated, e.g. ``"reduce-scatter"``.
        what: the bucket or unit, e.g. ``"gradient bucket 2 ('blocks.1.up.weight' .. 'blocks.1.down.bias')"``.
        step: optimizer steps completed on this rank when it failed (``trainer.global_step`` with one optimizer), or
            None where unknown.
        rank: this rank in the collective's process group.
        timed_out: whether the backend reported a timeout (a rank stopped answering) rather than a failure.
    """

    def __init__(self, message: str, *, collective: str, what: str, step: int | None, rank: int, timed_out: bool):
        super().__init__(message)
        self.collective, self.what, self.step, self.rank, self.timed_out = collective, what, step, rank, timed_out


class DivergedRanksError(RuntimeError):
    """Ranks reached different stage-3 units at the same all-gather (they took different code paths); raised on every
    rank before the gathered buffer is used, naming each rank's unit (:mod:`zeroshard.sharding.gather_check`)."""


def is_timeout(err: BaseException) -> bool:
    """Whether a backend error is a timeout (gloo: ``Timed out waiting ...``; NCCL: ``Watchdog caught collective
    operation timeout``) rather than a lost peer or a mismatch."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def collective_error(
    err: BaseException, *, collective: str, what: str, step: int | None, rank: int, world_size: int
) -> CollectiveError:
    """The :class:`CollectiveError` for backend error ``err``; raise it ``from err``."""
    timed_out = is_timeout(err)
    when = f"step {step}" if step is not None else "an unknown step"
    if timed_out:
        cause = (
            "it timed out: no answer from another rank within the process group's timeout "
            "(ZeroStrategy(timeout=timedelta(...))). Either a rank stopped (frozen, or hung in its own code: the rank "
            "that reports no such error), or the ranks wait in different collectives (their code paths differ: "
            "compare the collective and unit each rank's error names)"
        )
    else:
        cause = (
            "another rank died or left the job, or ranks issued different collectives; the first error in the other "
            "ranks' logs names the cause"
        )
    message = (
        f"zeroshard: the {collective} of {what} failed on rank {rank} (of {world_size}) at {when}: {cause}. "
        f"Backend error: {err}"
    )
    return CollectiveError(message, collective=collective, what=what, step=step, rank=rank, timed_out=timed_out)


@contextmanager
def named_collective(
    collective: str, what: str | Callable[[], str], *, step: int | None, rank: int, world_size: int
) -> Any:
    """Re-raises a ``RuntimeError`` from the block (a collective or its wait) as a :class:`CollectiveError`.

    ``what`` may be a callable, so a description costs nothing unless something fails. A :class:`CollectiveError`
    passes through unchanged (an inner wait already named itself).
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:
        desc = what() if callable(what) else what
        raise collective_error(
            err, collective=collective, what=desc, step=step, rank=rank, world_size=world_size
        ) from err


def describe_bucket(index: int, names: list[str], numel: int) -> str:
    """``gradient bucket 3 ('a.weight' .. 'b.bias', 4,096 elements)``: a bucket by its position and parameters."""
    span = f"'{names[0]}'" if len(names) == 1 else f"'{names[0]}' .. '{names[-1]}'"
    return f"gradient bucket {index} ({span}, {numel:,} elements)"

"""EventClock: the main thread's own CPU time in each stage-3 unit event, less the collectives made inside it.

A unit event (pre/post forward, pre/post backward, the root's pre/post forward) is Python of ours plus the launch and
wait of an all-gather. The time that is ours is the thread's CPU time (``time.thread_time_ns``: this thread only, not
gloo's workers, and not the time the thread is descheduled, so machine load barely moves it) from the event's entry to
its exit, minus the same clock's deltas around each collective call and ``.wait()`` made inside the event.

Nothing is timed unless a clock is attached (:meth:`ShardedUnits.time_events
<zeroshard.sharding.sharded_units.ShardedUnits.time_events>`): attaching swaps the hooks' callables for timed ones and
the runtime's collectives for :class:`TimedCollectives`, so the hooks carry no timing code while off.
"""

from __future__ import annotations

from collections.abc import Callable
from time import thread_time_ns
from typing import Any


class EventClock:
    """Per-event samples of the main thread's CPU time, in nanoseconds, collectives excluded.

    Attributes:
        samples: event label -> one sample (int, ns) per call, in call order.
    """

    def __init__(self) -> None:
        self.samples: dict[str, list[int]] = {}
        self._excluded = 0  # ns spent in collectives inside the event being timed

    def timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` recording one sample under ``label`` per call. Nested events: the outer one includes the inner
        one's own time, and excludes its collectives too."""
        samples = self.samples.setdefault(label, [])

        def call(*args: Any, **kwargs: Any) -> Any:
            outer, self._excluded = self._excluded, 0
            t0 = thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                inner = self._excluded
                samples.append(thread_time_ns() - t0 - inner)
                self._excluded = outer + inner

        return call

    def excluded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Calls ``fn(*args)`` (a collective or its wait) and leaves its CPU time out of the enclosing event."""
        t0 = thread_time_ns()
        try:
            return fn(*args)
        finally:
            self._excluded += thread_time_ns() - t0

    def overhead_ns(self, calls: int = 2000) -> int:
        """Median sample of an empty timed call: the clock's own cost inside one sample (a floor for every event)."""
        probe = EventClock()
        empty = probe.timed("empty", lambda: None)
        for _ in range(calls):
            empty()
        return sorted(probe.samples["empty"])[calls // 2]


class TimedCollectives:
    """``_C.BucketedCollectives`` whose all-gathers (launch and wait) are excluded from ``clock``'s events; every
    other attribute is the wrapped object's."""

    def __init__(self, inner: Any, clock: EventClock) -> None:
        self.inner = inner
        self.clock = clock

    def all_gather(self, *args: Any) -> _TimedHandle:
        return _TimedHandle(self.clock.excluded(self.inner.all_gather, *args), self.clock)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _TimedHandle:
    def __init__(self, handle: Any, clock: EventClock) -> None:
        self.handle = handle
        self.clock = clock

    def wait(self) -> Any:
        return self.clock.excluded(self.handle.wait)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

"""Stepping buckets during backward: the offloaded CPU step overlaps the rest of backward.

ZeRO-Offload (Ren et al. 2021, section 4) runs the whole CPU step after backward, while the GPU waits. But a bucket's
update needs only that bucket's gradient, its master shard and its moments: once the gradient shard is on the host,
the bucket can be stepped while backward goes on with the buckets before it, and its compute-dtype weights uploaded.

:class:`EarlyStepper` is that worker: one host thread that runs ``_C.HostAdamPipeline.step`` for each bucket handed to
it, in hand-over order, while the Python thread that runs backward goes on. The pipeline waits for the bucket's
gradient copy (its d2h ticket) before stepping, so on CUDA the worker blocks on the copy, not on the GPU. On CPU-only
runs the copy queues are host threads and the same code runs, so CI tests the ordering.

Results are those of the step after backward, bit for bit: each bucket is stepped once with the same kernel, inputs
and hyperparameters. What cannot be known during backward is global: the clip coefficient (from the norm over every
bucket) and an fp16 overflow on any rank. When either is expected (``global_scale_expected``: gradient clipping or
fp16 loss scaling configured), nothing is stepped early; the step runs after backward with the clip coefficient and
``1 / loss_scale`` folded into the kernel as a gradient scale (no pass over the host gradients for either).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class EarlyStepper:
    """One worker thread that steps offloaded buckets in the order they are handed over.

    Args:
        step: ``step(segments)``: runs the pipeline over a list of segments (releases the GIL).
        threads: CPU threads for the worker's kernel calls (``torch.set_num_threads`` in the worker).
        trace: record ``(event, name, perf_counter seconds)`` for ``"step_start"`` / ``"step_end"`` of each bucket
            in :attr:`events` (tests and benchmarks read it; off by default).
    """

    def __init__(self, step: Callable[[list], None], *, threads: int | None = None, trace: bool = False) -> None:
        self._step = step
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self.trace = trace
        self.events: list[tuple[str, str, float]] = []
        self.submitted = 0  # buckets handed over since construction
        self._lock = threading.Lock()

    def _init_worker(self) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._threads)  # OpenMP settings are per thread: the worker starts with defaults

    def submit(self, name: str, segments: list) -> None:
        """Steps ``segments`` (one bucket) on the worker, after every bucket submitted before."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="zeroshard-step", initializer=self._init_worker)
        self._futures.append(self._executor.submit(self._run, name, segments))
        self.submitted += 1

    def _run(self, name: str, segments: list) -> None:
        if self.trace:
            self._record("step_start", name)
        self._step(segments)
        if self.trace:
            self._record("step_end", name)

    def _record(self, event: str, name: str) -> None:
        with self._lock:
            self.events.append((event, name, time.perf_counter()))

    @property
    def pending(self) -> int:
        """Buckets handed over since the last :meth:`drain`."""
        return len(self._futures)

    def drain(self) -> None:
        """Waits for every submitted bucket; re-raises the first error (later buckets still finish first)."""
        futures, self._futures = self._futures, []
        error = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after every bucket finished
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

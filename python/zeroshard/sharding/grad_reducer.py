"""GradReducer: moves gradients from the module's parameters into flat buckets and reduces them across ranks.

During backward, a C++ post hook on every bucketed parameter's gradient accumulator (``_C.GradHooks``, as DDP's reducer
hooks its buckets) adds its fresh gradient into its bucket's full-size gradient buffer (``_C.GradBuffer``) and drops
``param.grad``; Python hears once per backward and once per complete bucket. When every parameter of a bucket has
reported (and all earlier buckets were launched, so every rank issues collectives in one order), the bucket is
reduce-scattered into its gradient shard asynchronously while backward goes on (at stage 3, a unit's flat parameters,
one per param group, wait for each other and go in one reduce-scatter, as FSDP2 reduces a module's parameters). The
first gradient of a parameter since its buffer was allocated or reduced is copied into it, later ones are added; a fresh
gradient shard is written by the reduction, not zeroed first. At every stage that is the only gradient collective:
stage 1 keeps the whole gradient buffer (read as zeros after the reduction, for the next accumulation) but needs only
its shard reduced, so its traffic is DDP's (ZeRO paper section 5: P_os has DDP's volume). At most ``max_inflight``
reductions are in flight; beyond that the oldest is waited on and (stages 2-3) its full buffer freed, which bounds the
gradient memory.

When backward ends (an autograd engine callback, with the strategy's ``post_backward`` as a fallback), buckets that
did not complete (parameters unused in this step) are launched with zeros for the missing gradients, so all ranks
take part in the same collectives and none hangs (the failure mode of pytorch issue 158719). Which parameters got a
gradient on this rank (since the last reduction, micro-batches included) is kept in :attr:`GradReducer.used`, for the
engine's step flags (:mod:`zeroshard.engine.step_flags`): a parameter no rank used must not be stepped.

With ``check_finite``, each reduced gradient shard is summed as its reduction completes (one read of the shard this rank
holds, no synchronisation; a NaN/inf makes the sum non-finite), and :meth:`GradReducer.take_flags` turns the sums into
one flag per bucket for the engine. A sum that overflows fp32 with finite elements flags too; the engine re-checks
flagged buckets exactly before acting.

A reduction that fails or times out (a dead or frozen rank) is re-raised as a
:class:`~zeroshard.sharding.collective_errors.CollectiveError` naming the bucket (its index and parameters), the step
and the rank.

During gradient accumulation (``require_grad_sync = False``) gradients only accumulate in the full buffers; the
reduction runs once, in the last micro-batch's backward, like DDP's ``no_sync``.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable

import torch
from torch.autograd import Variable

from zeroshard import _C
from zeroshard.sharding.collective_errors import describe_bucket, named_collective
from zeroshard.sharding.flat_param import FlatParam


class GradReducer:
    """Gradient hooks and bucketed reductions for a list of flat parameters.

    Args:
        flat_params: buckets in expected backward order (the launch order on every rank).
        collectives: ``_C.BucketedCollectives`` on the data-parallel process group.
        stage: 1 (full gradient buffers kept between steps) or 2-3 (full buffers freed after their reduce-scatter).
        max_inflight: reductions in flight before the oldest is waited on.
        groups: flat parameters reduced together, as lists of indices into ``flat_params`` that cover it in order
            (default: each on its own). A group is one reduce-scatter, launched once all its flat parameters have
            their gradients: stage 3 reduces a unit's flat parameters (one per optimizer param group) in one, as FSDP2
            reduces a module's parameters, so a unit costs one gradient collective whatever its param groups.
        on_complete: called with each flat parameter once all its gradients of this backward are in its buffer, in
            every backward, accumulation micro-batches included (stage 3 frees the unit then, when its backward is
            over: the reduction needs the gradients, not the weights).
        on_reduced: called with each flat parameter once its reduced gradient shard is complete (optimizer offload
            copies it to the host then, while backward goes on).
        on_finished: called once per backward when it is complete, with True if gradients were reduced (False for
            an accumulation micro-batch).
    """

    def __init__(
        self,
        flat_params: list[FlatParam],
        collectives: _C.BucketedCollectives,
        *,
        stage: int,
        max_inflight: int,
        groups: list[list[int]] | None = None,
        on_complete: Callable[[FlatParam], None] | None = None,
        on_reduced: Callable[[FlatParam], None] | None = None,
        on_finished: Callable[[bool], None] | None = None,
    ) -> None:
        self.flat_params = flat_params
        self.collectives = collectives
        self.stage = stage
        self.max_inflight = max_inflight
        self.on_complete = on_complete
        self.on_reduced = on_reduced
        self.on_finished = on_finished
        self.world_size = collectives.world_size
        self.require_grad_sync = True
        self.groups = groups if groups is not None else [[fi] for fi in range(len(flat_params))]
        if [fi for g in self.groups for fi in g] != list(range(len(flat_params))):
            raise ValueError(f"groups {self.groups} must list the flat parameters 0..{len(flat_params) - 1} in order")
        self._group_of = [gi for gi, g in enumerate(self.groups) for _ in g]
        self._next_launch = 0  # the next group to launch
        self._inflight: deque[tuple[int, object]] = deque()
        self._grads_ready = False
        self._used: list[set[int]] = [set() for _ in flat_params]  # taken from the hooks: see the `used` property
        self.check_finite = False
        self._sums: list[torch.Tensor | None] = [None] * len(flat_params)  # per bucket, since take_flags
        self.step_fn: Callable[[], int | None] = lambda: None  # the engine's step counter, for error messages
        # One C++ post hook per parameter on its gradient accumulator (csrc/grad/grad_hooks.h): it moves .grad into
        # the flat parameter's buffer; Python hears of a backward's first gradient and of each complete flat parameter.
        # The callbacks hold the reducer weakly: the C++ object is no part of Python's garbage collection, so a strong
        # reference would keep the reducer, its hooks and the parameters alive forever.
        ref = weakref.ref(self)
        self._hooks = _C.GradHooks(
            [fp.params for fp in flat_params],
            [fp.grad_buffer for fp in flat_params],
            lambda: _call(ref, "_start_backward"),
            lambda fi: _call(ref, "_on_complete", fi),
        )

    def remove_hooks(self) -> None:
        self._hooks.remove()

    @property
    def used(self) -> list[set[int]]:
        """Per flat parameter, the indices of its parameters that got a gradient on this rank since the last
        :meth:`take_flags` (micro-batches included)."""
        for fi, used in enumerate(self._used):
            used.update(self._hooks.take_used(fi))
        return self._used

    @property
    def grads_ready(self) -> bool:
        """True once a synchronised backward finished and :attr:`FlatParam.grad_shard` holds the reduced gradient."""
        return self._grads_ready

    def _on_complete(self, fi: int) -> None:
        """Hook callback: flat parameter ``fi`` has all its gradients of this backward. A create_graph backward runs
        hooks in grad mode: buffers, the unit freed and collectives stay out of its graph."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                self._completed(fi)
        else:
            self._completed(fi)

    def _completed(self, fi: int) -> None:
        if self.on_complete is not None:
            self.on_complete(self.flat_params[fi])
        if self.require_grad_sync and self._group_of[fi] == self._next_launch:
            self._launch_ready()

    def _start_backward(self) -> None:
        """First gradient of a backward: the reductions are completed when the autograd engine finishes it."""
        self._grads_ready = False
        Variable._execution_engine.queue_callback(self.finish_backward)

    def _launch_ready(self) -> None:
        """Launches, in order, every group whose flat parameters all have their gradients (the same order on every
        rank, whatever order this rank's hooks fired in)."""
        n = len(self.groups)
        while self._next_launch < n and all(self._hooks.complete(fi) for fi in self.groups[self._next_launch]):
            self._launch(self._next_launch)

    def _launch(self, gi: int) -> None:
        fps = [self.flat_params[fi] for fi in self.groups[gi]]
        fulls, shards, fresh = [], [], []
        for fp in fps:
            fp.full_grad_views()  # zeros where no parameter got a gradient (unused in this step)
            shard, accumulate = fp.grad_shard_for_reduction()  # a fresh shard is overwritten, not zeroed and added to
            fulls.append(fp.full_grad)
            shards.append(shard)
            fresh.append(not accumulate)
        accumulate = not all(fresh)
        if accumulate:  # one flag per collective: a fresh shard beside an accumulating one starts from zeros
            for shard, new in zip(shards, fresh):
                if new:
                    shard.zero_()
        scale = 1.0 / self.world_size
        bucket = sum(f.numel() for f in fulls)  # one reduce-scatter for the whole group
        handle = self.collectives.reduce_scatter(fulls, shards, bucket, scale, accumulate)
        self._inflight.append((gi, handle))
        self._next_launch = gi + 1
        while len(self._inflight) > self.max_inflight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        gi, handle = self._inflight.popleft()
        group = self.groups[gi]
        with named_collective(
            "gradient reduce-scatter",
            lambda: describe_bucket(
                group[0],
                [name for fi in group for name in self.flat_params[fi].names],
                sum(self.flat_params[fi].numel for fi in group),
            ),
            step=self.step_fn(),
            rank=self.collectives.rank,
            world_size=self.world_size,
        ):
            handle.wait()
        for fi in group:
            fp = self.flat_params[fi]
            if self.check_finite:  # a NaN/inf makes the sum non-finite: one read of the shard, 30x cheaper than
                # isfinite
                total = fp.grad_shard.sum(dtype=torch.float32)
                prev = self._sums[fi]
                self._sums[fi] = total if prev is None else prev + total  # a non-finite sum stays non-finite
            if self.stage == 1:
                fp.reset_full_grad()  # stage 1 keeps its full gradient buffer: the next gradients are copied in
            else:
                fp.free_full_grad()
            if self.on_reduced is not None:
                self.on_reduced(fp)

    def take_flags(self) -> tuple[torch.Tensor, list[set[int]]]:
        """Since the last call (then reset): per bucket, 1.0 where a reduced gradient shard's sum was NaN/inf (float32,
        on the gradients' device; zeros without ``check_finite``), and the indices of the parameters used here."""
        sums, used = self._sums, self.used
        self._sums = [None] * len(self.flat_params)
        self._used = [set() for _ in self.flat_params]
        device = self.flat_params[0].device if self.flat_params else torch.device("cpu")
        if all(t is None for t in sums):
            return torch.zeros(len(sums), dtype=torch.float32, device=device), used
        zero = torch.zeros((), dtype=torch.float32, device=device)
        totals = torch.stack([zero if t is None else t for t in sums])
        return torch.isfinite(totals).logical_not().float(), used

    @torch.no_grad()
    def finish_backward(self) -> None:
        """Ends a backward pass: launches what is left (in bucket order) and waits for every reduction.

        Called by the autograd engine when backward ends and again by the strategy after backward: the second call
        does nothing. If no hook fired at all (no parameter used on this rank), the second call still launches every
        bucket, with zero gradients, so this rank joins the collectives the other ranks issue.
        """
        active, self._hooks.active = self._hooks.active, False
        if not self.require_grad_sync:
            self._hooks.reset_reported()
            if active and self.on_finished is not None:
                self.on_finished(False)
            return
        if self._grads_ready:
            return
        while self._next_launch < len(self.groups):
            self._launch(self._next_launch)
        while self._inflight:
            self._complete_oldest()
        self._next_launch = 0
        self._hooks.reset_reported()
        self._grads_ready = True
        if self.on_finished is not None:
            self.on_finished(True)

    @torch.no_grad()
    def consume(self) -> None:
        """Marks the reduced gradients as used by an optimizer step. The next reduction goes into fresh zeroed
        gradient shards; the used ones stay the masters' ``.grad`` until ``optimizer.zero_grad()``, as a DDP
        parameter's gradient does (a step without backward, e.g. SWA's batch-norm epoch, then reuses it, as there)."""
        self._grads_ready = False
        for fp in self.flat_params:
            fp.release_grad_shard()


def _call(ref: weakref.ref, method: str, *args) -> None:
    reducer = ref()
    if reducer is not None:
        getattr(reducer, method)(*args)

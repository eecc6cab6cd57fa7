"""Optimizer (and parameter) offload: the host side of ZeRO-Offload, pipelined with the copies.

Where the data is, per rank, with ``offload_optimizer=True`` (ZeRO-Offload, Ren et al. 2021, section 4):

* device: the compute-dtype parameters (whole at stages 1-2, shards at stage 3) and, during backward only, the
  gradient buckets and the gradient shard each reduce-scatter produces;
* host: the fp32 master shard, ``exp_avg`` and ``exp_avg_sq`` and a gradient shard in ``reduce_dtype``, all exact-size
  buffers from ``_C.empty_host`` (page-locked on CUDA; never the caching host allocator's power-of-two blocks).
  With ``offload_params=True`` (stage 3) the compute-dtype parameter shard lives on the host too.

One step:

1. backward: as each bucket's reduce-scatter finishes, its gradient shard is copied device-to-host on the
   ``d2h`` copy queue (its own CUDA stream) and the device copy is released (:meth:`OptimizerOffload.gradient_reduced`);
2. step: ``_C.HostAdamPipeline`` walks the flat parameters in chunks of ``offload_chunk_size`` elements: it waits
   only for that flat parameter's gradient copy, runs the fused CPU Adam on the chunk (reading the gradient in its
   own dtype and writing the compute-dtype weights into one of two pinned upload buffers in the same pass), and
   enqueues the chunk's host-to-device copy on the ``h2d`` queue while it steps the next chunk. With parameter
   offload the step writes the host parameter shard directly and nothing is uploaded;
3. the compute stream waits (on the device, not the host) for the last upload before the next all-gather.

With ``overlap_step=True`` (:mod:`zeroshard.offload.overlap`) step 2 starts during step 1: each bucket is handed to a
host worker as soon as its gradient copy is enqueued, and stepped there while backward goes on; ``OffloadedAdam.step``
then steps what is left and waits for the worker. Unless gradient clipping or fp16 loss scaling is expected
(``global_scale_expected``), whose factors are known only after backward: then the whole step runs after backward,
with both factors folded into the kernel.

On CPU-only runs the queues are host threads doing ``memcpy``: the chunking, the tickets and the waits are the same,
so CI tests the pipeline's ordering.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

from zeroshard import _C
from zeroshard.offload.overlap import EarlyStepper
from zeroshard.ops import QUANT_BLOCK
from zeroshard.optim.cpu_adam import CPUAdam, _check_group, run_closure, step_count, step_hooks, step_hyper
from zeroshard.optim.state_format import moment_bytes, new_moments
from zeroshard.sharding.flat_param import FlatParam

GIB = 2**30


def host_bytes_needed(
    shard_numels: list[tuple],
    *,
    grad_bytes: int,
    param_bytes: int,
    offload_params: bool,
    chunk_elems: int,
) -> int:
    """Host bytes one rank's offload allocates: per trainable shard element the fp32 master (4 bytes), ``exp_avg`` +
    ``exp_avg_sq`` in the flat parameter's state format (``zeroshard.optim.state_format.moment_bytes``: fp32 8, bf16
    4, int8 2 plus 8 per block of 2048 of the shard) and the gradient shard (``grad_bytes``); the compute-dtype
    parameter shard (``param_bytes``) per shard element with parameter offload (frozen ones too); and the two upload
    buffers (``chunk_elems`` * 4 bytes each; at least one 2048-element int8 block's when a shard has int8 state:
    ``_C.HostAdamPipeline.int8_chunk_elems``).

    Args:
        shard_numels: ``(shard elements, trainable)`` or ``(shard elements, trainable, state format)`` per flat
            parameter (format default ``torch.float32``).
    """
    int8 = any(fmt and fmt[0] == "int8" for _, trainable, *fmt in shard_numels if trainable)
    total = 2 * max(chunk_elems, QUANT_BLOCK if int8 else 1) * 4
    for numel, trainable, *fmt in shard_numels:
        if trainable:
            total += numel * (4 + grad_bytes) + moment_bytes(numel, fmt[0] if fmt else torch.float32)
        if offload_params:
            total += numel * param_bytes
    return total


def threads_per_rank(local_world_size: int) -> int:
    """CPU threads for one rank's host step: the cores this process may run on, split between the ranks of one host
    (DeepSpeed leaves each rank at all cores, and ranks on one host then oversubscribe them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


class OptimizerOffload:
    """Host gradient buffers, the two copy queues and the pipelined host step of one engine.

    Args:
        flat_params: the trainable flat parameters whose masters live on the host.
        device: the compute device (``cuda:N``: CUDA streams; ``cpu``: host copy threads).
        pin: page-lock the host buffers (CUDA runs).
        chunk_elems: elements per pipeline chunk.
        overlap_step: step each bucket on a host worker as soon as its gradient copy is enqueued (during backward).
        threads: CPU threads of that worker.

    Attributes:
        d2h, h2d: ``_C.CopyQueue`` for gradient shards (device to host) and updated weights (host to device).
        host_grads: ``{id(flat_param): tensor}``: 1-D host gradient shard, ``layout.shard_numel`` elements, the flat
            parameter's ``grad_shard_dtype``.
        global_scale_expected: set (by the strategy, or by the user of the engine) when gradient clipping or fp16 loss
            scaling will act on this step's gradients: nothing is stepped during backward then.
        stepper: the :class:`~zeroshard.offload.overlap.EarlyStepper` (None without ``overlap_step``).
        on_gradient_copied: called with each flat parameter right after its gradient copy is enqueued (set by
            :class:`OffloadedAdam` to hand the bucket to the stepper).
    """

    def __init__(
        self,
        flat_params: list[FlatParam],
        *,
        device: torch.device,
        pin: bool,
        chunk_elems: int,
        overlap_step: bool = False,
        threads: int | None = None,
    ) -> None:
        self.flat_params = flat_params
        self.device = device
        self.d2h = _C.make_copy_queue(device)
        self.h2d = _C.make_copy_queue(device)
        self.pipeline = _C.HostAdamPipeline(self.d2h, self.h2d, chunk_elems, pin)
        self.host_grads = {id(fp): _C.empty_host(fp.layout.shard_numel, fp.grad_shard_dtype, pin) for fp in flat_params}
        self._tickets: dict[int, int] = {}  # id(flat_param) -> d2h ticket of its gradient in this step
        self.global_scale_expected = False
        self.stepper = EarlyStepper(self.step, threads=threads) if overlap_step else None
        self.on_gradient_copied = None

    @torch.no_grad()
    def gradient_reduced(self, fp: FlatParam) -> None:
        """GradReducer callback, once a bucket's reduced gradient shard is complete: copy it to the host.

        A host gradient that is still pending (a second backward before its optimizer stepped or zeroed it) gets the
        new one added, after its copy completed, so gradients accumulate as ``param.grad`` does. A master toggled off
        (``requires_grad=False``) gets none.
        """
        host = self.host_grads.get(id(fp))
        if host is None or not fp.master.requires_grad:
            fp.release_grad_shard()
            return
        pending = self._tickets.get(id(fp))
        if pending is not None:
            self.d2h.synchronize(pending)
            host.add_(fp.grad_shard.to(host.device))
        else:
            self.d2h.wait_current_stream()  # the reduce-scatter's result is ordered on the current stream
            self._tickets[id(fp)] = self.d2h.copy(host, fp.grad_shard)
        fp.release_grad_shard()  # the queue keeps it alive until copied; the device memory is reused afterwards
        if self.on_gradient_copied is not None:
            self.on_gradient_copied(fp)

    def has_gradient(self, fp: FlatParam) -> bool:
        return id(fp) in self._tickets

    def wait_for_gradients(self, flat_params: list[FlatParam] | None = None) -> list[torch.Tensor]:
        """Blocks until every gradient copy of this step is done; returns the host gradient shards of ``flat_params``
        (default: all) that hold one."""
        self.d2h.synchronize(self.d2h.last_ticket())
        flat_params = self.flat_params if flat_params is None else flat_params
        return [self.host_grads[id(fp)] for fp in flat_params if id(fp) in self._tickets]

    def take_gradient(self, fp: FlatParam) -> torch.Tensor | None:
        """For optimizers that read ``.grad``: this step's host gradient of ``fp`` as an fp32 tensor of its own (the
        host buffer is overwritten by the next backward), after its copy; ``None`` if it got none."""
        ticket = self._tickets.pop(id(fp), None)
        if ticket is None:
            return None
        self.d2h.synchronize(ticket)
        return self.host_grads[id(fp)].to(torch.float32, copy=True)

    def gradients_consumed(self, flat_params: list[FlatParam] | None = None) -> None:
        """Drops the pending host gradients of ``flat_params`` (default: all): their optimizer stepped or zeroed."""
        if flat_params is None:
            self._tickets.clear()
        for fp in flat_params or []:
            self._tickets.pop(id(fp), None)

    def segment(
        self, fp: FlatParam, state: dict[str, Any], group: dict[str, Any], scale: tuple[float, float] = (1.0, 1.0)
    ) -> tuple:
        """One flat parameter's ``_C.HostAdamPipeline`` segment tuple for :meth:`step`: where the updated weights go
        depends on where the parameter shard lives (the host shard itself with parameter offload, else uploaded into
        the shard). ``scale``: ``(grad_unscale, grad_clip)`` the kernel multiplies the gradient by. int8 moments
        (uint8 codes) add their two absmax tensors."""
        param_out = fp.shard if fp.host_shard else None
        device_param = None if fp.host_shard else fp.shard
        grad = self.host_grads[id(fp)]
        seg = (fp.master.detach(), state["exp_avg"], state["exp_avg_sq"], grad, self._tickets[id(fp)], param_out,
               device_param, *step_hyper(state, group), *scale)  # fmt: skip
        if state["exp_avg"].dtype == torch.uint8:
            return (*seg, state["exp_avg_absmax"], state["exp_avg_sq_absmax"])
        return seg

    def step(self, segments: list) -> None:
        """Steps ``segments`` (from :meth:`segment`) through ``_C.HostAdamPipeline``, in order: fp32, bf16 and int8
        moments alike (one optimizer holds fp32 and int8 under int8: flat parameters of small parameters keep fp32
        moments, ``CPUAdam.min_8bit_size``)."""
        self.pipeline.step(segments, False)

    def copy_stats(self) -> dict[str, dict[str, float]]:
        """Bytes the copy queues moved and the time the copies took (device time on CUDA) since the last reset."""
        out = {}
        for name, queue in (("d2h", self.d2h), ("h2d", self.h2d)):
            nbytes, seconds = queue.stats()
            out[name] = {"bytes": int(nbytes), "seconds": float(seconds)}
        return out

    def reset_copy_stats(self) -> None:
        self.d2h.reset_stats()
        self.h2d.reset_stats()


class OffloadedAdam(CPUAdam):
    """:class:`~zeroshard.CPUAdam` over host master shards, stepped by the offload pipeline.

    The gradients are not read from ``.grad``: each master's gradient is the host gradient shard its flat parameter's
    copy fills (in ``reduce_dtype``, which may be bf16/fp16: the kernel upcasts while loading). The optimizer state
    (``step`` a plain number, ``exp_avg`` and ``exp_avg_sq`` in ``state_dtype``, torch's keys; int8 adds the absmax
    tensors) is created when the optimizer is built, so the host memory is taken, and checked, before training
    starts. With fp32 state ``state_dict()`` loads into ``torch.optim.AdamW`` and back. Every format steps through
    ``_C.HostAdamPipeline`` (int8 in chunks of whole 2048-element blocks). Under int8 the masters in
    ``fp32_state_params`` (the engine's flat parameters of small parameters) keep fp32 moments, in the same
    :meth:`step`.

    Args:
        param_groups: groups over the master shards (as ``CPUAdam``).
        offload: the engine's :class:`OptimizerOffload`.
        flat_of: ``{id(master): flat_param}``.
        defaults: ``CPUAdam`` keyword arguments.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        offload: OptimizerOffload,
        flat_of: dict[int, FlatParam],
        **defaults: Any,
    ) -> None:
        super().__init__(param_groups, **defaults)
        self.offload = offload
        self._flat_of = flat_of
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = self._new_state(p)
        self.grad_unscale = 1.0  # folded into the next step (fp16: 1 / loss scale), then reset
        self.grad_clip = 1.0  # the clip coefficient, likewise
        self._stepped: set[int] = set()  # id(flat_param) stepped during this backward
        if offload.stepper is not None:
            offload.on_gradient_copied = self._step_during_backward

    def _new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """As ``CPUAdam``'s, with the moments in counted exact-size host buffers (1-D, like the master shards), in
        ``p``'s :meth:`~CPUAdam.state_format`: fp32 or bf16 moments; int8: uint8 codes and fp32 absmax of
        ``ceil(numel / 2048)``."""

        def host_zeros(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            return _C.empty_host(math.prod(shape), dtype, False).zero_()

        return {"step": 0, **new_moments((p.numel(),), self.state_format(p), zeros=host_zeros)}

    def gradients(self) -> list[torch.Tensor]:
        """The host gradient shards of this optimizer's masters (waits for their copies): what clipping and loss
        scaling act on."""
        return self.offload.wait_for_gradients(self._own_flat_params())

    def stepped_during_backward(self, fp: FlatParam) -> bool:
        """Whether ``overlap_step`` already stepped ``fp`` during this backward (its gradient is consumed)."""
        return id(fp) in self._stepped

    def _own_flat_params(self) -> list[FlatParam]:
        return [self._flat_of[id(p)] for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops this optimizer's pending host gradients (they would otherwise accumulate into the next backward's)."""
        super().zero_grad(set_to_none)
        self.offload.gradients_consumed(self._own_flat_params())

    def fold_grad_unscale(self, unscale: float) -> None:
        """fp16: multiply the gradients by ``unscale`` (``1 / loss_scale``) inside the next step instead of in a pass of
        their own (``ShardedLossScaler.unscale_and_check``)."""
        self._check_not_stepped("fp16 loss scaling")
        self.grad_unscale = float(unscale)

    def fold_grad_clip(self, coef: torch.Tensor | float) -> None:
        """Clip by norm: multiply the gradients by ``coef`` (a 0-dim fp32 tensor or float, <= 1) inside the next step,
        after the unscale; bit for bit what ``g.mul_(coef)`` on fp32 host gradients gives (``clip_grads_``)."""
        self._check_not_stepped("gradient clipping")
        self.grad_clip = float(coef)

    def _check_not_stepped(self, what: str) -> None:
        if self._stepped:
            raise RuntimeError(
                f"zeroshard: {what} acts on gradients that overlap_step=True already stepped during backward. "
                "Declare it before backward (ZeroStrategy does when the Trainer has gradient_clip_val or "
                "precision='16-mixed'; with the engine alone set engine.offload.global_scale_expected = True), or "
                "use overlap_step=False."
            )

    def _group_of(self) -> dict[int, tuple[int, dict[str, Any]]]:
        return {id(p): (gi, group) for gi, group in enumerate(self.param_groups) for p in group["params"]}

    def _segment(self, fp: FlatParam, p: torch.Tensor, group: dict[str, Any]) -> tuple:
        """Counts the step of master ``p`` and returns its pipeline segment, with the folded gradient scale."""
        state = self.state[p]
        state["step"] = step_count(state["step"]) + 1  # a loaded checkpoint may hold torch's 0-dim tensor
        return self.offload.segment(fp, state, group, (self.grad_unscale, self.grad_clip))

    def _step_during_backward(self, fp: FlatParam) -> None:
        """OptimizerOffload callback: hands ``fp``'s bucket to the worker, unless a global scale is still to come."""
        if self.offload.global_scale_expected or fp.master is None:
            return
        found = self._group_of().get(id(fp.master))
        if found is None:  # in no param group: nothing steps it
            return
        gi, group = found
        _check_group(gi, group)
        self._stepped.add(id(fp))
        self.offload.stepper.submit(fp.names[0], [self._segment(fp, fp.master, group)])

    @step_hooks
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Steps every master whose gradient was reduced in this step, through the offload pipeline (what was not
        stepped during backward already), then waits for the overlapped steps."""
        loss = run_closure(closure)
        work = []
        for gi, group in enumerate(self.param_groups):
            _check_group(gi, group)
            for p in group["params"]:
                fp = self._flat_of[id(p)]
                if self.offload.has_gradient(fp) and id(fp) not in self._stepped:
                    work.append((fp, p, group))
        segments = [self._segment(fp, p, group) for fp, p, group in work]
        consumed = [fp for fp, _, _ in work] + [fp for fp in self._own_flat_params() if id(fp) in self._stepped]
        try:
            if self.offload.stepper is not None:
                self.offload.stepper.drain()
            if segments:
                self.offload.step(segments)
            elif self._stepped:  # compute issued after this must see the uploads of the overlapped steps
                self.offload.h2d.current_stream_wait(self.offload.h2d.last_ticket())
        finally:
            self._stepped.clear()
            self.grad_unscale = self.grad_clip = 1.0
            self.offload.gradients_consumed(consumed)  # only this optimizer's: another's may still be pending
        return loss


def check_host_budget(nbytes: int, local_world_size: int, what: str) -> None:
    """Raises ValueError before anything is allocated if ``local_world_size`` ranks of ``nbytes`` each do not fit in
    the host's available memory (``MemAvailable``)."""
    _C.check_host_budget(nbytes * local_world_size, f"{what} ({nbytes / GIB:.2f} GiB x {local_world_size} ranks)")

"""ZeRO stage 3 at run time: each unit's parameters exist whole only while the unit runs.

Forward: a pre-hook all-gathers the unit (or waits for its prefetch) and starts the all-gather of the next unit in the
recorded forward order (with the units after it in the same collective while they fit ``prefetch_bucket_size``); a
post-hook frees the full buffer and puts a gradient hook on the unit's outputs that gathers the unit again (and
prefetches the unit that runs backward next) before the unit's own backward (FSDP2's pre-backward).
Inside a step the last unit of the forward stays gathered instead: backward starts with it, so freeing it would only
gather it again at once (torchtitan sets ``reshard_after_forward=False`` on its last block for the same reason).
Backward: a unit is freed once its backward is over, i.e. both the gradients of its inputs (a gradient hook on a view
of its input, or an autograd function on several inputs, as FSDP2's post-backward) and the gradients of its
trainable flat parameters are all in their buffers (whether or not this backward reduces them: gradient-accumulation
micro-batches free their units too): frozen weights (LoRA's base weights) stay until the last gradient that needs them
is computed.
The root unit (parameters no other unit claims: embeddings, final norm, head) stays gathered from the start of a step to
the end of its backward, as FSDP2 does with ``reshard_after_forward=None`` on the root; outside a step it is gathered
by the forward of the smallest module holding all its parameters (and of each module holding one), and freed after it
unless a backward follows.

The hooks run on every forward, in a training step or not, under ``torch.no_grad()`` too (FSDP2 and DeepSpeed do the
same), so evaluation, ``generate`` and a user's own inference see whole parameters. While a unit is freed, its module
slots hold :class:`~zeroshard.sharding.sharded_param.ShardedParameter` placeholders: reads outside a forward gather the
unit on demand on every rank (a collective), whole-tensor writes land in the shard. The hooks are hidden from
``torch.compile`` (``torch.compiler.disable``): a compiled block graph-breaks at its hooks and compiles its body.

Every gather is one bucketed all-gather over the unit's flat parameters, sent from one packed row (the unit's shards
back to back, then the tag: :func:`pack_shards`), on a process group of its own, carrying a tag (the unit's index and
phase, :mod:`zeroshard.sharding.gather_check`) that every rank checks before using the buffer: ranks that took
different code paths end with an error naming every rank's unit, never training on parameters mixed across units (the
failure mode of pytorch issue 158719). A wait that fails (a collective timeout, a dead rank) is
re-raised as a :class:`~zeroshard.sharding.collective_errors.CollectiveError` naming the unit, the step and the rank.
``check_gather_order=True`` (debug) also exchanges the unit before every all-gather, which names the divergence even
where the units' sizes differ (the backend may otherwise abort on the mismatched sizes first).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zeroshard import _C
from zeroshard.sharding import gather_check
from zeroshard.sharding.collective_errors import CollectiveError, DivergedRanksError, collective_error, named_collective
from zeroshard.sharding.event_clock import EventClock, TimedCollectives
from zeroshard.sharding.flat_param import FlatParam
from zeroshard.sharding.runtime_hook import RuntimeHook
from zeroshard.sharding.sharded_param import ShardedParameter

# Stage 3's default prefetch bucket, in elements (8 MB of fp32): units of a few hundred thousand elements share an
# all-gather (0.83 against 0.74 of DDP's speed at 16 layers x 64 on 2 gloo ranks, issue 22), while units of millions
# (real models' blocks) are still gathered one at a time, so their memory is as before. DeepSpeed's is 5e7.
PREFETCH_BUCKET_SIZE = 2_000_000


class Unit:
    """A unit's flat parameters and gather state."""

    def __init__(
        self, name: str, module: nn.Module, flat_params: list[FlatParam], is_root: bool, persistent: bool = False
    ) -> None:
        self.name = name or "<root>"
        self.module = module
        self.flat_params = flat_params
        self.index = -1  # position in ShardedUnits.units, set there
        self._trainable = [fp for fp in flat_params if fp.trainable]
        self.bucket: int | None = None  # elements of one rank's row in the unit's all-gather (set at its first gather)
        self.tag_expected: dict[bool, list[float]] = {}  # per phase: every rank's tag, as the check reads them
        self.is_root = is_root
        self.persistent = persistent  # below the persistence threshold: gathered once, never freed
        self.pending = None  # CollectiveHandle of an all-gather in flight
        self.staging: list[torch.Tensor] | None = None  # device copies of host shards feeding that all-gather
        self.complete = 0  # trainable flat parameters with all their gradients of this backward
        self.inputs_pending = 0  # forwards of this step whose input gradients are not computed yet
        self.accessed = False  # gathered outside a forward because a placeholder was read (freed on the next event)
        self.dirty = False  # its gathered values may have been written: write them back to the shard when freed
        self.tag_sent: list[int] | None = None  # gather tag of the all-gather in flight (gather_check.encode)
        self.tags: torch.Tensor | None = None  # every rank's tag, filled by that all-gather
        self.tag_tensors: dict[bool, torch.Tensor] = {}  # this rank's tag per phase (backward or not), as sent
        self.backward = False  # whether the all-gather in flight is for backward
        self.tag_slot: torch.Tensor | None = None  # the tag's place in the packed row (pack_shards), if packed
        self.slot_phase: bool | None = None  # the phase whose tag the slot holds
        self.reason: str | None = None  # what the all-gather in flight is for, outside forward/backward (for errors)

    @property
    def trainable(self) -> list[FlatParam]:
        return self._trainable

    @property
    def is_gathered(self) -> bool:
        for fp in self.flat_params:
            if not fp._gathered:
                return False
        return True


class _SharedHandle:
    """One all-gather of several units (:meth:`ShardedUnits._unshard_group`): each unit holds it as its ``pending``
    handle; the first unit waited for waits for the collective, the others find it done."""

    __slots__ = ("_handle",)

    def __init__(self, handle) -> None:
        self._handle = handle

    def wait(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.wait()


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once every gradient of those inputs is computed, i.e. once the
    unit's own backward is over (FSDP2's ``RegisterPostBackwardFunction``). Used for units with several inputs that
    require grad; one such input (a block's usual case) gets a hooked view instead (:func:`_post_backward_inputs`)."""

    @staticmethod
    def forward(ctx, runtime: ShardedUnits, index: int, *tensors: torch.Tensor):
        ctx.runtime, ctx.index = runtime, index
        if len(tensors) == 1:
            return (tensors[0].view_as(tensors[0]),)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.runtime._post_backward_hooks[ctx.index](None)  # the one-input path's hook: same event, same profiler range
        return (None, None, *grads)


def _post_backward_inputs(runtime: ShardedUnits, index: int, tensors: list[torch.Tensor]):
    """What unit ``index`` gets instead of its inputs that require grad, so that ``post_backward_event(index)`` runs
    once all their gradients are computed. One input: a view of it with a gradient hook, which fires once the view's
    gradient is complete; only the unit uses the view, so that is the end of the unit's backward, whatever else uses
    the input (a residual connection around the unit). A view and a hook cost a third of ``Function.apply`` here, and
    the unit may change the view in place. Several: :class:`_PostBackward` over all of them, one call for all."""
    if len(tensors) == 1:
        view = tensors[0].view_as(tensors[0])
        view.register_hook(runtime._post_backward_hooks[index])
        return (view,)
    return _PostBackward.apply(runtime, index, *tensors)


def _wrap_inputs(runtime: ShardedUnits, index: int, args: tuple, kwargs: dict):
    """A forward's ``(args, kwargs)`` with :func:`_post_backward_inputs` applied to the tensors that require grad, or
    None if none does; positional tensors alone (a block's usual inputs) skip the pytree walk."""
    if kwargs or not all(type(t) is torch.Tensor for t in args):
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not idx:
            return None
        for i, t in zip(idx, _post_backward_inputs(runtime, index, [flat[i] for i in idx])):
            flat[i] = t
        return tree_unflatten(flat, spec)
    grads = [t for t in args if t.requires_grad]
    if not grads:
        return None
    wrapped = iter(_post_backward_inputs(runtime, index, grads))
    return tuple(next(wrapped) if t.requires_grad else t for t in args), kwargs


class ShardedUnits:
    """Gather-on-use hooks for a list of units (the first one is the root).

    Args:
        units: units in registration order, root first.
        collectives: ``_C.BucketedCollectives`` for the unit all-gathers: on a group of their own
            (:func:`~zeroshard.sharding.gather_check.dedicated_group`), so they never meet another kind of collective.
        prefetch: all-gather the next unit (forward and backward order, recorded on the first step) while the current
            one computes.
        prefetch_bucket_size: a prefetch all-gathers the following units together, in one collective, while their
            gathered sizes sum to at most this many elements (at least the next unit; 0: one unit per all-gather).
        check_gather_order: debug setting; before every all-gather, check that all ranks gather the same unit.
    """

    def __init__(
        self,
        units: list[Unit],
        collectives: _C.BucketedCollectives,
        *,
        prefetch: bool,
        check_gather_order: bool,
        prefetch_bucket_size: int = 0,
    ) -> None:
        self.units = units
        self.collectives = collectives
        self.prefetch = prefetch
        self.prefetch_bucket_size = prefetch_bucket_size
        self.check_gather_order = check_gather_order
        self.forward_order: list[int] = []  # recorded on the first forward, then used for prefetch
        self._recording = True
        self.keep_last = True  # the last unit of the forward stays gathered into backward, inside a step
        self._in_step = False  # between begin_step() and the end of backward (or end_eval_step())
        self.pinned = False  # inside gathered_parameters(): every unit stays whole, hooks do nothing
        self._param_stream: torch.cuda.Stream | None = None  # parameter offload: host-to-device copies + all-gather
        self._handles = []
        self._root_gathered_by: list[bool] = []  # per root-hook call: whether it gathered the root unit
        self.step_fn = lambda: None  # the engine's step counter, for error messages
        self._deferred_tags: list[tuple[int, torch.Tensor]] = []  # CUDA: tags checked at the end of the step
        self.tagged = gather_check.ENABLED  # off only in bench_gather_check.py's reference runs
        self._unit_of = {id(fp): u for u in units for fp in u.flat_params}
        self._activity: str | None = None  # what gathers units outside forward/backward now (see activity())
        self._maybe_accessed = False  # False: no unit is gathered for a placeholder read (unit.accessed)
        # what the backward autograd functions call: the event methods, or timed ones while a clock is attached
        self.pre_backward_event, self.post_backward_event = self._pre_backward, self._post_backward
        self._hooks: list[tuple[RuntimeHook, object]] = []  # every forward hook and its untimed callable
        self._pre_backward_hooks = [self._make_pre_backward_hook(i) for i in range(len(units))]  # made once
        self._post_backward_hooks = [self._make_post_backward_hook(i) for i in range(len(units))]
        for i, unit in enumerate(units):
            unit.index = i
            pack_shards(unit, gather_check.TAG_ELEMS if self.tagged else 0)
        for i, unit in enumerate(units):
            if unit.is_root:
                continue
            pre = self._hook(self._make_pre_forward(i), "zeroshard::pre_forward")
            post = self._hook(self._make_post_forward(i), "zeroshard::post_forward")
            self._handles.append(unit.module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(post))
        root = units[0].module
        for module in _root_hook_modules(root, units[0]):
            pre = self._hook(self._root_pre_forward, "zeroshard::root_pre_forward")
            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(
                module.register_forward_hook(self._hook(self._root_post_forward, "zeroshard::root_post_forward"))
            )
        _attach_slots(root, units, self)
        # Lets Hugging Face's generate() keep every rank stepping until all are done (synced_gpus, its ZeRO-3 / FSDP
        # mode: forwards hold collectives), and lets dynamo treat the modules as FSDP-managed ones (parameters are
        # graph inputs, so the swap between placeholders and parameters around each use is seen, not baked in).
        for m in root.modules():
            m._is_fsdp_managed_module = True
            m._fsdp_use_orig_params = True

    def _hook(self, fn, label: str) -> RuntimeHook:
        hook = RuntimeHook(fn, label)
        self._hooks.append((hook, fn))
        return hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def time_events(self, clock: EventClock | None) -> None:
        """Benchmarks: records every unit event's main-thread CPU time, its all-gathers excluded, into ``clock``
        (:mod:`~zeroshard.sharding.event_clock`); None stops. Swaps the hooks' callables and the gather collectives,
        so the hooks run no timing code while no clock is attached. The debug gather-order check
        (``check_gather_order``) is not excluded."""
        collectives = getattr(self.collectives, "inner", self.collectives)
        if clock is None:
            self.collectives = collectives
            for hook, fn in self._hooks:
                hook.fn = fn
            self.pre_backward_event, self.post_backward_event = self._pre_backward, self._post_backward
            return
        self.collectives = TimedCollectives(collectives, clock)
        for hook, fn in self._hooks:
            hook.fn = clock.timed(hook.label.split("::")[-1], fn)
        self.pre_backward_event = clock.timed("pre_backward", self._pre_backward)
        self.post_backward_event = clock.timed("post_backward", self._post_backward)

    # -- gather and free -----------------------------------------------------------------------------------------------

    @contextmanager
    def activity(self, what: str) -> Iterator[None]:
        """Names what the all-gathers inside the block are for (a state dict, a checkpoint, gathered_parameters), so
        that a failed or timed-out one says so instead of blaming a forward."""
        outer, self._activity = self._activity, what
        try:
            yield
        finally:
            self._activity = outer

    def unshard(self, index: int, *, wait: bool = True, reason: str | None = None) -> None:
        """All-gathers unit ``index`` (or waits for the all-gather already in flight). ``reason``: what the gather is
        for when it is not a forward or backward (named if it fails; default: the current :meth:`activity`)."""
        unit = self.units[index]
        if unit.pending is None and not unit.is_gathered:
            tag, fulls = self._prepare_gather(unit, reason)
            # one bucket, so one all-gather: every rank's row is its shards followed by its tag (gather_check)
            if unit.flat_params[0].host_shard and fulls[0].is_cuda:
                unit.pending, unit.staging = self._gather_from_host(unit, fulls, unit.bucket, tag)
            else:
                shards = [fp.shard for fp in unit.flat_params] + tag
                try:
                    unit.pending = self.collectives.all_gather(shards, fulls, unit.bucket)
                except RuntimeError as err:
                    self._raise_named(err, "all-gather (launch)", unit)
        if wait and unit.pending is not None:
            self._wait(unit)

    def _prepare_gather(self, unit: Unit, reason: str | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Before ``unit``'s all-gather: its phase and reason, the debug order check, its full buffers' memory and
        its tag. Returns this rank's tag (a list of one, or empty with the check off) and the all-gather's outputs:
        the full buffers, then the buffer for every rank's tag; sets ``unit.bucket`` (their elements) once."""
        unit.backward = torch._C._current_graph_task_id() != -1
        unit.reason = None if unit.backward else (reason or self._activity)
        if self.check_gather_order:
            self._check_same_unit(unit.index)
        for fp in unit.flat_params:
            fp.alloc_full()
        tag, tags = self._tag_buffers(unit.index, unit)
        fulls = [fp.full for fp in unit.flat_params] + tags
        if unit.bucket is None:
            unit.bucket = sum(t.numel() for t in fulls)
        return tag, fulls

    @staticmethod
    def _groupable(unit: Unit) -> bool:
        """Whether the unit can share an all-gather with others: device shards (not parameter offload's host ones)."""
        return not unit.flat_params[0].host_shard

    def _unshard_group(self, indices: list[int]) -> None:
        """Launches one all-gather for several units (none gathered or in flight, none with host shards): every
        rank's row is each unit's shards and tag, unit after unit. Each unit keeps its own full buffers and tag, is
        waited for and checked at its own use (:meth:`_wait`; the collective is waited for once)."""
        shards, fulls, bucket = [], [], 0
        units = [self.units[i] for i in indices]
        for unit in units:
            tag, unit_fulls = self._prepare_gather(unit, None)
            shards += [fp.shard for fp in unit.flat_params] + tag
            fulls += unit_fulls
            bucket += unit.bucket
        try:
            handle = _SharedHandle(self.collectives.all_gather(shards, fulls, bucket))
        except RuntimeError as err:
            self._raise_named(err, "all-gather (launch)", units[0])
        for unit in units:
            unit.pending = handle

    def _tag_buffers(self, index: int, unit: Unit) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's gather tag for unit ``index`` (:data:`~zeroshard.sharding.gather_check.TAG_ELEMS` elements, the
        parameters' dtype and device) and the buffer receiving every rank's tag, as lists to append to the all-gather's
        shards and fulls (empty when the check is off)."""
        fp0 = unit.flat_params[0]
        if not self.tagged:
            return [], []
        tag = unit.tag_tensors.get(unit.backward)
        if tag is None:  # made once per unit and phase: only ever read by the all-gathers
            sent = gather_check.encode(index, unit.backward)
            tag = torch.tensor(sent, dtype=fp0.dtype)
            tag = tag.to(fp0.full.device, non_blocking=True) if fp0.full.is_cuda else tag
            unit.tag_tensors[unit.backward] = tag
            unit.tag_expected[unit.backward] = [float(v) for v in sent] * self.collectives.world_size
        unit.tag_sent = unit.tag_expected[unit.backward][: gather_check.TAG_ELEMS]
        if unit.tags is None:
            world = self.collectives.world_size
            unit.tags = torch.empty(world * gather_check.TAG_ELEMS, dtype=fp0.dtype, device=fp0.full.device)
        if unit.tag_slot is not None:  # packed: the tag goes behind the shards, so the row is sent as it lies
            if unit.slot_phase is not unit.backward:
                unit.tag_slot.copy_(tag)
                unit.slot_phase = unit.backward
            tag = unit.tag_slot
        return [tag], [unit.tags]

    def _check_tags(self, index: int, tags: torch.Tensor) -> None:
        """Raises if the ranks' tags of the all-gather just completed differ (ranks gathered different units)."""
        ranks = gather_check.disagreement(tags)
        if ranks is None:
            return
        where = ", ".join(
            f"rank {r}: (not a gather tag: that rank's collective was something else)"
            if t is None
            else f"rank {t[0]} -> '{self.units[t[1]].name}' ({'backward' if t[2] else 'forward'})"
            for r, t in enumerate(ranks)
        )
        raise DivergedRanksError(
            f"zeroshard: ranks diverged: at one all-gather (step {self.step_fn()}, this is rank "
            f"{self.collectives.rank}, gathering '{self.units[index].name}') the ranks gathered different units: "
            f"{where}. Every rank must run the same units in the same order (ZeRO-3 all-gathers are collective); make "
            "the control flow in forward depend only on what is the same on every rank. The gathered buffer was not "
            "used."
        )

    def check_deferred_tags(self) -> None:
        """CUDA: checks the tags of this step's all-gathers (read on the host once per step, at its end, so the
        check adds no synchronisation inside the step; a divergence still ends the job before the optimizer step)."""
        pending, self._deferred_tags = self._deferred_tags, []
        if not pending:
            return
        tags = torch.stack([t for _, t in pending]).cpu()
        for (index, _), row in zip(pending, tags):
            self._check_tags(index, row)

    def _named(self, collective: str, unit: Unit):
        """A context that re-raises a failure of the collective inside as a CollectiveError naming ``unit``."""
        return named_collective(
            collective,
            lambda: self._describe(unit),
            step=self.step_fn(),
            rank=self.collectives.rank,
            world_size=self.collectives.world_size,
        )

    def _describe(self, unit: Unit) -> str:
        return f"unit '{unit.name}' ({unit.reason or ('backward' if unit.backward else 'forward')})"

    def _raise_named(self, err: RuntimeError, collective: str, unit: Unit):
        """Re-raises ``err`` as :meth:`_named` would: the hot paths use a plain ``try`` (entering a context manager
        costs microseconds per unit event)."""
        if isinstance(err, CollectiveError):
            raise err
        raise collective_error(
            err,
            collective=collective,
            what=self._describe(unit),
            step=self.step_fn(),
            rank=self.collectives.rank,
            world_size=self.collectives.world_size,
        ) from err

    def _gather_from_host(self, unit: Unit, fulls: list[torch.Tensor], bucket: int, tag: list[torch.Tensor]):
        """Parameter offload: host shards -> device staging -> all-gather, on a side stream.

        The host-to-device copies and the all-gather run on ``_param_stream`` so a prefetch does not hold up the
        compute already queued on the current stream; the side stream first waits for that compute, which also
        orders the reuse of staging memory freed after earlier gathers. Returns the handle and the staging tensors,
        kept alive until the wait.
        """
        if self._param_stream is None:
            self._param_stream = torch.cuda.Stream(device=fulls[0].device)
        stream = self._param_stream
        stream.wait_stream(torch.cuda.current_stream(fulls[0].device))
        with torch.cuda.stream(stream):
            staging = [fp.shard.to(fp.full.device, non_blocking=True) for fp in unit.flat_params] + tag
            with self._named("all-gather (launch)", unit):
                handle = self.collectives.all_gather(staging, fulls, bucket)
        return handle, staging

    def wait_param_copies(self) -> None:
        """Parameter offload: blocks the host until every host-to-device copy of host shards is done, so the host
        step may overwrite the shards."""
        if self._param_stream is not None:
            self._param_stream.synchronize()

    def _wait(self, unit: Unit) -> None:
        handle, unit.pending = unit.pending, None
        try:
            if torch.autograd._profiler_enabled():
                with torch.profiler.record_function("zeroshard::all_gather_wait"):
                    handle.wait()
            else:
                handle.wait()
        except RuntimeError as err:
            self._raise_named(err, "parameter all-gather", unit)
        if self.tagged:
            if unit.tags.is_cuda:
                self._deferred_tags.append((unit.index, unit.tags.clone()))
                if len(self._deferred_tags) >= 256:  # forwards without a step end (generation): bounded memory
                    self.check_deferred_tags()
            elif unit.tags.tolist() != unit.tag_expected[unit.backward]:  # one host read of a few elements
                self._check_tags(unit.index, unit.tags)
        unit.staging = None  # the current stream now waits for the gather; later side-stream work waits for it
        for fp in unit.flat_params:
            fp.is_gathered = True

    def reshard(self, index: int, *, force: bool = False) -> None:
        unit = self.units[index]
        if unit.pending is not None:
            self._wait(unit)
        if unit.dirty and unit.is_gathered:
            for fp in unit.flat_params:
                fp.write_back()
        unit.dirty = unit.accessed = False
        for fp in unit.flat_params:
            fp._snapshot = None
        if unit.persistent and not force:
            return
        for fp in unit.flat_params:
            if fp.is_gathered:
                fp.free_full()

    def unshard_all(self) -> None:
        for i in range(len(self.units)):
            self.unshard(i)

    def reshard_all(self) -> None:
        self._in_step = False  # every unit freed: the step (or what gathered them) is over
        for i in range(len(self.units)):
            self.reshard(i)

    # -- hooks ---------------------------------------------------------------------------------------------------------

    def _make_pre_forward(self, index: int):
        @torch.compiler.disable
        def hook(module, args, kwargs):
            if self.pinned:
                return None
            self.release_accessed(keep=index)
            self._record(index)
            self.unshard(index)
            self.units[index].accessed = False  # used by this forward now: its post-hook frees it
            in_backward = torch._C._current_graph_task_id() != -1
            # a recomputation inside backward (activation checkpointing) prefetches nothing: the next unit of the
            # forward order is done with its backward, and the pre-backward hooks prefetch what backward needs
            if self.prefetch and not self._recording and not in_backward:
                self._prefetch(index, +1)
            if not torch.is_grad_enabled() or in_backward:
                return None  # no backward will come, or a recomputation inside backward
            wrapped = _wrap_inputs(self, index, args, kwargs)
            if wrapped is None:
                return None
            self.units[index].inputs_pending += 1
            return wrapped

        return hook

    def _make_post_forward(self, index: int):
        @torch.compiler.disable
        def hook(module, args, output):
            if self.pinned:
                return output
            if torch._C._current_graph_task_id() != -1:
                return output  # recomputation inside backward (activation checkpointing): keep the unit gathered
            hooked = torch.is_grad_enabled() and self._hook_outputs(index, output)
            if not (hooked and self._in_step and index == self.last_kept):
                self.reshard(index)
            return output

        return hook

    def _hook_outputs(self, index: int, output) -> bool:
        """Gathers unit ``index`` again before its backward: a gradient hook on each output tensor that requires grad
        fires once that tensor's gradient is complete, just before the unit's own backward nodes run (FSDP2's
        pre-backward hooks). A tensor hook costs a third of an identity ``autograd.Function`` around the outputs
        (5.6 against 17.9 us here), and leaves the outputs themselves to the caller (in-place ops on them stay
        legal). Returns whether any output got a hook (a backward through the unit can follow)."""
        hook = self._pre_backward_hooks[index]
        if isinstance(output, torch.Tensor):  # a block's usual output: no pytree walk
            if output.requires_grad:
                output.register_hook(hook)
                return True
            return False
        hooked = False
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)
                hooked = True
        return hooked

    def _make_pre_backward_hook(self, index: int) -> RuntimeHook:
        # not in self._hooks: a clock times pre_backward_event itself, looked up at each call
        return RuntimeHook(lambda grad: self.pre_backward_event(index), "zeroshard::pre_backward")

    def _make_post_backward_hook(self, index: int) -> RuntimeHook:
        return RuntimeHook(lambda grad: self.post_backward_event(index), "zeroshard::post_backward")

    @torch.compiler.disable
    def _root_pre_forward(self, module, args) -> None:
        """Outside a step the root unit is freed: the outermost root hook gathers it for this forward."""
        root = self.units[0]
        gather = not self.pinned and not root.is_gathered
        if gather:
            self.release_accessed()
            self.unshard(0)
        self._root_gathered_by.append(gather)

    @torch.compiler.disable
    def _root_post_forward(self, module, args, output):
        if not self._root_gathered_by.pop():
            return output
        if torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in tree_flatten(output)[0]):
            return output  # a backward follows: the root stays gathered until it ends (FSDP2 keeps its root too)
        self.reshard(0)
        return output

    def _pre_backward(self, index: int) -> None:
        self.unshard(index)
        if self.prefetch:
            self._prefetch(index, -1)

    def _prefetch(self, index: int, step: int) -> None:
        """Starts the all-gather of the unit after ``index`` in the recorded order (``step`` +1: forward, -1:
        backward), together with the units after it while their gathered sizes fit ``prefetch_bucket_size``: one
        collective for several small units (DeepSpeed's prefetch bucket). Nothing if the next unit is already gathered
        or in flight (a group launched earlier holds it)."""
        order = self.forward_order
        try:
            pos = order.index(index) + step
        except ValueError:
            return
        group, total = [], 0
        while 0 <= pos < len(order):
            unit = self.units[order[pos]]
            if unit.pending is not None or unit.is_gathered:
                break
            size = unit.bucket or sum(fp.layout.padded_numel for fp in unit.flat_params)
            if group and (total + size > self.prefetch_bucket_size or not self._groupable(unit)):
                break
            group.append(unit.index)
            total += size
            if not self._groupable(unit):  # host shards (parameter offload): gathered alone
                break
            pos += step
        if len(group) == 1:
            self.unshard(group[0], wait=False)
        elif group:
            self._unshard_group(group)

    def _post_backward(self, index: int) -> None:
        unit = self.units[index]
        unit.inputs_pending = max(0, unit.inputs_pending - 1)
        self._free_if_backward_done(unit, index)

    def _free_if_backward_done(self, unit: Unit, index: int) -> None:
        """Frees a unit whose backward is over: every input gradient computed (so every use of its weights, frozen
        ones included) and every trainable flat parameter's gradients in its buffer (so every weight gradient taken;
        in every backward, so a gradient-accumulation micro-batch frees its units as a synchronised one does)."""
        if not unit.is_root and unit.inputs_pending == 0 and unit.complete >= len(unit.trainable):
            self.reshard(index)

    def _record(self, index: int) -> None:
        if not self._recording or torch._C._current_graph_task_id() != -1:
            return
        if index in self.forward_order:  # a second forward began: the first one's order is complete
            self._recording = False
        else:
            self.forward_order.append(index)

    @property
    def last_kept(self) -> int | None:
        """The unit a forward inside a step keeps gathered (the last of the recorded forward order), or None: while the
        order is being recorded, or with ``keep_last`` off."""
        if self._recording or not self.keep_last or not self.forward_order:
            return None
        return self.forward_order[-1]

    def begin_step(self) -> None:
        """Start of a step: gathers the root unit, which stays gathered until the end of backward."""
        self.release_accessed()
        self.unshard(0)
        self.units[0].accessed = False
        self._in_step = True

    def end_eval_step(self) -> None:
        """After a step without backward: frees the root unit and the last unit, if its forward kept it."""
        self._in_step = False
        self.reshard(0)
        if self.last_kept is not None:
            self.reshard(self.last_kept)
        self.check_deferred_tags()

    def on_grads_complete(self, fp: FlatParam) -> None:
        """GradReducer callback: one more trainable flat parameter of its unit has all its gradients of this backward
        (in every backward, accumulation micro-batches included); the unit is freed once its backward is over
        (:meth:`_free_if_backward_done`). Its reduce-scatter reads the gradient buffers, not the gathered weights, so
        the unit need not wait for it."""
        unit = self._unit_of[id(fp)]
        unit.complete += 1
        if unit.complete == len(unit.trainable):
            self._free_if_backward_done(unit, unit.index)

    def unit_of(self, fp: FlatParam) -> Unit:
        """The unit holding flat parameter ``fp``."""
        return self._unit_of[id(fp)]

    def bind_flat_params(self) -> None:
        self._unit_of = {id(fp): u for u in self.units for fp in u.flat_params}

    def end_of_step(self) -> None:
        """After backward: frees every unit, checks the step's deferred gather tags (CUDA) and stops recording the
        forward order."""
        self.reshard_all()
        self.check_deferred_tags()
        for unit in self.units:
            unit.complete = 0
            unit.inputs_pending = 0
        if self.forward_order:
            self._recording = False

    # -- parameters read or written outside a forward (ShardedParameter's ParamAccess) -------------------------------

    def release_accessed(self, keep: int | None = None) -> None:
        """Frees the units gathered because a placeholder was read (writing back what was written to them)."""
        if not self._maybe_accessed:  # the usual case inside a step: no loop over every unit per event
            return
        for i, unit in enumerate(self.units):
            if unit.accessed and i != keep:
                self.reshard(i)
        self._maybe_accessed = any(unit.accessed for unit in self.units)

    def resolve(self, placeholders: list[ShardedParameter], reason: str | None = None) -> list[torch.Tensor]:
        needed = []
        for ph in placeholders:
            i = self.units.index(self._unit_of[id(ph.flat)])
            if i not in needed:
                needed.append(i)
        for i in range(len(self.units)):
            if self.units[i].accessed and i not in needed:
                self.reshard(i)  # one op's units at a time: reading a model unit by unit keeps one unit whole
        for i in needed:
            unit = self.units[i]
            if not unit.is_gathered:
                self._check_access(unit, placeholders)
                names = self._names_in(unit, placeholders)
                what = reason or self._activity or "a read outside forward (a callback or user code)"
                self.unshard(i, reason=f"{what} of {names}; every rank must make the same reads")
                self.may_write(unit)
                unit.accessed = True
                self._maybe_accessed = True
        return [ph.flat.params[ph.index].detach() for ph in placeholders]

    def write(self, placeholder: ShardedParameter, src: torch.Tensor) -> None:
        fp, i = placeholder.flat, placeholder.index
        unit = self._unit_of[id(fp)]
        if unit.is_gathered:
            self.may_write(unit)
            fp.params[i].detach().copy_(src)
        else:
            fp.write_param_shard(i, src)

    def mark_written(self, placeholders: list[ShardedParameter]) -> None:
        for ph in placeholders:
            self.may_write(self._unit_of[id(ph.flat)])

    def may_write(self, unit: Unit) -> None:
        """The gathered ``unit`` may be written from now on: what differs from its shards when it is freed is written
        back (:meth:`FlatParam.write_back`)."""
        for fp in unit.flat_params:
            fp.snapshot()
        unit.dirty = True

    def describe(self, placeholder: ShardedParameter) -> str:
        return f"'{placeholder.flat.names[placeholder.index]}' of unit '{self._unit_of[id(placeholder.flat)].name}'"

    def _names_in(self, unit: Unit, placeholders: list[ShardedParameter]) -> str:
        return ", ".join(self.describe(ph) for ph in placeholders if self._unit_of[id(ph.flat)] is unit)

    def _check_access(self, unit: Unit, placeholders: list[ShardedParameter]) -> None:
        names = self._names_in(unit, placeholders)
        moved = [ph for ph in placeholders if self._unit_of[id(ph.flat)] is unit and not _registered(ph)]
        if moved:
            raise RuntimeError(
                f"zeroshard: {self._names_in(unit, moved)} is no longer registered where the strategy sharded it: "
                "something re-registered it under another name, as pruning (torch.nn.utils.prune, Lightning's "
                "ModelPruning callback: 'weight' becomes 'weight_orig' times a mask) and parametrizations "
                "(torch.nn.utils.parametrize, weight_norm) do. At ZeRO stage 3 a sharded parameter cannot move: "
                "pruning and parametrizations are not supported at stage 3. Use stage 1 or 2 "
                "(ZeroStrategy(stage=2)), where parameters stay whole on every rank."
            )
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                f"zeroshard: {names} is sharded (freed) but is read during backward. Its unit was freed before its "
                "backward was over; please report this with the model, and use gathered_parameters() meanwhile."
            )
        if torch.is_grad_enabled() and any(ph.requires_grad for ph in placeholders):
            raise RuntimeError(
                f"zeroshard: {names} is sharded (ZeRO stage 3) and is used with autograd outside its unit's forward, "
                "so no gradient could reach it. Use it inside the module's forward (wrap the module that uses it in "
                "the same unit, e.g. through wrap_policy), or read it under torch.no_grad(). Pruning "
                "(torch.nn.utils.prune) and parametrizations (torch.nn.utils.parametrize) compute weights this way and "
                "are not supported at stage 3: use stage 1 or 2 for them."
            )

    def _check_same_unit(self, index: int) -> None:
        """Debug: before every all-gather, all ranks exchange which unit they are about to gather.

        A rank on another code path reaches a different unit (or a different phase) at the same collective, so the
        exchange itself is matched and the error names both units instead of gloo/NCCL failing on mismatched sizes.
        """
        self._gather_count += 1
        phase = 1 if torch._C._current_graph_task_id() != -1 else 0
        mine = torch.tensor([index, phase], dtype=torch.int64, device=self._check_device)
        everyone = [torch.empty_like(mine) for _ in range(self.collectives.world_size)]
        with self._named("gather-order check (check_gather_order=True)", self.units[index]):
            dist.all_gather(everyone, mine, group=self._group)  # all_gather_single is torch >= 2.13 only
        pairs = [t.tolist() for t in everyone]
        if any(p != pairs[0] for p in pairs):
            where = ", ".join(
                f"rank {r} -> '{self.units[u].name}' ({'backward' if ph else 'forward'})"
                for r, (u, ph) in enumerate(pairs)
            )
            raise DivergedRanksError(
                f"zeroshard: ranks diverged at all-gather #{self._gather_count}: {where}. Every rank must run the same "
                "units in the same order (ZeRO-3 all-gathers are collective); make the control flow in forward "
                "depend only on what is the same on every rank."
            )

    def attach_group(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """The process group and device for the debug order check."""
        self._group, self._check_device, self._gather_count = group, device, 0


def pack_shards(unit: Unit, tag_elems: int) -> None:
    """Moves the shards of ``unit``'s flat parameters back to back into one buffer (the row this rank sends in the
    unit's all-gather), followed by ``tag_elems`` elements for the gather tag, so the all-gather sends the row where it
    lies instead of first copying the shards and the tag together (FSDP2's all-gather copy-in; 1.6 MB per gather of a
    4 x 256 block here). Units whose shards live in host memory (parameter offload) or differ in dtype or device, or
    with nothing to pack, keep their own shards."""
    fps = unit.flat_params
    if len(fps) + (tag_elems > 0) < 2 or any(fp.keep_full or fp.host_shard for fp in fps):
        return
    if len({(fp.shard.dtype, fp.shard.device) for fp in fps}) != 1:
        return
    sizes = [fp.shard.numel() for fp in fps] + [tag_elems]
    row = torch.empty(sum(sizes), dtype=fps[0].shard.dtype, device=fps[0].shard.device)
    parts = row.split(sizes)
    for fp, part in zip(fps, parts):
        fp.move_shard(part)
    if tag_elems:
        unit.tag_slot = parts[-1]


def _registered(ph: ShardedParameter) -> bool:
    """Whether every module slot of ``ph``'s parameter still holds it (the placeholder, or the parameter itself)."""
    fp, i = ph.flat, ph.index
    return all(
        container.get(name) is fp.placeholders[i] or container.get(name) is fp.params[i]
        for container, name in fp.slots[i]
    )


def _attach_slots(root: nn.Module, units: list[Unit], access: ShardedUnits) -> None:
    """Gives every flat parameter the module slots of its parameters (tied ones have several) and its placeholders."""
    where: dict[int, list[tuple[dict, str]]] = {}
    for m in root.modules():
        for name, p in m._parameters.items():
            if p is not None:
                where.setdefault(id(p), []).append((m._parameters, name))
    for unit in units:
        for fp in unit.flat_params:
            fp.attach([where.get(id(p), []) for p in fp.params], access)


def _root_hook_modules(root: nn.Module, unit: Unit) -> list[nn.Module]:
    """The smallest module holding every root-unit parameter, then each module holding one directly."""
    params = {id(p) for fp in unit.flat_params for p in fp.params}
    owners: list[tuple[str, nn.Module]] = []
    for name, m in root.named_modules():
        if any(id(p) in params for p in m._parameters.values() if p is not None):
            owners.append((name, m))
    if not owners:
        return []
    parts = [name.split(".") if name else [] for name, _ in owners]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    top = root.get_submodule(".".join(common)) if common else root
    return [top] + [m for _, m in owners if m is not top]

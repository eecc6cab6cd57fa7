"""Which initialiser runs for each module of a model built on the meta device, in which order, checked before anything
is allocated.

A plan is a list of steps covering every module of the model once:

* modules outside any Hugging Face model, in ``model.modules()`` order, each initialised by its own
  ``reset_parameters()`` (PyTorch's contract since PR 104189: a module initialises its own tensors only);
* each Hugging Face model (any module whose class defines ``_init_weights``) as one block in the eager build's order
  (:mod:`zeroshard.init.hf_init`): children before parents, every module by its owner's ``_init_weights`` (parents too,
  even when they own no tensor: GPT-2's attention re-initialises its ``c_proj`` with the depth-scaled std), with the
  constructors' random draws replayed between (:mod:`zeroshard.init.ctor_draws`) so the random stream matches;
* or, with ``param_init_fn``, every module owning meta tensors by that function, in ``model.modules()`` order.

:func:`check_plan` runs the plan once on the still-meta model under a torch function mode that records which tensors
each step writes and computes nothing (writes on meta are skipped). Every parameter and buffer must be written by
some step; the ones nobody writes make one error, raised before any allocation, that names every such module and the
fix. Tensors a Hugging Face ``_init_weights`` leaves alone keep what the eager constructor gave them: a recorded
constructor draw (replayed into them at their step, from the random state it had in the eager order) or the module's
``reset_parameters()``. The same dry run checks that no step writes into a ZeRO-3 unit that was already sharded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zeroshard.init.ctor_draws import Draw, find_log, storage_key
from zeroshard.init.hf_init import added_later, block_events, is_init_owner, post_order
from zeroshard.init.writes import DATA_SET, write_target

# Attribute set on a replaced meta tensor, pointing to its materialised replacement, so that module slots that still
# hold the meta tensor (a tie whose other owner is materialised in a later call) get the same replacement.
REPLACEMENT_ATTR = "_zeroshard_materialized"


@dataclass
class InitStep:
    """One module's step: allocate its own meta tensors, then initialise them."""

    module: nn.Module
    name: str
    label: str  # the initialiser, for messages: "reset_parameters()", "GPT2LMHeadModel._init_weights", ...
    init: Callable[[nn.Module], None] | None
    always: bool = False  # run even without meta tensors of its own (an HF parent initialising its children)
    reset_first: bool = False  # HF steps: reset_parameters() first, for the tensors _init_weights leaves alone
    deferred: list[Draw] = field(default_factory=list)  # constructor draws whose values are kept (see module doc)
    # replayed constructor writes: (write, the meta tensor it went to), in the constructors' order
    recorded: list[tuple[Draw, torch.Tensor]] = field(default_factory=list)

    def run(self, module: nn.Module) -> None:
        if self.reset_first:
            if self.recorded:  # only for the tensors no recorded write covers: off the random stream
                with torch.random.fork_rng(devices=[]):
                    module.reset_parameters()
            else:
                module.reset_parameters()
        if self.init is not None:
            self.init(module)


Plan = list[InitStep | Draw]


# -- slots and allocation ---------------------------------------------------------------------------------------------


def own_tensor_slots(module: nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """The module's direct parameters and buffers (``recurse=False``) as (container dict, name, tensor)."""
    slots = [(module._parameters, n, t) for n, t in module._parameters.items() if t is not None]
    slots += [(module._buffers, n, t) for n, t in module._buffers.items() if t is not None]
    return slots


def owns_meta(module: nn.Module) -> bool:
    return any(t.is_meta for _, _, t in own_tensor_slots(module))


def module_names(root: nn.Module | None, names: dict[nn.Module, str] | None = None) -> dict[nn.Module, str]:
    if names is not None:
        return names
    out: dict[nn.Module, str] = {}
    if root is not None:
        for name, m in root.named_modules(remove_duplicate=False):
            out.setdefault(m, name or "<root>")
    return out


def allocate_like(old: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor with ``old``'s shape, dtype, strides and requires_grad, on ``device``."""
    data = torch.empty_like(old, device=device)
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        skip = (REPLACEMENT_ATTR, "_is_hf_initialized")  # fresh memory is initialised by no one yet
        new.__dict__.update({k: v for k, v in old.__dict__.items() if k not in skip})  # user tags
        return new
    return data.requires_grad_(old.requires_grad)


def meta_holders(root: nn.Module | None) -> dict[int, list[tuple[dict, str]]]:
    """id(meta tensor) -> every (container dict, name) slot under ``root`` that holds it."""
    holders: dict[int, list[tuple[dict, str]]] = {}
    if root is not None:
        for m in root.modules():
            for container, name, t in own_tensor_slots(m):
                if t.is_meta:
                    holders.setdefault(id(t), []).append((container, name))
    return holders


def materialize_module(
    module: nn.Module,
    device: torch.device,
    init: Callable[[nn.Module], None] | None,
    holders: dict[int, list[tuple[dict, str]]],
    *,
    always: bool = False,
    before: Callable[[dict[int, torch.Tensor]], None] | None = None,
) -> bool:
    """Allocates ``module``'s own meta tensors on ``device`` and runs ``init(module)`` under ``torch.no_grad()``.

    Slots still holding a meta tensor already replaced elsewhere (a tie) get the replacement. Tensors of the module
    that were materialised before (tied with an earlier module) get their values back after ``init``: nothing is
    initialised twice. Without meta tensors of its own the module is skipped unless ``always``. ``before(replaced)``
    runs first with ``id(meta tensor) -> new tensor``. Returns whether ``init`` ran.
    """
    slots = own_tensor_slots(module)
    for container, name, t in slots:
        if t.is_meta and hasattr(t, REPLACEMENT_ATTR):
            container[name] = getattr(t, REPLACEMENT_ATTR)
    slots = own_tensor_slots(module)
    to_allocate = [(c, n, t) for c, n, t in slots if t.is_meta]
    if not to_allocate and not always:
        return False
    keep: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for _, _, t in slots:
        if not t.is_meta and id(t) not in keep:
            keep[id(t)] = (t, t.detach().clone())
    replaced: dict[int, torch.Tensor] = {}
    for container, name, old in to_allocate:
        if id(old) not in replaced:  # the same meta tensor in two slots of this module
            replaced[id(old)] = allocate_like(old, device)
        container[name] = replaced[id(old)]
    with torch.no_grad():
        if before is not None:
            before(replaced)
        if init is not None:
            init(module)
        for t, saved in keep.values():
            t.copy_(saved)
    for container, name, old in to_allocate:
        now = container.get(name)
        if now is not None and now is not replaced[id(old)] and not now.is_meta:
            replaced[id(old)] = now  # the initialiser assigned a new tensor (`self.cos = rope(...)`): it is the value
    for _, _, old in to_allocate:
        if not hasattr(old, REPLACEMENT_ATTR):
            new = replaced[id(old)]
            setattr(old, REPLACEMENT_ATTR, new)  # for slots outside root, materialised in a later call
            for container, name in holders.get(id(old), ()):
                container[name] = new
    return True


# -- the plan ---------------------------------------------------------------------------------------------------------


def _hf_init(owner: nn.Module, module: nn.Module) -> None:
    owner._init_weights(module)
    module._is_hf_initialized = True  # as after an eager post_init


def _reset(module: nn.Module) -> None:
    module.reset_parameters()


def _meta_subtrees(root: nn.Module) -> set[int]:
    """ids of the modules whose subtree holds a meta tensor."""
    out: set[int] = set()

    def visit(m: nn.Module) -> bool:
        has = owns_meta(m)
        for c in m.children():
            has |= visit(c)
        if has:
            out.add(id(m))
        return has

    visit(root)
    return out


def plan_init(root: nn.Module, param_init_fn: Callable[[nn.Module], None] | None = None) -> Plan:
    """The initialisation plan of ``root`` (see the module docstring); every module appears in exactly one step."""
    if param_init_fn is not None:
        return [InitStep(m, n or "<root>", "param_init_fn", param_init_fn) for n, m in root.named_modules()]
    with_meta = _meta_subtrees(root)
    log = find_log([t for m in root.modules() for _, _, t in own_tensor_slots(m)])
    replay = log is not None and not log.empty_init
    later = added_later(root, log)
    writes = log.writes_by_storage() if log is not None else {}
    timeline: list[tuple[tuple, Draw | InitStep]] = []  # replay: (sort key, event), Hugging Face blocks by time
    steps: Plan = []  # otherwise: the modules' order, reset_parameters() on the live random stream
    tail: list[InitStep] = []  # replayed constructors, after every draw (their random states are saved on the way)
    seen: set[int] = set()

    def visit(m: nn.Module, name: str) -> None:
        if id(m) in seen:
            return
        if is_init_owner(m) and id(m) not in later:
            modules, left_out = post_order(m, name, seen, later)
            events = block_events(m, modules, log.random_draws() if log is not None else None, later)
            at = next((ev.seq for ev in events if isinstance(ev, Draw)), 0)
            for i, ev in enumerate(events):
                if not isinstance(ev, Draw):
                    label = f"{type(ev.owner).__name__}._init_weights"
                    init = functools.partial(_hf_init, ev.owner)
                    ev = InitStep(ev.module, ev.name or "<root>", label, init, id(ev.module) in with_meta)
                else:
                    at = ev.seq
                timeline.append(((at, isinstance(ev, InitStep), i), ev))
                if not replay:
                    steps.append(ev)
            for sub, sub_name in left_out:
                visit(sub, sub_name)
            return
        seen.add(id(m))
        has_reset = callable(getattr(m, "reset_parameters", None))
        # empty_init: reset_parameters() where there is one (Lightning's meaning, and what FSDP runs at setup); a module
        # without one keeps what its constructor wrote (`nn.Parameter(torch.ones(d))`), as under DDP's empty init
        if replay or id(m) in later or (log is not None and not has_reset):
            tail.append(_recorded_step(m, name or "<root>", writes))
        else:
            steps.append(InitStep(m, name or "<root>", "reset_parameters()", _reset if has_reset else None))
        for child_name, child in m.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(root, "")
    in_blocks = {id(ev) for _, ev in timeline if isinstance(ev, Draw)}
    if replay:  # every random draw of the constructors, in order, so the stream reaches each replayed one
        timeline += [
            ((d.seq, 0, 0), d) for d in log.draws if d.random and d.func is not None and id(d) not in in_blocks
        ]
        timeline.sort(key=lambda item: item[0])
        return [ev for _, ev in timeline] + tail
    # reset_parameters() mode: modules added later replay their own constructors' draws, after everything else
    replayed = sorted({id(d): d for step in tail for d, _ in step.recorded if d.random}.values(), key=lambda d: d.seq)
    return steps + replayed + tail


def _recorded_step(module: nn.Module, name: str, writes: dict[int, list[Draw]]) -> InitStep:
    """A module initialised by replaying what its constructor (and code run on the meta model inside the meta
    context) wrote into its own tensors: for each tensor, the last write that set it whole and every write after.
    Tensors with no such write, or written since by something that cannot be replayed (a copy from another tensor),
    fall back to ``reset_parameters()`` when the module has one (run off the random stream); otherwise the dry run
    names them."""
    step = InitStep(module, name, "its constructor (recorded)", None)
    uncovered = False
    done: set[int] = set()
    for _, _, t in own_tensor_slots(module):
        if not t.is_meta or id(t) in done:
            continue
        done.add(id(t))
        events = writes.get(storage_key(t), [])
        start = max((i for i, d in enumerate(events) if d.overwrites(t)), default=None)
        if start is None or any(d.func is None for d in events[start:]):
            uncovered = True
            continue
        step.recorded += [(d, t) for d in events[start:]]
    step.recorded.sort(key=lambda item: item[0].seq)
    if uncovered and callable(getattr(module, "reset_parameters", None)):
        step.reset_first = True
        step.label = "its constructor (recorded) and reset_parameters()"
    return step


# -- the dry run ------------------------------------------------------------------------------------------------------


class _WriteTracker(TorchFunctionMode):
    """Records writes into meta tensors and skips them (nothing to compute on meta); everything else runs."""

    def __init__(self, on_write: Callable[[int], None]) -> None:
        super().__init__()
        self.on_write = on_write

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = write_target(func, args, kwargs)
        if target is not None and target.is_meta:
            self.on_write(storage_key(target))
            return None if func == DATA_SET or getattr(func, "__name__", "") == "__setitem__" else target
        return func(*args, **kwargs)


@dataclass
class _Tensors:
    """Every meta tensor of the model, by storage: a name for messages, the module owning it, its unit."""

    label: dict[int, str] = field(default_factory=dict)
    module: dict[int, nn.Module] = field(default_factory=dict)
    unit: dict[int, int] = field(default_factory=dict)


def _meta_tensors(root: nn.Module, unit_of: dict[int, int] | None) -> _Tensors:
    out = _Tensors()
    units: dict[int, set[int]] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        for _, attr, t in own_tensor_slots(m):
            if not t.is_meta:
                continue
            key = storage_key(t)
            out.label.setdefault(key, f"{name}.{attr}" if name else attr)
            out.module.setdefault(key, m)
            if unit_of is not None:
                units.setdefault(key, set()).add(unit_of.get(id(m), 0))
    for key, us in units.items():
        out.unit[key] = next(iter(us)) if len(us) == 1 else 0  # a tensor of several units lives in the root unit
    return out


def _would_run(step: InitStep) -> bool:
    return step.always or owns_meta(step.module)


def _dry_run(root: nn.Module, plan: Plan, tensors: _Tensors, unit_of, unit_sizes, unit_names) -> tuple[set, list]:
    """Runs ``plan`` on meta; returns the written storage keys and the writes into already-complete units."""
    written: set[int] = set()
    late: list[str] = []
    left = dict(unit_sizes or {})
    current: list[InitStep] = []

    def on_write(key: int) -> None:
        if key not in tensors.label:
            return
        written.add(key)
        unit = tensors.unit.get(key)
        if unit is not None and left.get(unit, 1) == 0:
            late.append(
                f"'{current[0].name}' ({current[0].label}) writes '{tensors.label[key]}', which belongs to unit "
                f"'{unit_names[unit]}', sharded before this step"
            )

    for step in plan:
        if isinstance(step, InitStep):
            for d in step.deferred:
                t = d.target()
                if t is not None:
                    written.add(storage_key(t))
    tracker = _WriteTracker(on_write)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), tracker:
        for step in plan:
            if isinstance(step, Draw):
                continue
            current[:] = [step]
            if step.label == "param_init_fn":  # a user function: trusted to initialise the module's own tensors,
                for _, _, t in own_tensor_slots(step.module):  # and not called twice
                    if t.is_meta:
                        on_write(storage_key(t))
            elif _would_run(step) and (step.init is not None or step.reset_first or step.recorded):
                for _, t in step.recorded:
                    on_write(storage_key(t))
                with _restoring_slots(step.module, on_write):
                    step.run(step.module)
            if unit_of is not None:
                u = unit_of.get(id(step.module))
                if u is not None:
                    left[u] -= 1
    return written, late


@contextlib.contextmanager
def _restoring_slots(module: nn.Module, on_write: Callable[[int], None]) -> Iterator[None]:
    """An initialiser that assigns new tensors (``self.cos = rope(...)``, ``self.w = nn.Parameter(...)``) initialises
    the slot (``on_write`` with the old tensor's storage key), but must not change the meta model during the dry run:
    the slots of ``module``'s subtree get their meta tensors back."""
    saved = [(c, n, t) for m in module.modules() for c, n, t in own_tensor_slots(m)]
    try:
        yield
    finally:
        for c, n, t in saved:
            if c.get(n) is not t:
                on_write(storage_key(t))
            c[n] = t


def check_plan(
    root: nn.Module,
    plan: Plan,
    *,
    unit_of: dict[int, int] | None = None,
    unit_names: list[str] | None = None,
) -> None:
    """Dry-runs ``plan`` on the meta model and raises before anything is allocated if a tensor would stay
    uninitialised or a step would write into a unit already sharded. May set ``reset_first``/``deferred`` on Hugging
    Face steps for tensors their ``_init_weights`` leaves alone (see the module docstring).

    Args:
        root: the model, its tensors still on meta.
        plan: from :func:`plan_init`.
        unit_of: ZeRO-3: ``id(module) -> unit index`` (0 is the root unit); a unit is sharded once the plan has run
            the steps of all its modules.
        unit_names: names of the units, for messages.

    Raises:
        RuntimeError: listing every module that owns a tensor nobody initialises, with the fix (``reset_parameters``
            or ``param_init_fn``), and every write into an already-sharded unit, with the fix (a ``wrap_policy``
            that keeps the writer and the tensor in one unit).
    """
    tensors = _meta_tensors(root, unit_of)
    sizes = None
    if unit_of is not None:
        sizes = {}
        for step in plan:
            if isinstance(step, InitStep) and id(step.module) in unit_of:
                u = unit_of[id(step.module)]
                sizes[u] = sizes.get(u, 0) + 1
    written, late = _dry_run(root, plan, tensors, unit_of, sizes, unit_names)
    missing = set(tensors.label) - written
    if missing:
        _keep_constructor_values(plan, tensors, missing)
        written, late = _dry_run(root, plan, tensors, unit_of, sizes, unit_names)
        missing = set(tensors.label) - written
    problems = []
    if missing:
        by_module: dict[int, list[int]] = {}
        for key in missing:
            by_module.setdefault(id(tensors.module[key]), []).append(key)
        names = module_names(root)
        listed = []
        for keys in by_module.values():
            m = tensors.module[keys[0]]
            what = ", ".join(sorted(tensors.label[k] for k in keys))
            listed.append(f"'{names.get(m, '?')}' ({type(m).__name__}) for {what}")
        problems.append(
            f"{len(listed)} modules built on the meta device have tensors that no initialiser writes: "
            f"{'; '.join(sorted(listed))} (their values come from a computation or a copy the meta device cannot "
            "replay, and no reset_parameters() recomputes them). Either add a reset_parameters() method that "
            "initialises the module's own parameters and buffers (recurse=False), or pass param_init_fn=fn, called as "
            "fn(module) for every module (ZeroStrategy(param_init_fn=...) or materialize_module_(..., "
            "param_init_fn=...)), or build the model eagerly (outside the meta context: in the LightningModule's "
            "__init__, or trainer.init_module(empty_init=False)) and let the strategy shard it"
        )
    if late:
        problems.append(
            "initialisers write into units already sharded: "
            + "; ".join(late)
            + ". Use a wrap_policy that keeps each module in one unit with the modules whose initialisers write its "
            "tensors (e.g. the whole transformer block)"
        )
    if problems:
        raise RuntimeError("cannot initialise the model: " + " | ".join(problems))


def _keep_constructor_values(plan: Plan, tensors: _Tensors, missing: set[int]) -> None:
    """Tensors of Hugging Face blocks that ``_init_weights`` leaves alone keep their constructor values: a recorded
    constructor draw, else the module's ``reset_parameters()``."""
    step_of = {id(s.module): s for s in plan if isinstance(s, InitStep)}
    for d in (s for s in plan if isinstance(s, Draw)):
        t = d.target()
        if t is not None and storage_key(t) in missing:
            step = step_of.get(id(tensors.module[storage_key(t)]))
            if step is not None and step.label.endswith("._init_weights"):
                step.deferred.append(d)
                missing.discard(storage_key(t))
    for key in missing:
        step = step_of.get(id(tensors.module[key]))
        if (
            step is not None
            and step.label.endswith("._init_weights")
            and callable(getattr(step.module, "reset_parameters", None))
        ):
            step.reset_first = True


# -- running it -------------------------------------------------------------------------------------------------------


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _rng_at(device: torch.device, state: torch.Tensor) -> Iterator[None]:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


def run_plan(
    root: nn.Module,
    plan: Plan,
    device: torch.device | str,
    *,
    on_module: Callable[[nn.Module], None] | None = None,
) -> None:
    """Allocates and initialises ``root``'s meta tensors step by step; ``on_module(module)`` after each module step
    (every module of the model once, in plan order: ZeRO-3 shards a unit as soon as its last module is done)."""
    device = torch.device(device)
    holders = meta_holders(root)
    deferred = {id(d): d for s in plan if isinstance(s, InitStep) for d in s.deferred}
    deferred.update({id(d): d for s in plan if isinstance(s, InitStep) for d, _ in s.recorded if d.random})
    states: dict[int, torch.Tensor] = {}
    for step in plan:
        if isinstance(step, Draw):
            if id(step) in deferred:
                states[id(step)] = _rng_state(device)
            step.replay(device)
            continue
        module = step.module
        allocated: dict[int, torch.Tensor] = {}

        def before(replaced: dict[int, torch.Tensor], step: InitStep = step, allocated: dict = allocated) -> None:
            allocated.update(replaced)
            for d in step.deferred:  # the constructor's draw, from the random state it had in the eager order
                t = d.target()
                new = replaced.get(id(t)) if t is not None else None
                if new is not None and id(d) in states:
                    with _rng_at(device, states.pop(id(d))):
                        d.replay(device, out=new)

        def run(module: nn.Module, step: InitStep = step, allocated: dict = allocated) -> None:
            step.run(module)
            for d, old in step.recorded:  # the constructors' writes, from the random state each had
                new = allocated.get(id(old))
                if new is None:  # tied with a module materialised before: initialised there
                    continue
                if d.random:
                    with _rng_at(device, states.pop(id(d))):
                        d.replay_into(new, old, device)
                else:
                    d.replay_into(new, old, device)

        runs = step.init is not None or step.reset_first or bool(step.recorded)
        materialize_module(module, device, run if runs else None, holders, always=step.always, before=before)
        if on_module is not None:
            on_module(module)

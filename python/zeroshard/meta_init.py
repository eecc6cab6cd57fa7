"""Meta-device initialisation: build a model without allocating it, then allocate and initialise it module by module.

Source: PyTorch's meta device and the FSDP2 / torchtitan flow (``docs/fsdp.md`` in torchtitan): build the model under
``torch.device("meta")``, shard, then allocate only what is kept and run the modules' own initialisers. The per-module
contract is the one PyTorch settled on after issue 90465 ("Revisit meta device initialization": FSDP1 silently
re-initialised parameters) in PR 104189: ``reset_parameters()`` initialises only the module's *own* tensors
(``recurse=False``), never its children's. DeepSpeed's ``zero.Init`` patches ``nn.Module.__init__`` and the tensor
factories instead; we never do (its users fight the size-[0] placeholder parameters that it leaves behind).

Flow::

    with init_meta_context():
        model = GPT(cfg)                           # every parameter and buffer on meta, nothing allocated
    torch.manual_seed(seed)
    materialize_module_(model, "cuda")            # reference path: everything, in model.modules() order
    # or, as the ZeRO-3 engine does, one unit at a time (units together cover model.modules(), in that order):
    for unit in units:
        materialize_(unit, "cuda", root=model)     # then keep this rank's shard of the unit and free the rest
    check_no_meta(model)

Bit-parity contract (what the ZeRO-3 engine relies on). With the same ``torch.manual_seed(s)`` set right before an
eager build and right before materialisation on the same device, the parameters and buffers are bit-identical to the
eager build, provided that

1. modules are materialised in ``model.modules()`` order (one call or several consecutive calls, e.g. unit by unit), and
   eager construction runs the modules' initialisers in that same order (true when every module that owns tensors is
   constructed where it is registered), and
2. every module draws random numbers only in its ``reset_parameters()`` (or your ``param_init_fn``), once per call,
   and initialises only its own tensors, including buffers computed in ``__init__`` (e.g. a causal mask or a RoPE
   table), which must be (re)computed there too, since under meta they are left empty.

A random-number draw anywhere else (in ``__init__`` outside ``reset_parameters``, in a parent that initialises its
children) breaks the parity silently; a draw on a different device (CPU generator vs CUDA generator) gives different
numbers.

Hugging Face models (any module whose class defines ``_init_weights``) follow their own rules instead
(:mod:`zeroshard.init.init_plan`, :mod:`zeroshard.init.hf_init`): ``_init_weights`` of the owning model for every
module, children before parents, nested models first, as ``post_init`` does; the constructors' random draws recorded by
:func:`init_meta_context` are replayed on scratch tensors in between, so with the same seed and device the values
are bit-identical to the eager build (tested on GPT-2 and Llama, transformers 5.23). A model built under a plain
``torch.device("meta")`` has no recorded draws: its values then follow the same distributions (deterministic buffers
such as rotary ``inv_freq`` exactly) but are not equal to an eager build's. :func:`materialize_module_` and the ZeRO
engine dry-run the whole plan on meta first: a tensor that no initialiser writes is an error naming every such
module, raised before anything is allocated.

Tied parameters (one ``nn.Parameter`` registered in several modules, e.g. ``lm_head.weight = wte.weight``) stay one
Parameter: it is allocated and initialised once, by the first module in materialisation order that holds it, and the
new Parameter is installed in every module slot that held the old meta one (all slots under ``root`` at once; other
slots when their module is materialised later). A later module that holds an already-materialised tensor and also
owns meta tensors still runs its initialiser (so the random stream matches the eager build), but the tensors that were
already materialised get their values back afterwards: nothing is initialised twice (the silent re-init of
pytorch#90465).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Generator, Iterable

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.overrides import TorchFunctionMode

from zeroshard.init.ctor_draws import DrawLog, new_log, storage_key
from zeroshard.init.init_plan import (
    REPLACEMENT_ATTR,
    check_plan,
    materialize_module,
    meta_holders,
    module_names,
    owns_meta,
    plan_init,
    run_plan,
)
from zeroshard.init.writes import (
    DATA_GET,
    DATA_SET,
    RANDOM_FACTORIES,
    RANDOM_INITIALIZERS,
    VALUE_FACTORIES,
    holds_tensor,
    write_target,
)

__all__ = ["check_no_meta", "has_meta", "replacement", "init_meta_context", "materialize_", "materialize_module_"]


# Initialisers that only write values: the in-place tensor methods, and the ``nn.init`` functions (some of which
# dispatch to a torch function mode as themselves). On a meta tensor there are no values, yet torch 2.13 runs some of
# them (normal_, uniform_) through a Python decomposition costing milliseconds per call (and seconds on first use):
# building the 45B GPT skeleton took 3.5 s cold / 0.5 s warm with them, 0.14 s without (2 loaded cores). They neither
# change metadata nor, on meta, consume random numbers, so skipping them changes nothing.
_VALUE_ONLY_INITIALIZERS = frozenset(
    [
        getattr(torch.Tensor, name)
        for name in (
            "normal_", "uniform_", "zero_", "fill_", "bernoulli_", "exponential_", "random_", "cauchy_",
            "log_normal_", "geometric_",
        )
    ]
    + [
        getattr(nn.init, name)
        for name in (
            "normal_", "uniform_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
            "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
        )
        if hasattr(nn.init, name)
    ]
)  # fmt: skip


class _SkipMetaInitializers(TorchFunctionMode):
    """Turns value-only in-place initialisers on meta tensors into no-ops (returns ``self``) and records every write
    into a meta tensor, every factory that creates one and every new meta storage in ``log``
    (:mod:`zeroshard.init.ctor_draws`), in order. A scoped torch function mode, like ``torch.device`` itself; nothing
    is patched."""

    def __init__(self, log: DrawLog, whole_calls: list) -> None:
        super().__init__()
        self.log = log
        self.whole_calls = whole_calls  # frames of _SILENT_ON_META calls in progress, recorded whole by the hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = write_target(func, args, kwargs)
        if self.whole_calls:
            # Inside an initialiser the profile hook recorded whole (torch 2.11's trunc_normal_ runs uniform_,
            # erfinv_, mul_, add_, clamp_ on meta): its own writes are part of that record, not draws of their own.
            if target is not None and target.is_meta and func in _VALUE_ONLY_INITIALIZERS:
                return target
            return func(*args, **kwargs)
        # `p.data = x` (what module.to() / _apply do) writes no value: p now shows x's storage, whose writes count
        if target is not None and target.is_meta and func is not DATA_SET:
            skip = func in _VALUE_ONLY_INITIALIZERS
            rest = {k: v for k, v in kwargs.items() if k != "tensor"}
            extra = tuple(args[1:])
            out = target if skip else func(*args, **kwargs)
            if kwargs.get("generator") is not None or holds_tensor(extra) or holds_tensor(rest):
                self.log.record_inplace(None, target, (), {})  # reads another tensor: not replayable
            else:
                self.log.record_inplace(func, target, extra, rest, random=func in RANDOM_INITIALIZERS)
            return out
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_meta:
            replayable = kwargs.get("generator") is None and not holds_tensor(args) and not holds_tensor(kwargs)
            if func in RANDOM_FACTORIES and kwargs.get("generator") is None:
                self.log.record_factory(func, out, tuple(args), kwargs)
            elif func in VALUE_FACTORIES and replayable:
                self.log.record_factory(func, out, tuple(args), kwargs, random=False)
            elif out._base is None and func is not DATA_GET and not _aliases_input(out, args, kwargs):
                self.log.record_creation(out)
        return out


# nn.init functions that return at once on a meta tensor without a torch function call the mode could see (torch
# 2.13: trunc_normal_, orthogonal_, sparse_, dirac_), yet consume random numbers (trunc_normal_'s rejection loop: a
# data-dependent count) in an eager build. Their calls are seen by a profile hook instead and recorded whole: replayed
# from the same random state they draw exactly what the eager call drew. Where one does run ops on meta (torch 2.11's
# trunc_normal_: uniform_ then erfinv_), the mode records none of them while the call is in progress.
_SILENT_ON_META = {
    getattr(nn.init, n).__code__: getattr(nn.init, n)
    for n in ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")
    if hasattr(nn.init, n)
}


def _aliases_input(out: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``out`` shares its storage with a tensor argument (``t.to(same device)`` returns ``t``; ``detach``)."""
    key = storage_key(out)
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return any(a.is_meta and storage_key(a) == key for a in inputs)


def _recording_calls(log: DrawLog, chained, whole_calls: list):
    def hook(frame, event, arg):
        if event == "return" and whole_calls and whole_calls[-1] is frame:
            whole_calls.pop()
        elif event == "call" and not whole_calls:
            func = _SILENT_ON_META.get(frame.f_code)
            if func is not None:
                code, values = frame.f_code, frame.f_locals
                names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
                tensor = values.get(names[0])
                if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                    kwargs = {n: values[n] for n in names[1:] if n in values}
                    if kwargs.get("generator") is not None or holds_tensor(kwargs):
                        log.record_inplace(None, tensor, (), {})
                    else:
                        log.record_inplace(func, tensor, (), kwargs, random=func is not nn.init.dirac_)
                    whole_calls.append(frame)
        if chained is not None:
            chained(frame, event, arg)

    return hook


@contextlib.contextmanager
def init_meta_context(*, empty_init: bool = False) -> Generator[None, None, None]:
    """Context manager under which every parameter and buffer a module constructor creates is on the meta device.

    It makes ``torch.device("meta")`` the default device (PyTorch's device context manager, as in the FSDP2 /
    torchtitan meta-init flow); it patches neither ``nn.Module.__init__`` nor the tensor factories (unlike DeepSpeed's
    ``zero.Init``). Meta tensors have shapes, dtypes and strides but no storage, so building a 45B-parameter model
    takes well under a second and allocates nothing. Initialisers the constructors run (``nn.init.*`` in
    ``reset_parameters``) compute nothing and consume no random numbers on meta; the value-only in-place ones
    (``normal_``, ``uniform_``, ``fill_``, ``zero_``, ...) are skipped outright by a scoped torch function mode, since
    torch runs some of them on meta through a slow Python decomposition. The random ones are recorded (initialiser,
    shape, dtype, arguments), so that materialising a Hugging Face model can replay them and reach its
    ``_init_weights`` at the same point of the random stream as an eager build (:mod:`zeroshard.init.ctor_draws`).

    Tensors created with an explicit ``device=`` (e.g. ``torch.zeros(3, device="cpu")``) are not affected, and plain
    tensor attributes that are neither parameters nor buffers are not materialised later by :func:`materialize_`.
    """
    log = new_log(empty_init=empty_init)
    handle = register_module_module_registration_hook(log.record_registration)
    profiler = sys.getprofile()
    whole_calls: list = []
    sys.setprofile(_recording_calls(log, profiler, whole_calls))
    try:
        with torch.device("meta"), _SkipMetaInitializers(log, whole_calls):
            yield
    finally:
        sys.setprofile(profiler)
        handle.remove()


def materialize_(
    modules: Iterable[nn.Module],
    device: torch.device | str,
    *,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    root: nn.Module | None = None,
    names: dict[nn.Module, str] | None = None,
) -> list[nn.Module]:
    """Allocate and initialise, module by module, the meta parameters and buffers that each listed module owns directly.

    For each module in ``modules``, in order: its own parameters and buffers (``recurse=False``; children are *not*
    touched unless listed themselves) that are on meta are replaced by uninitialised tensors on ``device`` with the same
    shape, dtype, strides and ``requires_grad`` (parameters stay ``nn.Parameter`` and keep Python attributes set on
    them; non-persistent buffers stay non-persistent), then initialised by ``param_init_fn(module)`` if given, else by
    ``module.reset_parameters()``, under ``torch.no_grad()``. Modules with no meta tensors of their own are skipped
    (their initialiser is not called, so calling this twice initialises nothing twice).

    Tied tensors (one object registered in several modules) are allocated and initialised once, by their first holder
    in this order, and the replacement is installed in every slot that held the meta tensor: every slot under ``root``
    immediately, and any other slot when its module is materialised in a later call. Without ``root``, a slot outside
    ``modules`` keeps the meta tensor (and keeps the replacement alive through it) until then. If a module holds
    already-materialised tensors besides meta ones, its initialiser still runs, and the already-materialised tensors are
    restored to their previous values after it (no silent re-init).

    Args:
        modules: the modules to materialise, in initialisation order (a list or other iterable of modules; to
            materialise a module and all its children use :func:`materialize_module_`). For bit parity with an eager
            build, consecutive calls must together follow ``root.modules()`` order (see the module docstring).
        device: where to allocate (``torch.device`` or string, e.g. ``"cpu"``, ``"cuda:0"``).
        param_init_fn: called as ``param_init_fn(module)`` instead of ``module.reset_parameters()``; it must initialise
            the module's own tensors only.
        root: the model; used to install tied replacements in every slot and to name modules in errors.
        names: module -> qualified name, for error messages (default: computed from ``root``).

    Returns:
        The modules that were materialised (owned at least one meta tensor), in order.

    Raises:
        TypeError: if ``modules`` is a single ``nn.Module`` (ambiguous: a ``ModuleList`` is iterable) or holds a
            non-module.
        RuntimeError: before anything is allocated, if a module owns meta tensors but has no ``reset_parameters`` and
            no ``param_init_fn`` is given; the message names each such module (qualified name when ``root`` or
            ``names`` is given) and the fix.
    """
    if isinstance(modules, nn.Module):
        raise TypeError(
            f"materialize_ takes a list of modules (each materialises only its own tensors), got the module "
            f"{type(modules).__name__}; pass [module], or use materialize_module_ for a module and all its children"
        )
    modules = list(modules)
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"materialize_ expects nn.Module items, got {type(m).__name__}")
    device = torch.device(device)
    if param_init_fn is None:
        missing = [m for m in modules if owns_meta(m) and not callable(getattr(m, "reset_parameters", None))]
        if missing:
            qual = module_names(root, names)
            listed = ", ".join(f"'{qual.get(m, '?')}' ({type(m).__name__})" for m in missing)
            raise RuntimeError(
                f"cannot initialise modules built on the meta device that have no reset_parameters(): {listed}. "
                "Add a reset_parameters() method that initialises the module's own parameters and buffers "
                "(recurse=False), or pass param_init_fn=fn, called as fn(module)"
            )

    def init(module: nn.Module) -> None:
        if param_init_fn is not None:
            param_init_fn(module)
        else:
            module.reset_parameters()

    holders = meta_holders(root)  # built once per call: installing ties stays linear in the model size
    return [m for m in modules if materialize_module(m, device, init, holders)]


def materialize_module_(
    module: nn.Module,
    device: torch.device | str,
    *,
    param_init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Materialise ``module`` and all its submodules by their own rules (the non-sharded reference path).

    The plan of :mod:`zeroshard.init.init_plan`: ``reset_parameters()`` in ``module.modules()`` order, Hugging Face
    models (any module with ``_init_weights``) in their eager build's order with the constructors' random draws
    replayed, or ``param_init_fn`` for every module. It is dry-run on meta first, so a tensor nobody initialises is an
    error naming every such module, raised before anything is allocated. See :func:`materialize_` for shapes, dtypes and
    tied parameters, and the module docstring for bit parity with an eager build. Returns ``module``.

    Raises:
        RuntimeError: before any allocation, listing every module whose tensors no initialiser writes, and the fix.
    """
    plan = plan_init(module, param_init_fn)
    check_plan(module, plan)
    run_plan(module, plan, device)
    return module


def check_no_meta(module: nn.Module) -> None:
    """Raise ``RuntimeError`` naming every parameter and buffer of ``module`` (all slots, tied ones included) that is
    still on the meta device; return ``None`` otherwise."""
    left = [n for n, p in module.named_parameters(remove_duplicate=False) if p.is_meta]
    left += [n for n, b in module.named_buffers(remove_duplicate=False) if b.is_meta]
    if left:
        raise RuntimeError(
            f"{len(left)} parameters/buffers are still on the meta device (never materialised): {', '.join(left)}"
        )


def has_meta(module: nn.Module) -> bool:
    """True if any parameter or buffer of ``module`` (recursively) is on the meta device."""
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def replacement(t: torch.Tensor) -> torch.Tensor:
    """The tensor that replaced meta tensor ``t`` in :func:`materialize_` (``t`` itself if it was not replaced).

    References taken before materialisation (an optimizer built in ``configure_optimizers``, a plan of units) use
    this to find the live parameter.
    """
    return getattr(t, REPLACEMENT_ATTR, t)

"""Module policies (``wrap_policy``, ``activation_checkpointing``): what they may be, and that they select something.

A policy picks submodules of the model: stage-3 units (:func:`zeroshard.sharding.units.plan_units`) or
activation-checkpointed regions (:func:`zeroshard.strategies.activation_checkpointing.apply_activation_checkpointing`).
Both take an ``nn.Module`` subclass, a non-empty tuple of them, or ``callable(name, module) -> bool``, called with each
submodule's qualified name (``str``, as ``named_modules()`` gives it) and the module; ``wrap_policy`` also takes a
positive parameter-count threshold (``int``). :func:`check_policy` runs when the settings are built (no model yet): the
kind, and that a callable can be called with those two arguments. :func:`check_policy_matches` runs at setup, when the
model is known: a policy that selects no module means nothing (a stage-3 model would be one unit; nothing would be
recomputed), so it is an error naming the model's candidate classes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

__all__ = ["check_policy", "check_policy_matches", "describe_policy", "is_module_class", "repeated_block"]


def is_module_class(value) -> bool:
    return isinstance(value, type) and issubclass(value, nn.Module)


def describe_policy(policy) -> str:
    """A short, readable form of ``policy`` for messages (class names instead of ``<class '...'>``)."""
    if isinstance(policy, type):
        return policy.__qualname__
    if isinstance(policy, tuple) and all(isinstance(c, type) for c in policy):
        return "(" + ", ".join(c.__qualname__ for c in policy) + ("," if len(policy) == 1 else "") + ")"
    return repr(policy)


def _kinds(threshold: bool) -> str:
    return (
        "an nn.Module subclass (e.g. your transformer block class), a non-empty tuple of them, "
        + ("a positive parameter-count threshold (int), " if threshold else "")
        + "or callable(name, module) -> bool"
    )


def check_policy(owner: str, setting: str, policy, *, threshold: bool) -> None:
    """Checks a policy's kind and, for a callable, that it can be called as ``policy(name, module)``.

    Args:
        owner: the strategy or config class name, for messages.
        setting: ``"wrap_policy"`` or ``"activation_checkpointing"``.
        policy: the value given (``None`` is accepted: no policy).
        threshold: whether a positive ``int`` (parameter count) is accepted.

    Raises:
        ValueError: naming the value, the accepted kinds and, for a callable whose signature cannot take
            ``(name, module)``, that signature and the expected one.
    """
    if policy is None or is_module_class(policy):
        return
    if isinstance(policy, tuple):
        if policy and all(is_module_class(c) for c in policy):
            return
        raise ValueError(
            f"{owner}({setting}={policy!r}): a tuple must hold one or more nn.Module subclasses; {setting} takes "
            f"{_kinds(threshold)}."
        )
    if isinstance(policy, int) and not isinstance(policy, bool):
        if threshold and policy >= 1:
            return
        fix = (
            f"a threshold must be >= 1 (units are modules with at least that many parameters), e.g. {setting}=1_000_000"
            if threshold
            else "an int is not accepted"
        )
        raise ValueError(f"{owner}({setting}={policy!r}): {fix}; {setting} takes {_kinds(threshold)}.")
    if isinstance(policy, type) or not callable(policy):
        raise ValueError(
            f"{owner}({setting}={policy!r}) is none of the accepted kinds: {setting} takes {_kinds(threshold)}."
        )
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: checked when called
        return
    try:
        signature.bind("name", nn.Module())
    except TypeError as error:
        raise ValueError(
            f"{owner}({setting}={policy!r}): a callable {setting} is called as policy(name, module) -> bool, with each "
            f"submodule's qualified name (str) and the nn.Module, but its signature {signature} cannot take those two "
            f"arguments ({error}). Write it as `def policy(name, module): return isinstance(module, Block)`, or pass "
            "the module class itself."
        ) from None


def repeated_block(model: nn.Module) -> type | None:
    """The class to suggest as ``wrap_policy``: the planner's guess (Hugging Face's ``_no_split_modules``, else the
    most frequent class in the model's ``nn.ModuleList``s), else the most frequent non-leaf class that holds
    parameters and occurs at least twice (blocks in an ``nn.Sequential``); ``None`` if there is none."""
    from zeroshard.plan.model_spec import _default_unit_class

    guess = _default_unit_class(model)
    if guess is not None:
        return guess
    counts: dict[type, int] = {}
    for m in model.modules():
        if m is not model and any(True for _ in m.children()) and any(True for _ in m.parameters()):
            if not isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
                counts[type(m)] = counts.get(type(m), 0) + 1
    best = max(counts.items(), key=lambda kv: kv[1], default=(None, 0))
    return best[0] if best[1] >= 2 else None


def _candidates(model: nn.Module) -> list[str]:
    """Class names of the model's submodules that hold parameters, most frequent first (blocks repeat)."""
    counts: dict[type, int] = {}
    for m in model.modules():
        if m is not model and any(True for _ in m.parameters()):
            counts[type(m)] = counts.get(type(m), 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: -kv[1])
    return [f"{cls.__qualname__} (x{n})" for cls, n in ordered[:8]]


def check_policy_matches(
    owner: str,
    setting: str,
    policy,
    model: nn.Module,
    predicate: Callable[[str, nn.Module], bool],
    *,
    include_root: bool,
    consequence: str,
) -> list[str]:
    """Raises when ``policy`` selects no module of ``model``; returns the selected modules' qualified names.

    Args:
        predicate: the policy as ``(name, module) -> bool`` (as the code that applies it builds it).
        include_root: whether the model itself counts (activation checkpointing may select it; a stage-3 root is a
            unit anyway).
        consequence: what a policy that matches nothing would do, for the message.

    Raises:
        ValueError: naming the policy, the model's class, the candidate classes (or, for a threshold, the largest
            submodule's parameter count) and the fix.
    """
    selected = [name for name, m in model.named_modules() if (include_root or m is not model) and predicate(name, m)]
    if selected:
        return selected
    shown = describe_policy(policy)
    where = f"{owner}({setting}={shown}) matches no module of the {type(model).__name__}"
    if isinstance(policy, int) and not isinstance(policy, bool):
        sizes = [(sum(p.numel() for p in m.parameters()), name) for name, m in model.named_modules() if m is not model]
        largest = max(sizes, default=(0, "<none>"))
        detail = (
            f": no submodule has {policy:,} or more parameters (the largest, '{largest[1]}', has {largest[0]:,}). "
            f"Use a threshold of at most {largest[0]:,}, or a module class"
        )
    elif callable(policy) and not isinstance(policy, type):
        detail = (
            ": the callable returned False for every submodule (it is called as policy(name, module) with each "
            "submodule's qualified name, e.g. 'blocks.0', and the module). Make it return True for the modules to "
            "select, or pass a module class"
        )
    else:
        detail = f": the model has no instance of {shown}. Check that it is the class the model is built from"
    block = repeated_block(model)
    hint = f", e.g. {setting}={block.__qualname__} (the model's repeated block)" if block is not None else ""
    candidates = _candidates(model)
    if candidates:
        hint += f". The model's classes that hold parameters: {', '.join(candidates)}"
    raise ValueError(f"{where} ({consequence}){detail}{hint}.")

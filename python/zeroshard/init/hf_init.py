"""Hugging Face initialisation order for models built on the meta device.

An eager ``PreTrainedModel`` is initialised by ``post_init()`` at the end of its constructor: ``initialize_weights``
walks the model children first (a module after its children, as ``nn.Module.apply`` does), and calls the
``_init_weights(module)`` of the nearest ``PreTrainedModel`` at or above each module ("smart_apply" in transformers
5.x, ``modeling_utils.py``). A model nested inside another (``GPT2LMHeadModel.transformer`` is a ``GPT2Model``) runs
its own ``post_init`` first, inside the outer constructor, and the outer pass then skips the modules it already did
(``_is_hf_initialized``). On the meta device ``init_weights`` skips all of this (transformers checks the default
device), so every module is left for :mod:`zeroshard.init.init_plan` to initialise in this same order.

A ``transformers.PreTrainedModel`` is such an owner; its subtree is initialised this way. A method named
``_init_weights`` alone does not make one: LitGPT's ``GPT`` has one that nothing calls on construction. Modules put
into a Hugging Face model after its constructor ended (peft's LoRA layers over ``q_proj``, a layer a user replaced)
were never seen by its ``post_init``: :func:`added_later` finds them from the recorded submodule registrations, and
they keep what their own constructors gave them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from zeroshard.init.ctor_draws import Draw, DrawLog, storage_key
from zeroshard.loaded_classes import pretrained_model_class


def is_init_owner(module: nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel``, whose ``post_init`` initialises it (never loads transformers:
    :func:`~zeroshard.loaded_classes.pretrained_model_class`)."""
    base = pretrained_model_class()
    return base is not None and isinstance(module, base) and callable(getattr(type(module), "_init_weights", None))


def added_later(root: nn.Module, log: DrawLog | None) -> set[int]:
    """ids of the modules inside a Hugging Face model of ``root`` that were registered after its constructor ended.

    The constructor's end (where ``post_init`` runs) is the last registration of a direct child of the model made
    before the model itself was registered anywhere (a wrapper such as peft's ``LoraModel`` taking it), ignoring
    replacements of an existing child. A module is added later if its first registration comes after that.
    """
    if log is None or not log.registrations:
        return set()
    first: dict[int, int] = {}  # id(module) -> its first registration
    for r in log.registrations:
        child = r.child()
        if child is not None:
            first.setdefault(id(child), r.seq)
    out: set[int] = set()
    for owner in (m for m in root.modules() if is_init_owner(m)):
        limit = first.get(id(owner), float("inf"))
        ends = [r.seq for r in log.registrations if r.parent() is owner and not r.replaced and r.seq < limit]
        if not ends:
            continue
        end = max(ends)
        out.update(id(m) for m in owner.modules() if m is not owner and first.get(id(m), 0) > end)
    return out


@dataclass
class OwnedModule:
    module: nn.Module
    name: str
    owner: nn.Module  # the nearest init owner at or above the module: its _init_weights initialises the module


def post_order(
    top: nn.Module, top_name: str, seen: set[int], later: set[int] | frozenset = frozenset()
) -> tuple[list[OwnedModule], list[tuple[nn.Module, str]]]:
    """``top``'s subtree children first, each module once (``seen`` is shared with the caller), with its owner; and
    the modules of ``later`` met on the way (left out, with their names, for the caller; their children are not)."""
    out: list[OwnedModule] = []
    left_out: list[tuple[nn.Module, str]] = []

    def visit(m: nn.Module, name: str, owner: nn.Module) -> None:
        if id(m) in seen:
            return
        own = m if is_init_owner(m) else owner
        if id(m) in later:
            left_out.append((m, name))
        else:
            seen.add(id(m))
        for child_name, child in m.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, own)
        if id(m) not in later:
            out.append(OwnedModule(m, name, own))

    visit(top, top_name, top)
    return out, left_out


def _subtree_keys(module: nn.Module, later: set[int] | frozenset = frozenset()) -> set[int]:
    keys = set()
    for m in module.modules():
        if id(m) in later:
            continue
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                keys.add(storage_key(t))
    return keys


def block_events(
    top: nn.Module, modules: list[OwnedModule], log: DrawLog | None, later: set[int] | frozenset = frozenset()
) -> list[Draw | OwnedModule]:
    """The eager build's order for one outermost init owner ``top``: its constructors' random draws (when ``log``
    recorded them) interleaved with each nested owner's ``post_init`` pass.

    Each module is initialised in the pass of its owner (the innermost one), in post-order; a nested owner's pass runs
    right after the last constructor draw into its own tensors, ``top``'s pass after all of them. Draws into tensors
    that no longer exist (a head's weight replaced by a tie) count as ``top``'s, after the nested models.
    """
    owners: list[nn.Module] = []
    for om in modules:
        if om.owner not in owners:
            owners.append(om.owner)
    passes = {id(o): [om for om in modules if om.owner is o] for o in owners}
    if log is None:
        # nested owners come first in post-order, as their post_init runs inside the outer constructor
        order = [om.module for om in modules if om.module in owners]
        order += [o for o in owners if o not in order]
        return [om for o in order for om in passes[id(o)]]

    keys = _subtree_keys(top, later)
    in_top = [d for d in log.draws if d.target() is not None and storage_key(d.target()) in keys]
    if not in_top:
        order = [om.module for om in modules if om.module in owners]
        return [om for o in order + [o for o in owners if o not in order] for om in passes[id(o)]]
    index = {id(d): i for i, d in enumerate(log.draws)}
    first, last = index[id(in_top[0])], index[id(in_top[-1])]
    while last + 1 < len(log.draws) and log.draws[last + 1].target() is None:
        last += 1  # orphaned draws right after: constructed by `top` itself, before its post_init
    draws = [d for d in log.draws[first : last + 1] if d.target() is None or storage_key(d.target()) in keys]
    when: dict[int, int] = {}
    for o in owners:
        if o is top:
            continue
        own_keys = _subtree_keys(o, later)
        seqs = [d.seq for d in in_top if storage_key(d.target()) in own_keys]
        when[id(o)] = max(seqs) if seqs else in_top[0].seq - 1
    nested = sorted((o for o in owners if o is not top), key=lambda o: when[id(o)])
    events: list[Draw | OwnedModule] = []
    k = 0
    for d in draws:
        while k < len(nested) and when[id(nested[k])] < d.seq:
            events += passes[id(nested[k])]
            k += 1
        events.append(d)
    for o in nested[k:]:
        events += passes[id(o)]
    events += passes.get(id(top), [])
    return events

"""Units for ZeRO stage 3: which module's parameters are gathered together on use.

A wrap policy picks unit modules (a transformer block, say); the root is always a unit and takes every parameter no
other unit claims. A unit owns the parameters registered in its subtree, minus those of nested units. A parameter used
by
modules of several units (tied embedding and LM head in different units) goes to the root, so it is gathered whenever
any of its users runs (DESIGN.md: keep tied parameters in one unit; Lightning issue 21403).

Inside a unit, parameters are split into flat parameters by optimizer param group (and by ``apart``, as for buckets:
under int8 optimizer state the small parameters that keep fp32 moments), and frozen parameters get a flat parameter of
their own (no master shard, no gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from zeroshard.sharding.buckets import Apart, BucketPlan

WrapPolicy = type | tuple | Callable[[str, nn.Module], bool] | int | None


@dataclass
class UnitPlan:
    """One unit: its module, qualified name, the modules whose own tensors it initialises, and its flat parameters."""

    module: nn.Module
    name: str
    modules: list[nn.Module] = field(default_factory=list)
    buckets: list[BucketPlan] = field(default_factory=list)
    frozen: BucketPlan | None = None


def wrap_predicate(policy: WrapPolicy) -> Callable[[str, nn.Module], bool]:
    """``policy`` as ``(qualified_name, module) -> bool``: whether that submodule is a unit.

    A callable policy is called as ``policy(name, module)``; its result must be ``True`` or ``False`` (a ``TypeError``
    names the module otherwise), and an exception it raises gets a note naming the call and the expected signature.

    Raises:
        TypeError: for a policy of another kind (:func:`zeroshard.engine.policy_check.check_policy` catches it earlier).
    """
    if policy is None:
        return lambda name, m: False
    if isinstance(policy, type) or (isinstance(policy, tuple) and all(isinstance(c, type) for c in policy)):
        return lambda name, m: isinstance(m, policy)
    if isinstance(policy, int) and not isinstance(policy, bool):
        threshold = policy

        def by_size(name: str, m: nn.Module) -> bool:
            return sum(p.numel() for p in m.parameters()) >= threshold

        return by_size
    if callable(policy):

        def called(name: str, m: nn.Module) -> bool:
            try:
                out = policy(name, m)
            except Exception as error:
                error.add_note(
                    f"zeroshard called wrap_policy {policy!r} as policy(name={name!r}, module=<{type(m).__name__}>): "
                    "a callable wrap_policy takes (name: str, module: nn.Module) and returns a bool."
                )
                raise
            if out not in (True, False):
                raise TypeError(
                    f"wrap_policy {policy!r} returned {out!r} for module '{name}' ({type(m).__name__}): a callable "
                    "wrap_policy(name, module) must return True (the module is a unit) or False."
                )
            return bool(out)

        return called
    raise TypeError(
        f"wrap_policy={policy!r} is not a module class, a tuple of classes, a parameter-count threshold (int) or a "
        "callable (name, module) -> bool"
    )


def plan_units(
    root: nn.Module, policy: WrapPolicy, param_groups: list[list[nn.Parameter]], apart: Apart | None = None
) -> list[UnitPlan]:
    """Cuts ``root`` into units in forward (registration) order; the root unit comes first.

    Args:
        root: the model.
        policy: module class(es), a parameter-count threshold, or ``callable(name, module) -> bool``.
        param_groups: the optimizer's parameter lists; a trainable parameter in none of them is treated as frozen.
        apart: ``apart(group_index, param)``: True puts the parameter in its unit's flat parameter of such parameters
            of its group (default: none apart).

    Returns:
        Units; each has at least one flat parameter or is dropped (a unit whose parameters all went elsewhere).

    Raises:
        TypeError: for a policy of another kind.
    """
    wrap = wrap_predicate(policy)
    units = [UnitPlan(module=root, name="")]
    unit_of_module: dict[int, int] = {}
    for name, m in root.named_modules():
        if m is not root and wrap(name, m):
            units.append(UnitPlan(module=m, name=name))
    unit_ids = {id(u.module): i for i, u in enumerate(units)}

    def assign(m: nn.Module, current: int) -> None:
        unit_of_module[id(m)] = current
        units[current].modules.append(m)
        for child in m.children():
            assign(child, unit_ids.get(id(child), current))

    assign(root, 0)

    # owner unit of each parameter: the one unit that registers it, or the root when several do
    owners: dict[int, set[int]] = {}
    for m in root.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(unit_of_module[id(m)])

    group_of = {id(p): gi for gi, params in enumerate(param_groups) for p in params}
    for name, p in root.named_parameters():
        unit = units[next(iter(owners[id(p)])) if len(owners[id(p)]) == 1 else 0]
        if p.requires_grad and id(p) in group_of:
            gi = group_of[id(p)]
            alone = apart is not None and apart(gi, p)
            bucket = next((b for b in unit.buckets if b.group_index == gi and b.apart == alone), None)
            if bucket is None:
                bucket = BucketPlan(group_index=gi, apart=alone)
                unit.buckets.append(bucket)
        else:
            if unit.frozen is None:
                unit.frozen = BucketPlan(group_index=-1)
            bucket = unit.frozen
        bucket.names.append(name)
        bucket.params.append(p)
        bucket.numel += p.numel()
    return [u for u in units if u.buckets or u.frozen is not None or u.module is root]

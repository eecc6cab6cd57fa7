"""Checks on optimizer state restored from a checkpoint, run before any optimizer or model state changes.

A checkpoint is input: a re-sealed file can hold ``lr: NaN`` (every weight NaN after one step), ``"params": []``
(nothing trains) or another optimizer's groups (AdamW's ``betas``/``eps`` in an SGD group, ``exp_avg`` and no
momentum buffer). So the saved optimizer state must match the optimizer it is loaded into:

- the class, where the checkpoint records it (``index.json`` of a sharded checkpoint, from this version on); else by
  the keys of its param groups. ``CPUAdam``/``OffloadedAdam`` count as ``torch.optim.AdamW`` (``adamw_mode``) or
  ``Adam``, as ``offload_optimizer=True`` converts between them;
- the keys of every param group: those of ``optimizer.defaults`` (implementation flags such as ``foreach`` or
  ``fused`` may be missing, as torch allows) plus the ones LR schedulers add (``initial_lr``, ...);
- each value's type (that of the live group's value or default), finite numbers, and the ranges the keys have in
  torch: ``lr``, ``weight_decay`` >= 0, ``eps`` > 0, ``betas`` and ``momentum`` in [0, 1);
- ``params``: as many per group as this optimizer has (an empty list against a non-empty group is refused);
- per-parameter state keys of the optimizers whose keys are known (Adam/AdamW, SGD); ``step`` finite and >= 0.

``optimizer_state="reset"`` (a :class:`~zeroshard.engine.config.ZeroConfig` setting, also ``ZeroStrategy(...)`` /
``ZeroFabricStrategy(...)``) is the explicit way to change optimizers across a resume: the weights (and the trainer
state) load, the saved optimizer state is dropped, not even checked, and the optimizer starts fresh with the
hyperparameters it was built with; a warning lists exactly what was dropped. Tensor contents (``exp_avg`` ...) are not
scanned: the checks read only headers and the index.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

MODES = ("strict", "reset")
# added to param groups by torch's LR schedulers (OneCycleLR, LambdaLR, ...), absent from optimizer.defaults
SCHEDULE_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"})
# how, not what, a step computes (torch fills them in when missing); the decoupling flags are compared by kind instead
IMPLEMENTATION_KEYS = frozenset(
    {"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay", "adamw_mode"}
)
# flags one implementation of Adam has and the other lacks: dropped only at the value that means "the other's step"
NEUTRAL = {"amsgrad": False, "maximize": False, "bias_correction": True}
# exp_avg_absmax / exp_avg_sq_absmax: the block scales of CPUAdam's int8 moments (zeroshard.optim.state_format)
_ADAM_STATE = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"})
STATE_KEYS = {"torch.optim.AdamW": _ADAM_STATE, "torch.optim.Adam": _ADAM_STATE, "torch.optim.SGD": {"momentum_buffer"}}
_UNIT_INTERVAL = ("momentum", "base_momentum", "max_momentum")
RESET_HINT = (
    "or, to keep only the saved weights, pass optimizer_state='reset' (ZeroStrategy / ZeroFabricStrategy / "
    "ZeroConfig): the optimizer then starts fresh"
)


class OptimizerRestoreError(ValueError):
    """Saved optimizer state that does not fit the optimizer it is loaded into; names the file, group, key, value."""


def optimizer_kind(optimizer: Optimizer) -> str:
    """The name a checkpoint records for ``optimizer``'s class: ``torch.optim.NAME`` for torch's own, the AdamW/Adam
    that an offloaded ``CPUAdam`` steps as, else ``module.QualName``."""
    from zeroshard.optim.cpu_adam import CPUAdam  # here: cpu_adam may import this module

    cls, d = type(optimizer), optimizer.defaults
    if isinstance(optimizer, CPUAdam):
        return "torch.optim.AdamW" if d.get("adamw_mode", True) else "torch.optim.Adam"
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        return "torch.optim.AdamW" if d.get("decoupled_weight_decay", cls is torch.optim.AdamW) else "torch.optim.Adam"
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(source: str, where: str, key: str, value: Any, problem: str, fix: str) -> OptimizerRestoreError:
    return OptimizerRestoreError(f"{source}: {where}, key {key!r} = {_short(value)}: {problem}. Fix: {fix}")


def _is_number(v: Any) -> bool:
    if torch.is_tensor(v):
        return v.dim() == 0 and (v.is_floating_point() or not v.dtype.is_complex)
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _same_type(ref: Any, v: Any) -> bool:
    """Whether ``v`` may replace ``ref`` (ints and floats are one kind; JSON turns tuples into lists)."""
    if isinstance(ref, bool):
        return isinstance(v, bool)
    if _is_number(ref):
        return _is_number(v)
    if isinstance(ref, (tuple, list)):
        return isinstance(v, (tuple, list)) and len(v) == len(ref) and all(map(_same_type, ref, v))
    if ref is None:  # torch's "choose for me" (foreach, fused): any plain scalar
        return v is None or isinstance(v, (bool, str)) or _is_number(v)
    if isinstance(ref, str):
        return isinstance(v, str)
    return type(v) is type(ref)


def _nonfinite(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return any(map(_nonfinite, v))
    return _is_number(v) and not math.isfinite(float(v))


def _range_problem(key: str, v: Any) -> str | None:
    if key == "betas" and isinstance(v, (tuple, list)):
        bad = [b for b in v if _is_number(b) and not 0 <= float(b) < 1]
        return f"each beta must be in [0, 1), not {bad[0]!r}" if bad else None
    if not _is_number(v):
        return None
    x = float(v)
    if key in ("lr", "initial_lr", "max_lr", "min_lr", "weight_decay") and x < 0:
        return "must be >= 0"
    if key == "eps" and x <= 0:
        return "must be > 0"
    if key in _UNIT_INTERVAL and not 0 <= x < 1:
        return "must be in [0, 1)"
    if key == "dampening" and not 0 <= x <= 1:
        return "must be in [0, 1]"
    return None


def _as_live(ref: Any, v: Any) -> Any:
    """``v`` in the live value's form: tuples stay tuples, a tensor hyperparameter stays a tensor."""
    if isinstance(ref, tuple):
        return tuple(_as_live(r, x) for r, x in zip(ref, v))
    if torch.is_tensor(ref) and not torch.is_tensor(v):
        return torch.tensor(v, dtype=ref.dtype, device=ref.device)
    return v


def _decoupled(group: dict) -> bool | None:
    for key in ("decoupled_weight_decay", "adamw_mode"):
        if isinstance(group.get(key), bool):
            return group[key]
    return None


def check_group(
    source: str, gi: int, saved: Any, optimizer: Optimizer, live: dict, kind: str, saved_kind: str | None
) -> dict[str, Any]:
    """Checks saved param group ``gi`` (without ``params``) against ``live``, a param group of ``optimizer``.

    Returns:
        the values to assign to the live group, in its own types (keys only another implementation of the same
        optimizer has are left out).

    Raises:
        OptimizerRestoreError: naming ``source``, the group, the key and the value, and the fix.
    """
    where = f"optimizer param group {gi}"
    if not isinstance(saved, dict):
        raise _fail(
            source,
            where,
            "*",
            saved,
            "a param group must be a dict of hyperparameters",
            f"restore an unedited checkpoint, {RESET_HINT}",
        )
    defaults = optimizer.defaults
    known = set(defaults) | (set(live) - {"params"})
    saved_keys = set(saved) - {"params"}
    foreign = sorted(k for k in saved_keys - known if k not in SCHEDULE_KEYS | IMPLEMENTATION_KEYS | set(NEUTRAL))
    missing = sorted(k for k in set(defaults) - saved_keys if k not in IMPLEMENTATION_KEYS and k not in NEUTRAL)
    if foreign or missing:
        saved_as = f"saved by {saved_kind}" if saved_kind else "saved by another optimizer class, by its keys"
        key = (foreign or missing)[0]
        raise _fail(
            source,
            where,
            key,
            saved.get(key, "<missing>"),
            f"the group has keys {kind} does not take ({', '.join(foreign) or 'none'}) and lacks keys it needs "
            f"({', '.join(missing) or 'none'}): {saved_as}",
            f"build the optimizer the checkpoint was saved with, {RESET_HINT}",
        )
    live_decoupled, saved_decoupled = _decoupled(live), _decoupled(saved)
    if kind in ("torch.optim.Adam", "torch.optim.AdamW") and saved_decoupled not in (None, live_decoupled):
        key = "decoupled_weight_decay" if "decoupled_weight_decay" in saved else "adamw_mode"
        other = "torch.optim.AdamW" if saved_decoupled else "torch.optim.Adam"
        raise _fail(
            source,
            where,
            key,
            saved[key],
            f"saved by {other} (weight decay coupled differently), this is {kind}",
            f"build {other} as the saving run did, {RESET_HINT}",
        )
    out: dict[str, Any] = {}
    for key in sorted(saved_keys):
        value = saved[key]
        if key in known:
            ref = live[key] if key in live else defaults[key]
        elif key in SCHEDULE_KEYS:
            ref = 0.0
        elif key in NEUTRAL and value != NEUTRAL[key]:
            raise _fail(
                source,
                where,
                key,
                value,
                f"{type(optimizer).__name__} has no {key!r} setting, so this state cannot be continued",
                f"resume without offload_optimizer (torch's Adam/AdamW has it), {RESET_HINT}",
            )
        else:  # another implementation's flag (foreach, adamw_mode, ...) or a neutral one: nothing to carry over
            continue
        if not _same_type(ref, value):
            raise _fail(
                source,
                where,
                key,
                value,
                f"{kind} holds a {type(ref).__name__} here (e.g. {_short(ref)}), not a {type(value).__name__}",
                f"restore an unedited checkpoint, {RESET_HINT}",
            )
        if _nonfinite(value):
            raise _fail(
                source,
                where,
                key,
                value,
                "not a finite number (one step would make every weight NaN or inf)",
                f"restore an unedited checkpoint, {RESET_HINT}",
            )
        problem = _range_problem(key, value)
        if problem:
            raise _fail(source, where, key, value, problem, f"restore an unedited checkpoint, {RESET_HINT}")
        out[key] = _as_live(ref, value)
    return out


def check_state_keys(source: str, where: str, kind: str, keys: Iterable[str]) -> None:
    """Per-parameter state keys against those ``kind`` keeps (when known).

    Raises:
        OptimizerRestoreError: for a key the optimizer never keeps (naming it and the expected ones).
    """
    expected = STATE_KEYS.get(kind)
    if expected is None:
        return
    extra = sorted(set(keys) - expected)
    if extra:
        raise _fail(
            source,
            where,
            extra[0],
            "<state tensor>",
            f"{kind} keeps only {', '.join(sorted(expected))}: this state is another optimizer's",
            f"build the optimizer the checkpoint was saved with, {RESET_HINT}",
        )


def check_step(source: str, where: str, value: Any) -> None:
    """``step``: a finite number >= 0 (a NaN step makes Adam's bias correction NaN)."""
    ok = _is_number(value) or (torch.is_tensor(value) and value.numel() == 1)
    if not ok or not math.isfinite(float(value)) or float(value) < 0:
        raise _fail(
            source,
            where,
            "step",
            value,
            "must be a finite number >= 0",
            f"restore an unedited checkpoint, {RESET_HINT}",
        )


def check_params(source: str, groups: Sequence[Any], counts: Sequence[int]) -> None:
    """The ``params`` lists of a torch-format state dict against this optimizer's parameter counts per group.

    Raises:
        OptimizerRestoreError: a group count or a per-group parameter count that differs (an empty list against a
            non-empty group included), or indices that are not distinct integers.
    """
    if len(groups) != len(counts):
        raise _fail(
            source,
            "optimizer state",
            "param_groups",
            f"<{len(groups)} groups>",
            f"this optimizer has {len(counts)} param groups",
            f"configure_optimizers must build the same groups as the run that saved it, {RESET_HINT}",
        )
    seen: set[int] = set()
    for gi, (group, count) in enumerate(zip(groups, counts)):
        params = group.get("params") if isinstance(group, dict) else None
        where = f"optimizer param group {gi}"
        if not isinstance(params, list) or len(params) != count:
            n = len(params) if isinstance(params, list) else "no list of"
            raise _fail(
                source,
                where,
                "params",
                params,
                f"the checkpoint has {n} parameters here, this optimizer {count}",
                "the model or configure_optimizers changed since the checkpoint was written "
                f"(build the same param groups), {RESET_HINT}",
            )
        bad = [i for i in params if isinstance(i, bool) or not isinstance(i, int) or i in seen]
        if bad:
            raise _fail(
                source,
                where,
                "params",
                params,
                f"parameter index {bad[0]!r} is not a distinct integer",
                f"restore an unedited checkpoint, {RESET_HINT}",
            )
        seen.update(params)


def apply_groups(live_groups: Sequence[dict], values: Sequence[dict[str, Any]]) -> None:
    """Assigns checked values (from :func:`check_group`) to the live param groups."""
    for group, new in zip(live_groups, values):
        group.update(new)


def warn_reset(
    source: str,
    kinds: Sequence[str | None],
    groups: Sequence[Any],
    state_keys: Iterable[str],
    live: Sequence[Optimizer],
) -> None:
    """Logs (a warning on rank 0) exactly what ``optimizer_state='reset'`` dropped."""
    saved_as = ", ".join(k or "an unrecorded class" for k in kinds) if kinds else "an unrecorded class"
    described = []
    for gi, g in enumerate(groups):
        items = g.items() if isinstance(g, dict) else []
        described.append(f"group {gi} {{" + ", ".join(f"{k}: {_short(v)}" for k, v in items if k != "params") + "}")
    keys = ", ".join(sorted(set(state_keys))) or "none"
    fresh = ", ".join(optimizer_kind(o) for o in live)
    rank_zero_warn(
        f"{source}: optimizer_state='reset': dropped the saved optimizer state (saved by {saved_as}): param groups "
        f"{'; '.join(described) or 'none'}; per-parameter state {keys}. The weights were loaded; {fresh} starts "
        "fresh with the hyperparameters it was built with."
    )


def saved_state_keys(tensor_names: Iterable[str]) -> dict[int, set[str]]:
    """Per-element optimizer state keys by saved flat parameter, from a rank file's tensor names
    (``flat.{i}.optim.{key}``)."""
    out: dict[int, set[str]] = {}
    for name in tensor_names:
        head, sep, key = name.partition(".optim.")
        if sep and head.startswith("flat.") and head[5:].isdigit():
            out.setdefault(int(head[5:]), set()).add(key)
    return out


def check_sharded(
    source: str, saved: Any, layouts: Sequence[Any], optim, flat_params, tensor_keys: dict[int, set[str]]
) -> list[dict[str, Any]]:
    """Checks a sharded checkpoint's ``index["optimizer"]`` against the engine's optimizers, before anything loads.

    Args:
        source: what to name in errors (the index file).
        saved: ``index["optimizer"]``: ``param_groups`` (without ``params``), ``scalar_state``, ``group_optimizer``
            and, from this version on, ``classes`` (:func:`optimizer_kind` of each optimizer).
        layouts: ``index["flat_params"]`` (their ``group`` assigns parameters to param groups).
        optim: the engine's :class:`~zeroshard.optim.sharded_optimizer.OptimizerSet`.
        flat_params: the engine's flat parameters (all, frozen included).
        tensor_keys: :func:`saved_state_keys` of rank file 0.

    Returns:
        the values to assign to each live param group (:func:`apply_groups`).

    Raises:
        OptimizerRestoreError: naming ``source``, the group (or parameter), the key, the value and the fix.
    """
    fix = f"restore an unedited checkpoint, {RESET_HINT}"
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise _fail(source, "optimizer state", "param_groups", saved, "no list of param groups", fix)
    groups, live_groups = saved["param_groups"], optim.param_groups
    owner = saved.get("group_optimizer", [0] * len(groups))
    if len(groups) != len(live_groups) or owner != optim.group_optimizer:
        raise _fail(
            source,
            "optimizer state",
            "group_optimizer",
            owner,
            f"its optimizers own {len(groups)} param "
            f"groups as listed (optimizer index per group), this run's own {optim.group_optimizer}",
            f"build the same optimizers and param groups as the run that saved it, {RESET_HINT}",
        )
    live_kinds = [optimizer_kind(o) for o in optim.optimizers]
    kinds = saved.get("classes")  # absent before this version: then the keys of the groups tell
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != len(live_kinds):
            raise _fail(
                source,
                "optimizer state",
                "classes",
                kinds,
                f"not one class name per optimizer ({len(live_kinds)})",
                fix,
            )
        for oi, (s, live) in enumerate(zip(kinds, live_kinds)):
            if s != live:
                raise _fail(
                    source,
                    f"optimizer {oi}",
                    "classes",
                    s,
                    f"this run's optimizer {oi} is {live}",
                    f"build {s} as the saving run did, {RESET_HINT}",
                )
    values = []
    for gi, (g, live) in enumerate(zip(groups, live_groups)):
        oi = optim.group_optimizer[gi]
        if isinstance(g, dict) and "params" in g:
            raise _fail(
                source,
                f"optimizer param group {gi}",
                "params",
                g["params"],
                "a sharded checkpoint's groups "
                "list no parameters (each flat parameter's 'group' does): the index was edited",
                fix,
            )
        values.append(
            check_group(source, gi, g, optim.optimizers[oi], live, live_kinds[oi], kinds[oi] if kinds else None)
        )

    saved_group_of: dict[str, int] = {}
    for i, entry in enumerate(layouts):
        if not isinstance(entry, dict) or not entry.get("trainable", True) or "group" not in entry:
            continue
        g = entry["group"]
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < len(groups):
            raise _fail(
                source, f"flat parameter {i}", "group", g, f"not a param group index (0 to {len(groups) - 1})", fix
            )
        for name in entry.get("names", []):
            saved_group_of[str(name)] = g
    for fp in flat_params:
        if not fp.trainable:
            continue
        g = optim.group_index_of(fp)
        for name in fp.names:
            s = saved_group_of.get(name, g)
            if s != g:
                raise _fail(
                    source,
                    f"parameter {name!r}",
                    "group",
                    s,
                    f"this run puts it in param group {g}",
                    f"configure_optimizers must build the same param groups as the run that saved it, {RESET_HINT}",
                )

    scalar = saved.get("scalar_state", {})
    if not isinstance(scalar, dict):
        raise _fail(source, "optimizer state", "scalar_state", scalar, "not a dict by flat parameter", fix)
    keys = {i: set(k) for i, k in tensor_keys.items()}
    for i, state in scalar.items():
        where = f"scalar optimizer state of flat parameter {i}"
        if not (isinstance(i, str) and i.isdigit() and int(i) < len(layouts)) or not isinstance(state, dict):
            raise _fail(
                source,
                where,
                str(i),
                state,
                f"not a flat parameter index (0 to {len(layouts) - 1}) with a dict of values",
                fix,
            )
        for key, value in state.items():
            if key == "step":
                check_step(source, where, value)
            elif not (value is None or isinstance(value, (bool, str)) or _is_number(value)) or _nonfinite(value):
                raise _fail(source, where, key, value, "not a finite number", fix)
        keys.setdefault(int(i), set()).update(state)
    for i, ks in keys.items():
        entry = layouts[i] if 0 <= i < len(layouts) and isinstance(layouts[i], dict) else {}
        g = entry.get("group")
        if isinstance(g, int) and 0 <= g < len(groups):
            check_state_keys(
                source, f"optimizer state of flat parameter {i} (group {g})", live_kinds[optim.group_optimizer[g]], ks
            )
    return values

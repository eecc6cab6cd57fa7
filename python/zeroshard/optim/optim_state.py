"""Consolidated optimizer state in torch's own ``Optimizer.state_dict()`` format.

Shards of every per-element state tensor (``exp_avg``, ``exp_avg_sq``, momentum, ...) are all-gathered bucket by bucket
and cut back into per-parameter tensors, numbered as torch numbers the parameters of the optimizer the user built.
The result is what the same optimizer would hold without zeroshard, so a checkpoint loads into plain torch, into
Lightning's ``ddp``, or into zeroshard at any world size and stage (each rank takes only its own shard slices back).

State formats (:mod:`zeroshard.optim.state_format`): bf16 moments are gathered as they are (exact, and what a
single-process ``CPUAdam(state_dtype=torch.bfloat16)`` holds); int8 moments are written as their exact fp32 values
(:func:`~zeroshard.optim.state_format.moments_fp32`), since their blocks belong to the shard, not to a parameter:
torch's fp32 Adam format, readable by any tool. Loading converts the moments to the format of the optimizer that takes
them (int8 requantised over the new shards' blocks: deterministic, not the saved bits; sharded checkpoints keep them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from zeroshard.optim import restore_checks
from zeroshard.optim.state_format import ABSMAX_KEYS, convert_moments, moments_fp32
from zeroshard.sharding.flat_param import FlatParam

State = dict[str, Any]


def _is_per_element(value: Any, shard_numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == shard_numel


def consolidated_state_dict(
    optimizer: Optimizer, flat_params: list[FlatParam], original_groups: list[list[torch.nn.Parameter]], collectives
) -> dict[str, Any]:
    """Gathers the full optimizer state; collective: every rank must call it. Only rank 0 gets a non-empty result.

    Returns:
        ``{"state": {index: {key: tensor}}, "param_groups": [...]}`` with CPU tensors, indices counting the parameters
        of ``original_groups`` in order (torch's numbering). Empty dict on ranks other than 0.
    """
    rank = collectives.rank
    where = {id(p): (fi, pi) for fi, fp in enumerate(flat_params) for pi, p in enumerate(fp.params)}
    per_param: dict[tuple[int, int], State] = {}
    for fi, fp in enumerate(flat_params):
        shard_state = optimizer.state.get(fp.master, {})
        if torch.is_tensor(shard_state.get("exp_avg")) and shard_state["exp_avg"].dtype == torch.uint8:
            m, v = moments_fp32(shard_state)  # int8 blocks are the shard's: write exact fp32 moments
            kept = {k: x for k, x in shard_state.items() if k not in ABSMAX_KEYS}
            shard_state = {**kept, "exp_avg": m, "exp_avg_sq": v}
        for key in sorted(shard_state):
            value = shard_state[key]
            if _is_per_element(value, fp.layout.shard_numel):
                shard = value.detach().to(fp.device)
                full = torch.empty(fp.layout.padded_numel, dtype=shard.dtype, device=fp.device)
                collectives.all_gather([shard], [full], full.numel()).wait()
                if rank == 0:
                    for pi, view in enumerate(fp.layout.views(full)):
                        per_param.setdefault((fi, pi), {})[key] = view.cpu().clone()
            elif rank == 0:
                if key == "step" and not torch.is_tensor(value):  # CPUAdam counts in a plain number; torch's format
                    value = torch.tensor(float(value), dtype=torch.float32)
                for pi in range(len(fp.params)):
                    per_param.setdefault((fi, pi), {})[key] = value.clone() if torch.is_tensor(value) else value
    if rank != 0:
        return {}

    state: dict[int, State] = {}
    groups = []
    index = 0
    for group, params in zip(optimizer.param_groups, original_groups):
        ids = []
        for p in params:
            if id(p) in where and where[id(p)] in per_param:
                state[index] = per_param[where[id(p)]]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def load_consolidated_state_dict(
    optimizer: Optimizer,
    flat_params: list[FlatParam],
    original_groups: list[list[torch.nn.Parameter]],
    state_dict: dict[str, Any],
    mode: str = "strict",
    source: str = "the optimizer state dict",
) -> None:
    """Loads a state dict from :func:`consolidated_state_dict` (or a plain torch optimizer over the same model).

    Each rank copies only the slices of each per-parameter tensor that fall into its own shards. Everything is checked
    before any state changes (:mod:`zeroshard.optim.restore_checks`): the param group keys against
    ``optimizer.defaults`` (another optimizer's groups are refused), their types and ranges, and the parameters per
    group. ``mode="reset"`` (``optimizer_state="reset"``) drops the saved state instead: the optimizer starts fresh
    and a warning lists what was dropped.

    Args:
        mode: ``"strict"`` or ``"reset"``.
        source: what errors name as the origin (the checkpoint file, where known).

    Raises:
        OptimizerRestoreError (a ``ValueError``): naming ``source``, the group, the key and the value: a different
            number of param groups or of parameters in a group (an empty ``params`` list included), a key the
            optimizer does not take or lacks, a value of another type, non-finite or out of range, per-parameter state
            of another optimizer.
    """
    if mode == "reset":
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        states = state_dict.get("state") if isinstance(state_dict, dict) else None
        keys = {k for st in states.values() if isinstance(st, dict) for k in st} if isinstance(states, dict) else set()
        optimizer.state.clear()
        restore_checks.warn_reset(source, [], groups if isinstance(groups, list) else [], keys, [optimizer])
        return
    saved_groups, saved_state, values = check_consolidated_state_dict(optimizer, original_groups, state_dict, source)
    restore_checks.apply_groups(optimizer.param_groups, values)  # everything before only read
    index_of: dict[int, int] = {}
    for saved, params in zip(saved_groups, original_groups):
        for idx, p in zip(saved["params"], params):
            index_of[id(p)] = int(idx)

    optimizer.state.clear()
    for fp in flat_params:
        master = fp.master
        new_state: State = {}
        states = [saved_state.get(index_of.get(id(p), -1)) for p in fp.params]
        present = [(p, s) for p, s in zip(fp.params, states) if s]
        if not present:
            continue
        keys = sorted({k for _, s in present for k in s})
        for key in keys:
            first = next(s[key] for _, s in present if key in s)
            if (
                torch.is_tensor(first)
                and first.dim() > 0
                and first.shape == next(p for p, s in present if key in s).shape
            ):
                shard = torch.zeros(fp.layout.shard_numel, dtype=first.dtype, device=master.device)
                for pi, p_off, s_off, n in fp.layout.shard_slices(fp.rank):
                    s = states[pi]
                    if s and key in s:
                        shard[s_off : s_off + n].copy_(s[key].reshape(-1)[p_off : p_off + n])
                new_state[key] = shard
            else:
                new_state[key] = first.clone() if torch.is_tensor(first) else first
        # a CPUAdam: this master's moments in its format (under int8, fp32 for a flat parameter of small parameters)
        fmt = optimizer.state_format(master) if hasattr(optimizer, "state_format") else None
        if fmt is not None and all(torch.is_tensor(new_state.get(k)) for k in ("exp_avg", "exp_avg_sq")):
            for key in ABSMAX_KEYS:
                new_state.pop(key, None)
            moments = convert_moments(new_state, fmt, torch.Size([fp.layout.shard_numel]))
            new_state.update({k: t.to(master.device) for k, t in moments.items()})
        optimizer.state[master] = new_state


def check_consolidated_state_dict(
    optimizer: Optimizer, original_groups: list[list[torch.nn.Parameter]], state_dict: Any, source: str
) -> tuple[list[dict], dict[int, State], list[dict[str, Any]]]:
    """Checks a torch-format state dict against ``optimizer`` (whose parameters before rewiring are
    ``original_groups``); changes nothing. Returns the saved groups, the per-parameter state by index and the checked
    values to assign to each param group.

    Raises:
        OptimizerRestoreError (a ``ValueError``): as :func:`load_consolidated_state_dict`.
    """
    rc = restore_checks
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        raise rc.OptimizerRestoreError(f"{source}: not an optimizer state dict (no 'param_groups' list)")
    if not isinstance(state_dict.get("state"), dict):
        raise rc.OptimizerRestoreError(f"{source}: not an optimizer state dict (no 'state' dict)")
    saved_groups = state_dict["param_groups"]
    rc.check_params(source, saved_groups, [len(params) for params in original_groups])
    kind = rc.optimizer_kind(optimizer)
    values = [
        rc.check_group(source, gi, {k: v for k, v in g.items() if k != "params"}, optimizer, live, kind, None)
        for gi, (g, live) in enumerate(zip(saved_groups, optimizer.param_groups))
    ]
    shape_of = {int(i): p.shape for g, ps in zip(saved_groups, original_groups) for i, p in zip(g["params"], ps)}
    per_element = rc.STATE_KEYS.get(kind, set()) - {"step"}  # known only for torch's Adam/AdamW and SGD
    saved_state: dict[int, State] = {}
    for idx, st in state_dict["state"].items():
        where = f"optimizer state of parameter {idx}"
        if not isinstance(st, dict) or isinstance(idx, bool) or not str(idx).lstrip("-").isdigit():
            raise rc.OptimizerRestoreError(f"{source}: {where}: not a parameter index with a dict of state")
        rc.check_state_keys(source, where, kind, st)
        if "step" in st:
            rc.check_step(source, where, st["step"])
        for key in per_element & set(st):
            v, shape = st[key], shape_of.get(int(idx))
            if not (torch.is_tensor(v) and v.is_floating_point() and (shape is None or v.shape == shape)):
                raise rc.OptimizerRestoreError(
                    f"{source}: {where}, key {key!r}: a {type(v).__name__} of shape {tuple(getattr(v, 'shape', ()))}, "
                    f"not a floating tensor of the parameter's shape {tuple(shape or ())}. Fix: restore an unedited "
                    f"checkpoint, {rc.RESET_HINT}"
                )
        saved_state[int(idx)] = st
    return saved_groups, saved_state, values

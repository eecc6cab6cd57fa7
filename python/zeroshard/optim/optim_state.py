"""Consolidated optimizer state in torch's own ``Optimizer.state_dict()`` format.

Shards of every per-element state tensor (``exp_avg``, ``exp_avg_sq``, momentum, ...) are all-gathered bucket by bucket
and cut back into per-parameter tensors, numbered as torch numbers the parameters of the optimizer the user built.
The result is what the same optimizer would hold without zeroshard, so a checkpoint loads into plain torch, into
Lightning's ``ddp``, or into zeroshard at any world size and stage (each rank takes only its own shard slices back).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

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
) -> None:
    """Loads a state dict from :func:`consolidated_state_dict` (or a plain torch optimizer over the same model).

    Each rank copies only the slices of each per-parameter tensor that fall into its own shards.

    Raises:
        ValueError: if the number of param groups or of parameters in a group differs from the checkpoint's.
    """
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(original_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one has {len(original_groups)}: "
            "configure_optimizers must build the same groups as the run that saved it"
        )
    for gi, (saved, params) in enumerate(zip(saved_groups, original_groups)):
        if len(saved["params"]) != len(params):
            raise ValueError(
                f"param group {gi}: the checkpoint has {len(saved['params'])} parameters, this optimizer "
                f"{len(params)}: the model or configure_optimizers changed since the checkpoint was written"
            )
    saved_state = {int(k): v for k, v in state_dict["state"].items()}
    index_of: dict[int, int] = {}
    for saved, params in zip(saved_groups, original_groups):
        for idx, p in zip(saved["params"], params):
            index_of[id(p)] = int(idx)

    for group, saved in zip(optimizer.param_groups, saved_groups):
        for k, v in saved.items():
            if k != "params":
                group[k] = v

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
        optimizer.state[master] = new_state

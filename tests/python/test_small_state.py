"""Planning under int8 state (``zeroshard.optim.small_state``): parameters under ``min_8bit_size`` go into flat
parameters of their own, per param group (and per unit at stage 3); other formats keep the layouts of before."""

from __future__ import annotations

from torch import nn

from zeroshard.optim.small_state import apart_rule
from zeroshard.sharding.buckets import plan_buckets
from zeroshard.sharding.units import plan_units


def _model() -> nn.Module:
    torch_blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(2)]
    return nn.Sequential(
        nn.Embedding(100, 64), *torch_blocks, nn.Linear(64, 100)
    )  # 6400, (4096, 64, 64, 64) x 2, 6400, 100


def _groups(model: nn.Module) -> list[list[nn.Parameter]]:
    return [[p for p in model.parameters() if p.dim() > 1], [p for p in model.parameters() if p.dim() <= 1]]


def _names(plans) -> list[tuple[int, bool, list[str]]]:
    return [(b.group_index, b.apart, b.names) for b in plans]


def test_no_int8_group_keeps_the_buckets_of_before():
    model = _model()
    assert apart_rule([None, None]) is None
    before, _ = plan_buckets(model, _groups(model), 10_000)
    after, _ = plan_buckets(model, _groups(model), 10_000, apart_rule([None, None]))
    assert _names(before) == _names(after) and not any(b.apart for b in after)


def test_small_parameters_get_buckets_of_their_own_per_group():
    model = _model()
    # group 0 (matrices) int8 with a threshold above the Linear weights, group 1 (vectors) int8 at 4096
    plans, _ = plan_buckets(model, _groups(model), 100_000, apart_rule([5000, 4096]))
    for b in plans:
        sizes = [p.numel() for p in b.params]
        limit = 5000 if b.group_index == 0 else 4096
        assert all((n < limit) == b.apart for n in sizes), (b.names, sizes)
    assert sorted((g, a) for g, a, _ in _names(plans)) == [(0, False), (0, True), (1, True)]
    # only one group int8: the other's buckets are as before
    plans, _ = plan_buckets(model, _groups(model), 100_000, apart_rule([None, 4096]))
    assert sorted((g, a) for g, a, _ in _names(plans)) == [(0, False), (1, True)]


def test_stage3_units_split_by_group_and_size():
    model = _model()
    units = plan_units(model, nn.Sequential, _groups(model), apart_rule([5000, 4096]))  # each block a unit
    for u in units:
        keys = [(b.group_index, b.apart) for b in u.buckets]
        assert len(keys) == len(set(keys))
        for b in u.buckets:
            limit = 5000 if b.group_index == 0 else 4096
            assert all((p.numel() < limit) == b.apart for p in b.params)
    block = next(u for u in units if u.name == "1")
    assert sorted((b.group_index, b.apart) for b in block.buckets) == [(0, True), (1, True)]
    root = units[0]
    assert sorted((b.group_index, b.apart) for b in root.buckets) == [(0, False), (1, True)]

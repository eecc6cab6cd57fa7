"""EventClock (bench_stage3_profile.py's Python time per unit event): what it counts, what it leaves out, and that a
detached clock leaves no timing in the hooks. One process (a gloo group of one)."""

import time

import pytest
import torch
from torch import nn

from zeroshard import ZeroConfig, ZeroEngine
from zeroshard.gathered import gathered_parameters
from zeroshard.sharding.event_clock import EventClock

pytestmark = pytest.mark.usefixtures("group")


def _burn(seconds: float) -> None:
    """Spins this thread's CPU for ``seconds`` of its own CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_collective_time_is_left_out_and_nested_events_add_up():
    clock = EventClock()

    def inner():
        _burn(0.004)
        clock.excluded(_burn, 0.02)  # a "collective" inside the inner event

    timed_inner = clock.timed("inner", inner)

    def outer():
        _burn(0.004)
        timed_inner()
        clock.excluded(_burn, 0.02)

    clock.timed("outer", outer)()
    (inner_ns,), (outer_ns,) = clock.samples["inner"], clock.samples["outer"]
    # inner: its 4 ms, not its 20 ms collective; outer: both 4 ms bursts, neither collective (40 ms left out)
    assert 0.004e9 <= inner_ns < 0.012e9, inner_ns
    assert 0.008e9 <= outer_ns < 0.020e9, outer_ns


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def _engine(n_blocks: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), *[_Block(16) for _ in range(n_blocks)], nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, ZeroEngine(model, opt, ZeroConfig(stage=3, wrap_policy=_Block))


def _step(model, engine, x):
    engine.begin_step()
    model(x).sum().backward()
    engine.finish_backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad()
    engine.after_step()


def test_one_sample_per_unit_event_then_none_once_detached():
    n_blocks, steps = 3, 2
    model, engine = _engine(n_blocks)
    x = torch.randn(4, 8)
    _step(model, engine, x)  # the first step records the forward order
    clock = EventClock()
    engine.sharded.time_events(clock)
    for _ in range(steps):
        _step(model, engine, x)
    engine.sharded.time_events(None)
    counts = {name: len(s) for name, s in clock.samples.items() if s}
    per_block = {"pre_forward", "post_forward", "pre_backward", "post_backward"}
    assert {k: counts.get(k) for k in per_block} == {k: n_blocks * steps for k in per_block}, counts
    assert counts.get("root_pre_forward", 0) >= steps, counts
    assert all(ns > 0 for s in clock.samples.values() for ns in s)
    assert type(engine.sharded.collectives).__name__ == "BucketedCollectives"  # the untimed collectives are back
    before = {name: len(s) for name, s in clock.samples.items()}
    _step(model, engine, x)
    assert {name: len(s) for name, s in clock.samples.items()} == before  # detached: nothing recorded


def test_timed_engine_trains_as_the_untimed_one():
    """The clock swaps the hooks' callables and wraps the collectives; the training it measures is unchanged."""
    x = torch.randn(4, 8)
    results = []
    for timed in (False, True):
        model, engine = _engine(2)
        if timed:
            engine.sharded.time_events(EventClock())
        for _ in range(3):
            _step(model, engine, x)
        with gathered_parameters(model):
            results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)

"""When stage 3 frees a unit in backward: once the unit's own backward is over, whatever else uses its inputs. A unit
with one input that requires grad gets a hooked view of it; one with several, the ``_PostBackward`` function over all.
Both are checked here against the moment they must fire, and the step against plain AdamW on an unsharded copy.
One process (a gloo group of one)."""

import copy

import pytest
import torch
from torch import nn

from zeroshard import ZeroConfig, ZeroEngine
from zeroshard.gathered import gathered_parameters
from zeroshard.sharding.sharded_param import ShardedParameter

pytestmark = pytest.mark.usefixtures("group")


class _Probe(torch.autograd.Function):
    """Identity whose backward calls ``fn`` (a look at the runtime at that point of the backward)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


class Single(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, y):
        return torch.tanh(self.fc(x)) * y


class Net(nn.Module):
    """``x0`` feeds a side branch computed before unit ``a`` (so its backward runs after ``a``'s), ``a`` and, with
    ``a``'s output, the two-input unit ``b``; a residual goes around ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.side, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.a, self.b = Single(), Pair()
        self.seen: dict[str, bool] = {}

    def freed(self, unit: nn.Module) -> bool:
        return isinstance(unit.fc._parameters["weight"], ShardedParameter)

    def forward(self, x):
        x0 = self.inp(x)
        aux = _Probe.apply(
            self.side(x0), lambda: self.seen.setdefault("a freed before side's backward", self.freed(self.a))
        )
        h = self.a(x0)
        h = _Probe.apply(h, lambda: self.seen.setdefault("b freed before a's backward", self.freed(self.b)))
        h = h + self.b(h, x0)
        return self.head(h).sum() + aux.sum()


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_units_are_freed_when_their_own_backward_ends_and_the_step_is_adamw(micro_batches):
    """With 2 micro-batches per step the first only accumulates (``require_grad_sync = False``: Lightning's
    ``accumulate_grad_batches``, DDP's ``no_sync``) and frees each unit when its backward is over, as a synchronised
    one does: its weights are not needed by the reduction (the gradient buffers are). Once every unit stayed gathered
    to the end of such a backward: the whole model at once, on every micro-batch but the last. The step is AdamW's on
    the summed gradients of an unsharded copy."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    engine = ZeroEngine(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), ZeroConfig(stage=3, wrap_policy=(Single, Pair))
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs = torch.randn(micro_batches, 4, 8)
    for _ in range(2):
        for micro, x in enumerate(xs):
            model.seen.clear()
            engine.require_grad_sync = micro == micro_batches - 1
            engine.begin_step()
            model(x).backward()
            engine.finish_backward()
            # a (one input: the hooked view) is freed before the side branch's backward, though x0's gradient is
            # complete only after it; b (two inputs: _PostBackward) before a's backward, though a residual uses its
            # input too
            assert model.seen == {"a freed before side's backward": True, "b freed before a's backward": True}, micro
            assert model.freed(model.a) and model.freed(model.b)
            ref(x).backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        engine.after_step()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    with gathered_parameters(model):
        got = {k: v.detach().clone() for k, v in model.named_parameters()}
    for k, v in ref.named_parameters():
        torch.testing.assert_close(got[k], v.detach(), rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    engine.remove_hooks()


class Chain(nn.Module):
    """Three one-input units in a row, then a head in the root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
        self.blocks = nn.Sequential(Single(), Single(), Single())

    def forward(self, x):
        return self.head(self.blocks(self.inp(x))).sum()


def _freed(model: Chain) -> list[bool]:
    return [isinstance(b.fc._parameters["weight"], ShardedParameter) for b in model.blocks]


def test_the_last_unit_stays_gathered_into_the_backward_that_starts_with_it():
    torch.manual_seed(0)
    model = Chain()
    ref = copy.deepcopy(model)
    # one unit per all-gather (prefetch_bucket_size=0): the counts below are per unit
    config = ZeroConfig(stage=3, wrap_policy=Single, prefetch_bucket_size=0)
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    after_forward, gathers = [], []
    for _ in range(3):
        engine.begin_step()
        loss = model(x)
        after_forward.append(_freed(model))
        loss.backward()
        engine.finish_backward()
        assert _freed(model) == [True, True, True]  # its own backward freed it
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        engine.after_step()
        gathers.append(engine.comm_stats()["last_step"]["all_gather"]["calls"])
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    # the first step records the forward order; from the second on the last block is not freed after its forward,
    # and backward does not gather it again: root once + 3 forward + 2 backward all-gathers, against 7
    assert after_forward == [[True, True, True], [True, True, False], [True, True, False]]
    assert gathers == [7, 6, 6]
    with gathered_parameters(model):
        got = {k: v.detach().clone() for k, v in model.named_parameters()}
    for k, v in ref.named_parameters():
        torch.testing.assert_close(got[k], v.detach(), rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")

    # not kept: a forward outside a step, a step without backward once it ends, and with keep_last off
    model(x)
    assert _freed(model) == [True, True, True]
    engine.begin_step()
    model(x)
    assert _freed(model) == [True, True, False]
    engine.end_eval_step()
    assert _freed(model) == [True, True, True]
    engine.after_step()  # closes the comm stats' step: the next one counts one step's all-gathers
    engine.sharded.keep_last = False
    engine.begin_step()
    model(x).backward()
    engine.finish_backward()
    engine.after_step()
    assert gathers[-1] + 1 == engine.comm_stats()["last_step"]["all_gather"]["calls"] == 7
    engine.remove_hooks()


class Checkpointed(Chain):
    """The chain with every block recomputed in backward (activation checkpointing, non-reentrant)."""

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.head(h).sum()


@pytest.mark.parametrize("bucket", [0, None])
def test_a_recomputation_in_backward_gathers_no_more_than_a_plain_backward(bucket):
    """A block recomputed in backward is already gathered for its backward; its forward hooks must not prefetch the
    next unit of the forward order (whose backward is over: it would be gathered again and stay so)."""
    gathers, held = {}, {}
    for cls in (Chain, Checkpointed):
        torch.manual_seed(0)
        model = cls()
        config = ZeroConfig(stage=3, wrap_policy=Single, prefetch_bucket_size=bucket)
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
        x = torch.randn(4, 8)
        for _ in range(3):
            engine.begin_step()
            model(x).backward()
            held[cls] = [u.is_gathered for u in engine.sharded.units[1:]]  # before the step's end frees every unit
            engine.finish_backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad(set_to_none=True)
            engine.after_step()
        gathers[cls] = engine.comm_stats()["last_step"]["all_gather"]["calls"]
        engine.remove_hooks()
    assert gathers[Checkpointed] == gathers[Chain], gathers
    assert held[Checkpointed] == held[Chain] == [False, False, False], held

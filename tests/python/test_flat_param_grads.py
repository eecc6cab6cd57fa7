"""FlatParam's gradient buffers and stage 3's packed shards (issue 22), single process.

The first gradient of a parameter is copied into the full gradient buffer, later ones are added: the buffer is never
zero-filled as a whole, so these tests make every fresh allocation NaN (torch's deterministic fill, which reaches the
C++ core's allocations too) and check that
what a reduction reads is exactly the sum of the gradients, zeros in the padding and where no gradient came. A fresh
gradient shard goes to the reduction to be overwritten. A unit's shards are packed back to back, then the gather tag's
slot; the values, and the master where it aliases the shard, move with them. A reduction group (stage 3: one unit's
flat parameters) is one reduce-scatter whose shards equal plain autograd's gradients, in a create_graph backward too.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from zeroshard.sharding.flat_param import FlatParam
from zeroshard.sharding.grad_reducer import GradReducer
from zeroshard.sharding.sharded_units import Unit, pack_shards

SHAPES = [(3, 5), (7,), (2, 2)]  # 15 + 7 + 4 elements: padding between and after them at align 4, world 2


@pytest.fixture
def nan_empty():
    """Every uninitialised allocation, Python's and the C++ core's (``at::empty`` in ``_C.GradBuffer``), is NaN, so an
    element read before it is written shows: torch's deterministic mode fills new memory."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill


def test_nan_empty_poisons_the_cores_allocations(nan_empty):
    fp = _flat()
    fp.accumulate_grad(1, torch.ones(SHAPES[1]))  # allocates the buffer in C++; parameter 0's view is unwritten
    assert torch.isnan(fp.full_grad[fp.layout.offsets[0]])


def _flat(seed: int = 0, **kwargs) -> FlatParam:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    options = dict(rank=0, world_size=2, align_elems=4, master_device=torch.device("cpu"))
    options.update(kwargs)
    return FlatParam([f"p{i}" for i in range(len(params))], params, **options)


def _expected(fp: FlatParam, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The flat buffer a reduction must read: each gradient at its offset, zeros elsewhere (float64 reference)."""
    out = torch.zeros(fp.layout.padded_numel, dtype=torch.float64)
    for off, g in zip(fp.layout.offsets, grads):
        if g is not None:
            out[off : off + g.numel()] = g.reshape(-1).double()
    return out


def test_first_gradient_is_copied_later_ones_added_the_rest_reads_zero(nan_empty):
    fp = _flat()
    assert fp.layout.padded_numel > sum(fp.layout.numels)  # there is padding to check
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(s, generator=g) for s in (SHAPES[0], SHAPES[1], SHAPES[0]))
    with torch.no_grad():
        fp.accumulate_grad(0, a)
        fp.accumulate_grad(1, b)
        fp.accumulate_grad(0, c)
    fp.full_grad_views()  # what the reducer calls before it reads the buffer
    assert torch.equal(fp.full_grad.double(), _expected(fp, [a + c, b, None]))

    fp.reset_full_grad()  # stage 1 after a reduction: reads as zeros, the next gradient is copied over the old sum
    d = torch.randn(SHAPES[1], generator=g)
    with torch.no_grad():
        fp.accumulate_grad(1, d)
    views = fp.full_grad_views()
    assert torch.equal(views[0], torch.zeros(SHAPES[0]))
    assert torch.equal(views[1], d)
    assert torch.equal(fp.full_grad.double(), _expected(fp, [None, d, None]))

    fp.free_full_grad()  # stages 2-3 after a reduction: a fresh buffer next time, every parameter unwritten again
    with torch.no_grad():
        fp.accumulate_grad(2, torch.ones(SHAPES[2]))
    fp.full_grad_views()
    assert torch.equal(fp.full_grad.double(), _expected(fp, [None, None, torch.ones(SHAPES[2])]))


def test_full_grad_views_read_zeros_before_any_gradient(nan_empty):
    fp = _flat()
    views = fp.full_grad_views()  # a reader (ModuleGrads' local values) before the first gradient
    assert all(torch.equal(v, torch.zeros(s)) for v, s in zip(views, SHAPES))
    assert torch.equal(fp.full_grad, torch.zeros(fp.layout.padded_numel))


def test_fresh_gradient_shard_is_overwritten_a_kept_one_accumulates(nan_empty):
    fp = _flat()
    shard, accumulate = fp.grad_shard_for_reduction()
    assert not accumulate and shard.numel() == fp.layout.shard_numel and shard.dtype == torch.float32
    again, accumulate = fp.grad_shard_for_reduction()  # a second reduction before the step (no consume)
    assert accumulate and again is shard and fp.grad_shard is shard
    fp.release_grad_shard()
    fresh, accumulate = fp.grad_shard_for_reduction()
    assert not accumulate and fresh is not shard


def test_reduction_groups_must_cover_the_flat_parameters_in_order():
    fps = [_flat(0), _flat(1)]
    stub = types.SimpleNamespace(world_size=2)
    GradReducer(fps, stub, stage=3, max_inflight=2, groups=[[0, 1]]).remove_hooks()
    for bad in ([[1, 0]], [[0]], [[0], [1], [1]]):
        with pytest.raises(ValueError, match="must list the flat parameters 0..1 in order"):
            GradReducer(fps, stub, stage=3, max_inflight=2, groups=bad)


def _unit(fps: list[FlatParam]) -> Unit:
    return Unit("blocks.0", nn.Module(), fps, is_root=False)


@pytest.mark.parametrize("rank", [0, 1])
def test_pack_shards_puts_a_units_shards_and_tag_back_to_back(rank):
    fps = [_flat(0, rank=rank, keep_full=False), _flat(1, rank=rank, keep_full=False)]
    before = [fp.shard.clone() for fp in fps]
    masters = [fp.master for fp in fps]
    assert all(fp.master_aliases_shard for fp in fps)
    unit = _unit(fps)
    pack_shards(unit, 4)
    row = fps[0].shard
    for fp, old, master in zip(fps, before, masters):
        assert torch.equal(fp.shard, old)
        assert fp.shard.untyped_storage().data_ptr() == row.untyped_storage().data_ptr()
        assert fp.master is master and fp.master.data_ptr() == fp.shard.data_ptr()  # the optimizer's parameter
    assert fps[1].shard.data_ptr() == fps[0].shard.data_ptr() + fps[0].shard.nbytes
    assert unit.tag_slot.numel() == 4
    assert unit.tag_slot.data_ptr() == fps[1].shard.data_ptr() + fps[1].shard.nbytes
    fps[0].master.data.add_(1.0)  # an optimizer step on the master lands in the packed shard
    assert torch.equal(fps[0].shard, before[0] + 1.0)


def test_pack_shards_leaves_what_it_cannot_pack():
    one = _flat(0, keep_full=False)
    pack_shards(_unit([one]), 0)  # one shard and no tag: nothing to pack
    assert one.shard.untyped_storage().nbytes() == one.shard.nbytes
    mixed = [_flat(0, keep_full=False), _flat(1, keep_full=False, compute_dtype=torch.bfloat16)]
    unit = _unit(mixed)
    pack_shards(unit, 4)  # two dtypes cannot share a row
    assert unit.tag_slot is None
    assert all(fp.shard.untyped_storage().nbytes() == fp.shard.nbytes for fp in mixed)
    kept = [_flat(0), _flat(1)]  # stages 1-2: the shard is a view of the kept full buffer
    with pytest.raises(RuntimeError, match="only a stage-3 device shard"):
        kept[0].move_shard(torch.empty_like(kept[0].shard))
    pack_shards(_unit(kept), 4)
    assert all(fp.shard.data_ptr() == fp.full.data_ptr() for fp in kept)


class _OneRank:
    """The collectives GradReducer needs, for one rank: a reduce-scatter is ``shard (+)= scale * full``."""

    world_size, rank = 1, 0

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def reduce_scatter(self, fulls, shards, bucket, scale, accumulate):
        self.calls.append((len(fulls), accumulate))
        for full, shard in zip(fulls, shards):
            shard.copy_(shard + scale * full if accumulate else scale * full)
        return types.SimpleNamespace(wait=lambda: None)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's own advice
@pytest.mark.parametrize("create_graph", [False, True])
def test_a_group_is_one_reduction_of_its_flat_parameters_gradients(create_graph):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    reference = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    reference.load_state_dict(model.state_dict())
    weights = [model[0].weight, model[2].weight]
    biases = [model[0].bias, model[2].bias]
    opts = dict(rank=0, world_size=1, align_elems=4, master_device=torch.device("cpu"))
    fps = [FlatParam(["w0", "w2"], weights, **opts), FlatParam(["b0", "b2"], biases, **opts)]
    stub = _OneRank()
    reducer = GradReducer(fps, stub, stage=1, max_inflight=2, groups=[[0, 1]])
    x = torch.randn(5, 4)
    for n in (1, 2):  # a second backward before any step adds to the reduced shards
        model(x).square().sum().backward(create_graph=create_graph)
        reducer.finish_backward()
        reference(x).square().sum().backward()
        assert stub.calls == [(2, False), (2, True)][:n]  # one reduce-scatter of both, the first one fresh
        for fp, names in zip(fps, (("0.weight", "2.weight"), ("0.bias", "2.bias"))):
            want = torch.cat([reference.get_parameter(name).grad.reshape(-1) for name in names])
            got = torch.cat([fp.grad_shard[off : off + m] for off, m in zip(fp.layout.offsets, fp.layout.numels)])
            torch.testing.assert_close(got, want)
            assert not fp.full_grad.requires_grad and not fp.grad_shard.requires_grad
            assert all(p.grad is None for p in fp.params)
    reducer.remove_hooks()


class _LaunchFailed(RuntimeError):
    pass


def test_an_error_launching_a_reduction_reaches_backwards_caller_unchanged():
    """The hooks run in C++ (``_C.GradHooks``); a Python error raised in their callback (a reduction that fails to
    launch, a CollectiveError) ends the backward as the same exception, not as a RuntimeError naming it."""
    model = nn.Linear(3, 2)
    fp = FlatParam(
        ["w", "b"], [model.weight, model.bias], rank=0, world_size=1, align_elems=4, master_device=torch.device("cpu")
    )

    class Failing(_OneRank):
        def reduce_scatter(self, *args):
            raise _LaunchFailed("the reduce-scatter could not start")

    reducer = GradReducer([fp], Failing(), stage=2, max_inflight=2)
    with pytest.raises(_LaunchFailed, match="could not start"):
        model(torch.randn(4, 3)).sum().backward()
    reducer.remove_hooks()


def test_removed_hooks_leave_gradients_in_grad_and_a_dropped_reducer_unhooks():
    model = nn.Linear(3, 2)
    fp = FlatParam(
        ["w", "b"], [model.weight, model.bias], rank=0, world_size=1, align_elems=4, master_device=torch.device("cpu")
    )
    reducer = GradReducer([fp], _OneRank(), stage=2, max_inflight=2)
    model(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad is None and fp.grad_shard.abs().sum() > 0  # taken by the hooks, reduced
    reducer.remove_hooks()
    model(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad is not None  # plain autograd again
    model.weight.grad = None
    GradReducer([fp], _OneRank(), stage=2, max_inflight=2)  # not kept: collected at once, its hooks go with it
    model(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad is not None

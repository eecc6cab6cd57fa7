"""CPUAdam never steps stale tensors (issue 18, case 12): a parameter's storage, dtype or state tensors replaced
behind the same objects between steps are stepped as ``torch.optim.AdamW`` steps them, or refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from zeroshard.optim.cpu_adam import CPUAdam

LR, WD = 1e-2, 0.01
TOL = dict(rtol=1e-6, atol=1e-7)


def _pair(seed: int = 0):
    """A two-layer model and an identical copy; CPUAdam on the first, torch's AdamW on the copy, one group per
    layer (so errors can name group 1)."""
    torch.manual_seed(seed)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
    theirs = copy.deepcopy(ours)

    def groups(m):
        return [{"params": list(m[0].parameters())}, {"params": list(m[1].parameters())}]

    return ours, theirs, CPUAdam(groups(ours), lr=LR, weight_decay=WD), torch.optim.AdamW(groups(theirs), lr=LR,
                                                                                           weight_decay=WD)  # fmt: skip


def _grads(ours, theirs, gen):
    """The same gradient for both, in each parameter's dtype (theirs gets our values, upcast if ours are bf16)."""
    for p, q in zip(ours.parameters(), theirs.parameters()):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad, q.grad = g, g.to(q.dtype)


def _assert_same(ours, theirs, a, b):
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)
        sa, sb = a.state[p], b.state[q]
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], **TOL)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], **TOL)
        assert sa["step"] == sb["step"].item()


def _replace(kind: str, p: torch.nn.Parameter, new: torch.Tensor) -> None:
    if kind == "data":
        p.data = new
    elif kind == "swap":  # what module._apply does under torch.__future__.set_swap_module_params_on_conversion
        torch.utils.swap_tensors(p, torch.nn.Parameter(new))
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["data", "swap", "_apply"])
def test_param_storage_replaced_between_steps_is_stepped_like_adamw(kind):
    ours, theirs, a, b = _pair()
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        if step == 3:
            if kind == "_apply":  # module.to / .float / .cuda all go through _apply: a new tensor per parameter
                ours._apply(lambda t: t * 2)
                theirs._apply(lambda t: t * 2)
            else:
                for p, q in zip(ours.parameters(), theirs.parameters()):
                    new = torch.randn(p.shape, generator=gen)
                    _replace(kind, p, new)
                    _replace(kind, q, new.clone())
        _grads(ours, theirs, gen)
        before = [p.detach().clone() for p in ours.parameters()]
        a.step()
        b.step()
        assert all(not torch.equal(x, p.detach()) for x, p in zip(before, ours.parameters())), step  # no no-op
        _assert_same(ours, theirs, a, b)


def _within_one_bf16_ulp(actual, expected):
    diff = (actual.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert int(diff.max()) <= 1, f"max difference {int(diff.max())} bf16 ulps"


@pytest.mark.parametrize("swap", [False, True], ids=["set_data", "swap_tensors"])
def test_module_bfloat16_between_steps_steps_the_bf16_weights(swap):
    """After ``model.bfloat16()`` CPUAdam steps the bf16 weights with its fp32 moments (its documented bf16 mode):
    torch's AdamW stepping an fp32 copy of the bf16 values with the same moments, rounded once."""
    ours, theirs, a, b = _pair()
    gen = torch.Generator().manual_seed(2)
    saved = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        for step in range(6):
            if step == 2:
                a.zero_grad()  # swap_tensors cannot swap a parameter that has a .grad
                ours.bfloat16()
            _grads(ours, theirs, gen)
            if step >= 2:  # the reference starts each step from our rounded weights
                for p, q in zip(ours.parameters(), theirs.parameters()):
                    q.data.copy_(p.detach())
            before = [p.detach().clone() for p in ours.parameters()]
            a.step()
            b.step()
            for p, q, x in zip(ours.parameters(), theirs.parameters(), before):
                if step < 2:
                    torch.testing.assert_close(p.detach(), q.detach(), **TOL)
                    continue
                assert p.dtype == torch.bfloat16 and a.state[p]["exp_avg"].dtype == torch.float32
                assert not torch.equal(p.detach(), x), step
                _within_one_bf16_ulp(p.detach(), q.detach().bfloat16())
                torch.testing.assert_close(a.state[p]["exp_avg"], b.state[q]["exp_avg"], **TOL)
                torch.testing.assert_close(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"], **TOL)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(saved)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_unsupported_dtype_conversion_is_refused_by_name_and_modifies_nothing(dtype):
    """``.to(torch.float64)`` of one layer: the step raises naming the group, position, shape and dtype and the fix,
    writes nothing (group 0 included), and after ``.float()`` training goes on exactly like AdamW's."""
    ours, theirs, a, b = _pair()
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        _grads(ours, theirs, gen)
        a.step()
        b.step()
    ours[1].to(dtype)
    _grads(ours, theirs, gen)
    before = copy.deepcopy(a.state_dict()), [p.detach().clone() for p in ours.parameters()]
    name = str(dtype).replace(".", r"\.")
    with pytest.raises(
        ValueError, match=rf"CPUAdam param 0 of group 1 \(shape \[3, 6\]\) has dtype {name}.*\.float\(\)"
    ):
        a.step()
    assert all(torch.equal(x, p.detach()) for x, p in zip(before[1], ours.parameters()))
    after = a.state_dict()
    for k, st in before[0]["state"].items():
        assert all(torch.equal(v, after["state"][k][key]) for key, v in st.items())
    ours.float()  # fp32 -> fp64 -> fp32 is exact; fp16 rounds, so the reference takes the same values
    for p, q in zip(ours.parameters(), theirs.parameters()):
        q.data.copy_(p.detach())
    for _ in range(2):
        _grads(ours, theirs, gen)
        a.step()
        b.step()
        _assert_same(ours, theirs, a, b)


def test_replaced_state_tensors_are_used_like_adamw():
    """``opt.state[p]["exp_avg"] = t`` (and ``exp_avg_sq``) is what the next step reads and updates, as in torch."""
    ours, theirs, a, b = _pair()
    gen = torch.Generator().manual_seed(4)
    for step in range(5):
        if step == 2:
            for p, q in zip(ours.parameters(), theirs.parameters()):
                m, v = torch.randn(p.shape, generator=gen), torch.rand(p.shape, generator=gen)
                a.state[p]["exp_avg"], a.state[p]["exp_avg_sq"] = m, v
                b.state[q]["exp_avg"], b.state[q]["exp_avg_sq"] = m.clone(), v.clone()
        if step == 3:  # the storage behind the same state tensor
            p, q = next(ours.parameters()), next(theirs.parameters())
            m = torch.randn(p.shape, generator=gen)
            a.state[p]["exp_avg"].data = m
            b.state[q]["exp_avg"].data = m.clone()
        _grads(ours, theirs, gen)
        a.step()
        b.step()
        _assert_same(ours, theirs, a, b)


def _bf16_moment(st):
    st["exp_avg"] = st["exp_avg"].bfloat16()


def _oversized_moment(st):
    st["exp_avg_sq"].data = torch.zeros(st["exp_avg_sq"].numel() + 5)


def _deleted_moment(st):
    del st["exp_avg"]


BAD_STATE = {
    "bf16-exp_avg": (_bf16_moment, r"state\['exp_avg'\] of CPUAdam param 1 of group 1 \(shape \[3\].*t\.float\(\)"),
    "oversized-exp_avg_sq": (
        _oversized_moment,
        r"state\['exp_avg_sq'\] of CPUAdam param 1 of group 1 .*8 elements.*has 3.*del optimizer\.state\[param\]",
    ),
    "deleted-exp_avg": (_deleted_moment, r"CPUAdam param 1 of group 1 \(shape \[3\].*lacks step, exp_avg"),
}


@pytest.mark.parametrize("case", list(BAD_STATE))
def test_bad_replaced_state_is_refused_by_name_and_modifies_nothing(case):
    mutate, match = BAD_STATE[case]
    ours, theirs, a, b = _pair()
    gen = torch.Generator().manual_seed(5)
    _grads(ours, theirs, gen)
    a.step()
    bias = ours[1].bias
    mutate(a.state[bias])
    _grads(ours, theirs, gen)
    before = [p.detach().clone() for p in ours.parameters()]
    with pytest.raises(ValueError, match=match):
        a.step()
    assert all(torch.equal(x, p.detach()) for x, p in zip(before, ours.parameters()))


def test_param_of_another_size_is_refused_by_name():
    ours, theirs, a, b = _pair()
    gen = torch.Generator().manual_seed(6)
    _grads(ours, theirs, gen)
    a.step()
    ours[0].weight.data = torch.randn(4, 8)
    for p in ours.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    with pytest.raises(
        ValueError, match=r"exp_avg'\] of CPUAdam param 0 of group 0 \(shape \[4, 8\].*48 elements.*has 32.*restart"
    ):
        a.step()


def test_noop_conversions_and_in_place_updates_keep_the_plan():
    """``module.to()`` to what it already is returns the same storages: no rebuild, and the step matches AdamW.
    In-place writes to weights or moments need none either."""
    ours, theirs, a, b = _pair()
    gen = torch.Generator().manual_seed(7)
    _grads(ours, theirs, gen)
    a.step()
    b.step()
    plans = dict(a._plans)
    for step in range(4):
        ours.to(torch.float32)
        ours.to("cpu")
        ours.float()
        ours.train()
        if step == 1:
            with torch.no_grad():
                for p, q in zip(ours.parameters(), theirs.parameters()):
                    p.mul_(0.5)
                    q.mul_(0.5)
                    a.state[p]["exp_avg"].add_(0.25)
                    b.state[q]["exp_avg"].add_(0.25)
        _grads(ours, theirs, gen)
        a.step()
        b.step()
        assert all(a._plans[gi] is plan for gi, plan in plans.items()), step
        _assert_same(ours, theirs, a, b)


def test_load_state_dict_after_replaced_storage_resumes_like_adamw():
    ours, theirs, a, b = _pair()
    gen = torch.Generator().manual_seed(8)
    for step in range(6):
        if step == 2:
            for p, q in zip(ours.parameters(), theirs.parameters()):
                new = torch.randn(p.shape, generator=gen)
                p.data, q.data = new, new.clone()
        if step == 4:  # a round trip through the saved form, then into a fresh CPUAdam over the same model
            sd = copy.deepcopy(a.state_dict())
            a = CPUAdam([{"params": list(ours[0].parameters())}, {"params": list(ours[1].parameters())}], lr=LR,
                        weight_decay=WD)  # fmt: skip
            a.load_state_dict(sd)
        _grads(ours, theirs, gen)
        a.step()
        b.step()
        _assert_same(ours, theirs, a, b)

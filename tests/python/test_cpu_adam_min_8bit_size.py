"""CPUAdam(state_dtype="int8", min_8bit_size=...): bitsandbytes' rule that a tensor of fewer than ``min_8bit_size``
elements (default 4096) keeps fp32 moments (``Optimizer2State.init_state``, ``bitsandbytes/optim/optimizer.py``).

References: fp32-state ``CPUAdam`` for the small tensors and int8 ``CPUAdam`` with ``min_8bit_size=0`` for the large,
each stepped alone on copies: one optimizer holding both formats must give the same bits.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zeroshard.optim.cpu_adam import CPUAdam
from zeroshard.optim.state_format import MIN_8BIT_SIZE, format_of, moments_fp32

SHAPES = [(64, 80), (64,), (4095,), (4096,), (3, 2048), (7,)]  # 5120, 64, 4095 | 4096, 6144 | 7 elements
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)

    def grad(s):
        return torch.randn(s, generator=gen) * (1 + 5 * torch.rand(s, generator=gen))

    return [[grad(s) for s in SHAPES] for _ in range(steps)]


def test_default_is_bitsandbytes_4096():
    assert MIN_8BIT_SIZE == 4096
    assert CPUAdam([torch.nn.Parameter(torch.zeros(3))], state_dtype="int8").min_8bit_size == 4096


def test_small_tensors_keep_fp32_state_bitwise_equal_to_separate_optimizers():
    params = _params()
    # two param groups, each mixing small and large tensors
    opt = CPUAdam([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}], **HYPER, state_dtype="int8")
    small = [i for i, s in enumerate(SHAPES) if torch.Size(s).numel() < 4096]
    assert small == [1, 2, 5]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    wd = [HYPER["weight_decay"]] * 3 + [0.0] * 3
    refs = {}
    for i, q in enumerate(ref):
        kw = {**HYPER, "weight_decay": wd[i]}
        refs[i] = CPUAdam([q], **kw) if i in small else CPUAdam([q], **kw, state_dtype="int8", min_8bit_size=0)
    for grads in _grads(15):
        opt.step(grads=dict(zip(params, grads)))
        for i, g in enumerate(grads):
            refs[i].step(grads={ref[i]: g})
    for i, (p, q) in enumerate(zip(params, ref)):
        st, rst = opt.state[p], refs[i].state[q]
        assert format_of(st) == (torch.float32 if i in small else "int8"), i
        assert torch.equal(p, q), f"param {i} {SHAPES[i]}"
        assert set(st) == set(rst) and all(torch.equal(st[k], rst[k]) for k in st if k != "step"), i


def test_min_8bit_size_zero_quantises_everything_and_other_formats_ignore_it():
    params = _params()
    opt = CPUAdam(params, state_dtype="int8", min_8bit_size=0)
    opt.step(grads={p: torch.ones_like(p) for p in params})
    assert all(format_of(opt.state[p]) == "int8" for p in params)
    opt = CPUAdam(params, state_dtype=torch.bfloat16, min_8bit_size=10**9)
    opt.step(grads={p: torch.ones_like(p) for p in params})
    assert all(format_of(opt.state[p]) == torch.bfloat16 for p in params)


def test_explicit_fp32_state_params_replace_the_size_rule():
    params = _params()
    big, tiny = params[0], params[5]
    opt = CPUAdam(params, state_dtype="int8", fp32_state_params=[big])
    opt.step(grads={p: torch.ones_like(p) for p in params})
    assert format_of(opt.state[big]) == torch.float32
    assert format_of(opt.state[tiny]) == "int8"  # below 4096 but not listed: the rule is off
    opt2 = CPUAdam(params, state_dtype="int8")
    opt2.keep_fp32_state([big])
    assert opt2.state_format(big) == torch.float32 and opt2.state_format(tiny) == "int8"
    with pytest.raises(RuntimeError, match="already holds state"):
        opt.keep_fp32_state([])


def test_layernorm_weight_state_is_fp32_under_int8():
    """The case bitsandbytes' rule is for: a model's norm weights and biases keep fp32 moments, its matrices int8."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.LayerNorm(128))
    opt = CPUAdam(model.parameters(), state_dtype="int8")
    model(torch.randn(4, 128)).square().mean().backward()
    opt.step()
    formats = {n: format_of(opt.state[p]) for n, p in model.named_parameters()}
    assert formats == {"0.weight": "int8", "0.bias": torch.float32, "1.weight": torch.float32, "1.bias": torch.float32}
    assert "exp_avg_absmax" not in opt.state[model[1].weight]


def test_mixed_state_dict_round_trip_resumes_bitwise_and_converts_per_parameter():
    params = _params()
    opt = CPUAdam(params, **HYPER, state_dtype="int8")
    grads = _grads(6)
    for g in grads[:3]:
        opt.step(grads=dict(zip(params, g)))
    sd = opt.state_dict()
    assert [format_of(sd["state"][i]) for i in range(len(SHAPES))] == [
        "int8", torch.float32, torch.float32, "int8", "int8", torch.float32]  # fmt: skip
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = CPUAdam(clone, **HYPER, state_dtype="int8")
    opt2.load_state_dict(copy.deepcopy(sd))  # torch's load keeps fp32 moments as they are: no sharing with `opt`
    for g in grads[3:]:
        opt.step(grads=dict(zip(params, g)))
        opt2.step(grads=dict(zip(clone, g)))
    assert all(torch.equal(p, q) for p, q in zip(params, clone))
    # an all-int8 state (min_8bit_size=0) loads into the default rule: the small tensors' moments become fp32, exactly
    opt0 = CPUAdam([torch.nn.Parameter(p.detach().clone()) for p in params], state_dtype="int8", min_8bit_size=0)
    opt0.step(grads={p: torch.ones_like(p) for p in opt0.param_groups[0]["params"]})
    opt3 = CPUAdam([torch.nn.Parameter(p.detach().clone()) for p in params], state_dtype="int8")
    opt3.load_state_dict(opt0.state_dict())
    got = [format_of(st) for st in opt3.state_dict()["state"].values()]
    assert got == ["int8", torch.float32, torch.float32, "int8", "int8", torch.float32]
    p1 = opt3.param_groups[0]["params"][1]
    m, v = moments_fp32(opt0.state[opt0.param_groups[0]["params"][1]])
    assert torch.equal(opt3.state[p1]["exp_avg"], m) and torch.equal(opt3.state[p1]["exp_avg_sq"], v)


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", True])
def test_bad_min_8bit_size_fails_at_construction(bad):
    with pytest.raises(ValueError, match=r"min_8bit_size=.*int >= 0"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], state_dtype="int8", min_8bit_size=bad)


def test_wrong_format_state_is_refused_naming_the_rule():
    p = torch.nn.Parameter(torch.zeros(10))
    opt = CPUAdam([p], state_dtype="int8")
    codes = {k: torch.zeros(10, dtype=torch.uint8) for k in ("exp_avg", "exp_avg_sq")}
    opt.state[p] = {"step": 0, **codes, "exp_avg_absmax": torch.zeros(1), "exp_avg_sq_absmax": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"min_8bit_size"):
        opt.step(grads={p: torch.ones(10)})

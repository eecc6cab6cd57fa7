"""``DeviceAdam`` / ``adam_step_torch``: the fused CPU Adam's step in torch ops, for master shards on the GPU.

On CPU tensors (the same code runs on CUDA; the ``gpu`` tests repeat the comparison there when a GPU exists):

* bit for bit against ``zeroshard.ops.adam_step`` / ``CPUAdam(state_dtype=...)`` over 20 steps, for fp32, bf16 and
  int8 moments, 3 sizes (one short block, a tail block, several blocks and a tail), Adam (L2) and AdamW (decoupled)
  with weight decay, with and without bias correction, both branches of torch's lerp, bf16 gradients;
* against the independent pure-torch references of ``test_cpu_adam_state_formats`` (their own dynamic map, exact fp32
  arithmetic in float64) bit for bit, and against ``torch.optim.AdamW`` / ``Adam`` to 1e-6;
* NaN / inf: fp32 and bf16 moments poison the element only, as torch's AdamW does; an int8 block goes NaN, as the
  kernel's does;
* states are interchangeable: CPUAdam's state loaded into DeviceAdam (and back) continues bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_adam_state_formats import (
    BETAS,
    EPS,
    LR,
    WD,
    check_int8_against_reference,
)

from zeroshard import ops
from zeroshard.optim.cpu_adam import CPUAdam
from zeroshard.optim.device_adam import DeviceAdam
from zeroshard.optim.state_format import new_moments, quantize_state
from zeroshard.optim.torch_state_step import adam_step_torch, fma32, quantize_blocks

SIZES = [5, 2049, 3 * 2048 + 777]
FORMATS = [torch.float32, torch.bfloat16, "int8"]
HYPER = {
    "adamw": dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, adamw_mode=True, bias_correction=True),
    "adam_l2": dict(beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.05, adamw_mode=False, bias_correction=True),
    "no_bias_correction": dict(
        beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=0.0, adamw_mode=True, bias_correction=False
    ),  # fmt: skip
    "lerp_large_weight": dict(beta1=0.3, beta2=0.9, eps=0.0, weight_decay=0.1, adamw_mode=True, bias_correction=True),
}


def assert_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """The same bits, element for element; a NaN equals any NaN (CUDA writes 0x7FFFFFFF for every NaN it makes,
    x86 passes on its operand's, and the payload carries nothing), but only where the other is NaN too."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    both_nan = a.isnan() & b.isnan() if a.is_floating_point() else torch.zeros(a.shape, dtype=torch.bool)
    if a.is_floating_point():
        view = {2: torch.int16, 4: torch.int32}[a.element_size()]
        a, b = a.view(view), b.view(view)
    diff = ((a != b) & ~both_nan).sum().item()
    assert diff == 0, f"{what}: {diff} elements differ"


def _grads(n: int, steps: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * (1 + 10 * torch.rand(n, generator=gen))).to(dtype) for _ in range(steps)]


def test_fma32_rounds_once():
    # 1 + 2^-23 + 2^-24 - 2^-60: just below the midpoint of 1 + 2^-23 and 1 + 2^-22. Rounded in float64 first it
    # lands on the midpoint and then on the even 1 + 2^-22; one rounding gives 1 + 2^-23.
    a = torch.tensor([1 + 2**-18], dtype=torch.float32)
    b = torch.tensor([2**-24 * (1 - 2**-18)], dtype=torch.float32)
    c = torch.tensor([1 + 2**-23], dtype=torch.float32)
    assert (a.double() * b.double() + c.double()).float().item() == 1 + 2**-22  # double rounding
    assert fma32(a, b, c).item() == 1 + 2**-23
    assert fma32(-a, b, -c).item() == -(1 + 2**-23)
    assert torch.isnan(fma32(torch.tensor([float("inf")]), torch.tensor([0.0]), torch.tensor([1.0]))).all()
    assert fma32(torch.tensor([float("inf")]), torch.tensor([2.0]), torch.tensor([1.0])).item() == float("inf")


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_blocks_equals_quantize_state(signed):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3 * 2048 + 5, generator=gen) * torch.logspace(-8, 2, 3 * 2048 + 5)
    if not signed:
        x = x.abs()
    x[2048 + 7] = float("nan")  # the second block goes NaN, its codes 0
    x[4096:6144] = 0.0  # an all-zero block
    codes, absmax = quantize_blocks(x, signed)
    ref_codes, ref_absmax = quantize_state(x, signed=signed)
    assert_bits(codes, ref_codes, "codes")
    assert_bits(absmax, ref_absmax, "absmax")


@pytest.mark.parametrize("hyper", list(HYPER), ids=list(HYPER))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_step_equals_the_kernel_bit_for_bit_over_20_steps(n, fmt, hyper):
    h = HYPER[hyper]
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    p_k, p_t = p0.clone(), p0.clone()
    st_k, st_t = new_moments((n,), fmt), new_moments((n,), fmt)
    grad_dtype = torch.bfloat16 if hyper == "adamw" else torch.float32
    for t, g in enumerate(_grads(n, 20, seed=n + 7, dtype=grad_dtype), start=1):
        absmax = {k: st_k[k] for k in ("exp_avg_absmax", "exp_avg_sq_absmax") if k in st_k}
        ops.adam_step(p_k, g, st_k["exp_avg"], st_k["exp_avg_sq"], step=t, lr=LR, **h, **absmax)
        adam_step_torch(p_t, g, st_t, step=t, lr=LR, **h)
        assert_bits(p_t, p_k, f"param at step {t}")
        for k in st_k:
            assert_bits(st_t[k], st_k[k], f"{k} at step {t}")


@pytest.mark.parametrize("n", SIZES)
def test_int8_equals_independent_reference_over_20_steps(n):
    """The reference of test_cpu_adam_state_formats (own map, exact fp32 arithmetic in float64, AdamW)."""
    gen = torch.Generator().manual_seed(n)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = DeviceAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_dtype="int8", min_8bit_size=0)
    check_int8_against_reference(opt, p, _grads(n, 20, seed=n + 1, dtype=torch.bfloat16))


def _models(fmt, adamw=True, seed=0):
    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(40, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3))
    b = type(base)(*[torch.nn.Linear(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else m
                     for m in base])  # fmt: skip
    b.load_state_dict(base.state_dict())
    groups = lambda m: [  # noqa: E731
        {"params": [m[0].weight, m[2].weight]},
        {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0, "lr": 3e-3},
    ]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, adamw_mode=adamw, state_dtype=fmt)
    return base, CPUAdam(groups(base), **kw), b, DeviceAdam(groups(b), **kw)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 40, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_device_adam_equals_cpu_adam_and_states_interchange(fmt, adamw):
    m_cpu, o_cpu, m_dev, o_dev = _models(fmt, adamw)
    _train(m_cpu, o_cpu, 10)
    _train(m_dev, o_dev, 10)
    for a, b in zip(m_cpu.parameters(), m_dev.parameters()):
        assert_bits(b.detach(), a.detach(), "param after 10 steps")
    sd_cpu, sd_dev = o_cpu.state_dict(), o_dev.state_dict()
    for i, st in sd_cpu["state"].items():
        assert st.keys() == sd_dev["state"][i].keys()
        for k in st:
            assert_bits(sd_dev["state"][i][k], st[k], f"state {i} {k}")
    # swap the states: each continues where the other left off, bit for bit
    o_cpu.load_state_dict(sd_dev)
    o_dev.load_state_dict(sd_cpu)
    _train(m_cpu, o_cpu, 5, seed=2)
    _train(m_dev, o_dev, 5, seed=2)
    for a, b in zip(m_cpu.parameters(), m_dev.parameters()):
        assert_bits(b.detach(), a.detach(), "param after resuming from the other's state")


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_fp32_state_matches_torch_adam(adamw):
    torch.manual_seed(0)
    p = torch.randn(5000)
    a, b = torch.nn.Parameter(p.clone()), torch.nn.Parameter(p.clone())
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)([a], lr=1e-3, weight_decay=0.05, foreach=False)
    opt = DeviceAdam([b], lr=1e-3, weight_decay=0.05, adamw_mode=adamw)
    for g in _grads(5000, 20, seed=5):
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[b]["exp_avg_sq"], ref.state[a]["exp_avg_sq"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", [torch.float32, torch.bfloat16], ids=str)
def test_nonfinite_gradient_poisons_only_its_element_like_torch_adamw(fmt):
    n = 3000
    p = torch.randn(n, generator=torch.Generator().manual_seed(1))
    a, b = torch.nn.Parameter(p.clone()), torch.nn.Parameter(p.clone())
    ref = torch.optim.AdamW([a], lr=1e-3, foreach=False)
    opt = DeviceAdam([b], lr=1e-3, weight_decay=0.01, state_dtype=fmt)  # torch AdamW's default decay
    grads = _grads(n, 3, seed=2)
    grads[1][10], grads[1][2500] = float("nan"), float("inf")
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    assert torch.equal(b.detach().isnan(), a.detach().isnan())
    assert b.detach().isnan().sum() == 2  # the NaN and the inf elements, as in torch
    torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=1e-2 if fmt == torch.bfloat16 else 1e-6,
                               equal_nan=True)  # fmt: skip


def test_nonfinite_gradient_poisons_its_int8_block_like_the_kernel():
    n = 3 * 2048
    p = torch.randn(n, generator=torch.Generator().manual_seed(1))
    a, b = torch.nn.Parameter(p.clone()), torch.nn.Parameter(p.clone())
    o_cpu = CPUAdam([a], lr=1e-3, state_dtype="int8")
    o_dev = DeviceAdam([b], lr=1e-3, state_dtype="int8")
    grads = _grads(n, 3, seed=2)
    grads[1][2048 + 10] = float("inf")
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        o_cpu.step()
        o_dev.step()
    assert_bits(b.detach(), a.detach(), "param")
    nan = b.detach().isnan()
    assert nan[2048:4096].all() and not nan[:2048].any() and not nan[4096:].any()
    assert o_dev.state[b]["exp_avg_absmax"][1].isnan()


def test_int8_optimizer_steps_fp32_moments_of_a_parameter_in_fp32():
    """Per parameter, the format is read from the state's dtypes: fp32 moments stay fp32 under an int8 optimizer."""
    p = torch.nn.Parameter(torch.randn(100))
    q = torch.nn.Parameter(torch.randn(5000))
    opt = DeviceAdam([p, q], lr=1e-2, state_dtype="int8")
    opt.state[p] = {"step": 0, **new_moments(p.shape, torch.float32)}
    ref = CPUAdam([torch.nn.Parameter(p.detach().clone())], lr=1e-2)
    for g in _grads(100, 5, seed=3):
        p.grad, q.grad = g, torch.ones(5000)
        ref.param_groups[0]["params"][0].grad = g.clone()
        opt.step()
        ref.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and opt.state[q]["exp_avg"].dtype == torch.uint8
    assert_bits(p.detach(), ref.param_groups[0]["params"][0].detach(), "fp32-state parameter")


def test_bad_tensor_fails_before_anything_changes():
    p, q = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10))
    opt = DeviceAdam([p, q], lr=1e-2, state_dtype="int8")
    grads = {p: torch.ones(10), q: torch.ones(10, dtype=torch.float64)}
    before = p.detach().clone()
    with pytest.raises(ValueError, match="param 1 of group 0.*grad has dtype torch.float64"):
        opt.step(grads=grads)
    assert torch.equal(p.detach(), before) and not opt.state


def _compiled_equals_eager(fmt, device, n=5000, steps=3):
    h = HYPER["adam_l2"]
    p_e = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(device)
    p_c = p_e.clone()
    st_e = {k: v.to(device) for k, v in new_moments((n,), fmt).items()}
    st_c = {k: v.clone() for k, v in st_e.items()}
    for t, g in enumerate(_grads(n, steps, seed=5), start=1):
        adam_step_torch(p_e, g.to(device), st_e, step=t, lr=LR, **h)
        adam_step_torch(p_c, g.to(device), st_c, step=t, lr=LR, compile=True, **h)
    assert_bits(p_c, p_e, "param")
    for k in st_e:
        assert_bits(st_c[k], st_e[k], k)


def test_compiled_step_has_the_same_bits():
    """torch.compile of the same ops: fp32 state here (int8 compiles for about a minute on 2 cores: gpu test)."""
    _compiled_equals_eager(torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("hyper", ["adamw", "adam_l2"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_cuda_step_equals_the_kernel_bit_for_bit(fmt, hyper):
    n, h = SIZES[-1], HYPER[hyper]
    p_k = torch.randn(n, generator=torch.Generator().manual_seed(n))
    p_t = p_k.cuda()
    st_k = new_moments((n,), fmt)
    st_t = {k: v.cuda() for k, v in new_moments((n,), fmt).items()}
    for t, g in enumerate(_grads(n, 20, seed=n + 7, dtype=torch.bfloat16), start=1):
        absmax = {k: st_k[k] for k in ("exp_avg_absmax", "exp_avg_sq_absmax") if k in st_k}
        ops.adam_step(p_k, g, st_k["exp_avg"], st_k["exp_avg_sq"], step=t, lr=LR, **h, **absmax)
        adam_step_torch(p_t, g.cuda(), st_t, step=t, lr=LR, **h)
    assert_bits(p_t, p_k, "param after 20 steps")
    for k in st_k:
        assert_bits(st_t[k], st_k[k], k)


@pytest.mark.gpu
@pytest.mark.xfail(
    strict=True,
    reason="measured on an H100 (torch 2.11): the compiled int8 step differed from the eager one in 233 param "
    "elements after 3 steps, so DeviceAdam steps CUDA parameters with the CUDA kernel; if this passes, the compiled "
    "path has the same bits there too and DeviceAdam's docstring should say so",
)
def test_cuda_compiled_int8_step_has_the_same_bits():
    _compiled_equals_eager("int8", "cuda")


def test_a_kernel_that_writes_another_nan_still_agrees(monkeypatch):
    """NaN payloads are not bits that count (CUDA makes 0x7FFFFFFF, the CPU kernel passes on 0x7FC00000, as the H100
    and H200 runs showed): a kernel that rewrites every NaN it makes is trusted; one that makes a NaN where the
    reference has a number is not."""
    from zeroshard.optim import kernel_check

    monkeypatch.setattr(kernel_check, "_VERDICTS", {})
    n = 2 * 2048 + 3
    p, g = torch.randn(n), torch.randn(n)
    g[7] = float("nan")  # param[7] goes NaN (its int8 block's moments too)
    args = dict(step=1, lr=LR, **HYPER["adamw"])

    def other_nan(param, *a, **kw):
        ops.adam_step(param, *a, **kw)
        assert param.isnan().any()
        param.view(torch.int32)[param.isnan()] = 0x7FFFFFFF

    assert kernel_check.kernel_agrees(other_nan, p, g, new_moments((n,), "int8"), **args)

    def nan_too_many(param, *a, **kw):
        ops.adam_step(param, *a, **kw)
        param[-1] = float("nan")

    with pytest.warns(RuntimeWarning, match="differs from the reference step in 1 elements"):
        assert not kernel_check.kernel_agrees(nan_too_many, p, g.bfloat16(), new_moments((n,), "int8"), **args)


def test_new_state_follows_the_min_8bit_size_rule_like_cpu_adam():
    """Fresh state under int8: fp32 moments below ``min_8bit_size`` (bitsandbytes' rule), as CPUAdam keeps them."""
    small, large = torch.nn.Parameter(torch.randn(4095)), torch.nn.Parameter(torch.randn(4096))
    opt = DeviceAdam([small, large], lr=1e-2, state_dtype="int8")
    small.grad, large.grad = torch.ones(4095), torch.ones(4096)
    opt.step()
    assert opt.state[small]["exp_avg"].dtype == torch.float32 and "exp_avg_absmax" not in opt.state[small]
    assert opt.state[large]["exp_avg"].dtype == torch.uint8


def test_a_native_kernel_is_trusted_only_after_it_agrees(monkeypatch):
    """kernel_agrees (DeviceAdam's gate for the CUDA kernel), run here with the CPU kernel: the real one agrees;
    one that is off by one ulp in the param is refused with a warning, once; nothing is modified either way."""
    from zeroshard.optim import kernel_check

    monkeypatch.setattr(kernel_check, "_VERDICTS", {})
    n = 3 * 2048 + 777
    p, g = torch.randn(n), torch.randn(n)
    st = new_moments((n,), "int8")
    before = [p.clone(), *(v.clone() for v in st.values())]
    args = dict(step=1, lr=LR, **HYPER["adamw"])
    assert kernel_check.kernel_agrees(ops.adam_step, p, g, st, **args)

    def off_by_one_ulp(param, *a, **kw):
        ops.adam_step(param, *a, **kw)
        param.copy_(torch.nextafter(param, torch.full_like(param, float("inf"))))

    g16 = g.bfloat16()  # another combination (grad dtype), so a fresh verdict
    with pytest.warns(RuntimeWarning, match="differs from the reference step in 6921 elements"):
        assert not kernel_check.kernel_agrees(off_by_one_ulp, p, g16, st, **args)
    assert not kernel_check.kernel_agrees(off_by_one_ulp, p, g16, st, **args)  # remembered, no second warning
    for a, b in zip([p, *st.values()], before):
        assert_bits(a, b, "unchanged")

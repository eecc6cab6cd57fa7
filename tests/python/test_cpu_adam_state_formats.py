"""CPUAdam state formats (state_dtype = torch.bfloat16 / "int8") against pure-torch references written here.

The references redo the kernel's documented operation order (zeroshard.ops.adam_step) with every fp32 operation
done in float64 and rounded to float32 after it. For +, -, *, / and sqrt that double rounding equals one fp32
rounding (float64 has more than 2 * 24 + 2 bits: Figueroa, "When is double rounding innocuous?", 1995); for the
fused multiply-adds the rounding is corrected with the exact TwoSum error at float32 midpoints. So the references
are exact fp32 arithmetic and the comparisons are bit for bit. The int8 reference builds its own dynamic map
(Dettmers et al. 2022; bitsandbytes' create_dynamic_map construction) and finds nearest codes by searchsorted on
midpoints in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from zeroshard import ops
from zeroshard.optim.cpu_adam import CPUAdam
from zeroshard.optim.state_format import moments_fp32

BLOCK = 2048
SIZES = [5, 2049, 70_001]  # one short block; a tail block; two 64Ki chunks and a tail
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


# --- exact fp32 arithmetic in float64 -------------------------------------------------------------------------------


def r(x: torch.Tensor) -> torch.Tensor:
    """Round a float64 tensor to float32 and keep it as float64."""
    return x.to(torch.float32).to(torch.float64)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add of fp32 values held in float64: a * b is exact in float64; the sum's rounding error
    (TwoSum) decides the float32 rounding where the float64 sum falls exactly on a float32 midpoint."""
    prod = a * b
    s = prod + c
    bb = s - prod
    err = (prod - (s - bb)) + (c - bb)
    midpoint = (s.view(torch.int64) & ((1 << 29) - 1)) == (1 << 28)
    toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    s = torch.where(midpoint & (err != 0), torch.nextafter(s, toward), s)
    return r(s)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def ref_update(p, g, m, v, t):
    """One AdamW step in the kernel's order (adam_kernel.h, Factors) on float64 tensors holding fp32 values."""
    b1, b2 = BETAS
    w = f32(1 - b1)
    lerp_small = abs(w) < 0.5
    coeff = w if lerp_small else f32(w - 1)
    decay_mul = f32(1 - LR * WD)
    step_size = LR / (1 - b1**t)
    inv_bc2 = f32(1 / (1 - b2**t) ** 0.5)
    p = r(p * decay_mul)
    diff = r(g - m)
    m = fma(torch.full_like(m, coeff), diff, m if lerp_small else g)
    v = fma(r(f32(1 - b2) * g), g, r(v * f32(b2)))
    denom = fma(r(torch.sqrt(v)), torch.full_like(v, inv_bc2), torch.full_like(v, f32(EPS)))
    p = r(p + r(r(f32(-step_size) * m) / denom))
    return p, m, v


# --- int8 reference: its own map, nearest code by torch ops ---------------------------------------------------------


def ref_dynamic_map(signed: bool) -> torch.Tensor:
    """Dynamic map, 7 exponent bits, 8 total: for decade i = 0..6, the means of linspace(0.1, 1, k + 1) scaled by
    10^(i - 6), k = 2^i values signed (and their negatives), 2^(i+1) unsigned; plus 0 and 1; sorted."""
    data = []
    for i in range(7):
        k = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1, k + 1)
        means = (edges[:-1] + edges[1:]) / 2.0
        data += ((10 ** (i - 6)) * means).tolist()
        if signed:
            data += (-(10 ** (i - 6)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return torch.tensor(sorted(data), dtype=torch.float32)


def ref_quantize(x: torch.Tensor, qmap: torch.Tensor):
    """x: float64 holding fp32 values (finite). Per block: absmax, codes = nearest map value (ties up); with the
    unsigned map (exp_avg_sq, qmap[0] == 0) at least code 1, so a positive second moment never reads back as 0."""
    n = x.numel()
    blocks = (n + BLOCK - 1) // BLOCK
    codes = torch.empty(n, dtype=torch.long)
    absmax = torch.empty(blocks, dtype=torch.float64)
    mids = (qmap[:-1].double() + qmap[1:].double()) / 2  # exact in float64
    for b in range(blocks):
        xb = x[b * BLOCK : (b + 1) * BLOCK]
        a = xb.abs().max()
        absmax[b] = a
        normed = r(xb / (a if a != 0 else 1.0))
        c = torch.searchsorted(mids, normed, right=True)  # count of midpoints <= x: ties to the larger code
        # the same as the argmin of the distance wherever that is unique
        dist = (normed[:, None] - qmap.double()[None, :]).abs()
        unique = (dist == dist.min(dim=1, keepdim=True).values).sum(dim=1) == 1
        assert torch.equal(c[unique], dist.argmin(dim=1)[unique])
        codes[b * BLOCK : (b + 1) * BLOCK] = c if qmap[0] < 0 else c.clamp(min=1)
    return codes, absmax


def ref_dequantize(codes, absmax, qmap):
    return r(qmap.double()[codes] * absmax.repeat_interleave(BLOCK)[: codes.numel()])


# --- tests ----------------------------------------------------------------------------------------------------------


def _grads(n: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * (1 + 10 * torch.rand(n, generator=gen))).bfloat16() for _ in range(steps)]


def test_reference_map_equals_the_kernels():
    assert torch.equal(ref_dynamic_map(True), ops.dynamic_map(True))
    assert torch.equal(ref_dynamic_map(False), ops.dynamic_map(False))


@pytest.mark.parametrize("n", SIZES)
def test_int8_state_equals_torch_reference_over_20_steps(n):
    gen = torch.Generator().manual_seed(n)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = CPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_dtype="int8", min_8bit_size=0)
    check_int8_against_reference(opt, p, _grads(n, 20, seed=n + 1))


def check_int8_against_reference(opt, p: torch.nn.Parameter, grads: list[torch.Tensor]) -> None:
    """Steps ``opt`` (an int8 optimizer over ``p`` alone, AdamW with LR, BETAS, EPS, WD) through ``grads`` and checks
    the parameter, absmax and codes after every step against this module's reference (``ref_*``: own maps, float64
    arithmetic)."""
    n = p.numel()
    smap, umap = ref_dynamic_map(True), ref_dynamic_map(False)
    rp = p.detach().double().clone()
    rmc, rvc = torch.full((n,), 127, dtype=torch.long), torch.zeros(n, dtype=torch.long)  # code of 0.0
    blocks = (n + BLOCK - 1) // BLOCK
    rma, rva = torch.zeros(blocks, dtype=torch.float64), torch.zeros(blocks, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        opt.step(grads={p: g})
        m, v = ref_dequantize(rmc, rma, smap), ref_dequantize(rvc, rva, umap)
        rp, m, v = ref_update(rp, g.double(), m, v, t)
        rmc, rma = ref_quantize(m, smap)
        rvc, rva = ref_quantize(v, umap)
        st = opt.state[p]
        assert torch.equal(p.detach(), rp.float()), f"param differs at step {t}"
        assert torch.equal(st["exp_avg_absmax"], rma.float()) and torch.equal(st["exp_avg_sq_absmax"], rva.float())
        # A zero block keeps absmax 0, where every code reads 0.0: compare codes where the scale is not 0.
        live = rma.repeat_interleave(BLOCK)[:n] != 0
        assert torch.equal(st["exp_avg"].long()[live], rmc[live]), f"exp_avg codes differ at step {t}"
        assert torch.equal(st["exp_avg_sq"].long(), rvc), f"exp_avg_sq codes differ at step {t}"
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_absmax"].shape == (blocks,)


@pytest.mark.parametrize("n", SIZES)
def test_bf16_state_equals_torch_reference_over_20_steps(n):
    gen = torch.Generator().manual_seed(n)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = CPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_dtype=torch.bfloat16)
    rp, rm, rv = p.detach().double().clone(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for t, g in enumerate(_grads(n, 20, seed=n + 2), start=1):
        opt.step(grads={p: g})
        rp, rm, rv = ref_update(rp, g.double(), rm, rv, t)
        rm, rv = rm.bfloat16().double(), rv.bfloat16().double()  # fp32 result rounded to nearest even once
        assert torch.equal(p.detach(), rp.float()), f"param differs at step {t}"
        assert torch.equal(opt.state[p]["exp_avg"], rm.bfloat16())
        assert torch.equal(opt.state[p]["exp_avg_sq"], rv.bfloat16())


def test_quantize_state_helper_matches_the_kernel():
    # beta1 = beta2 = 0 stores m = g and v = g * g exactly: the kernel's state is their quantisation.
    n = 5000
    g = torch.randn(n) * torch.exp(torch.randn(n) * 3)
    p, mq, vq = torch.randn(n), torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ma, va = torch.zeros(3), torch.zeros(3)
    ops.adam_step(p, g, mq, vq, step=1, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, adamw_mode=True,
                  bias_correction=True, exp_avg_absmax=ma, exp_avg_sq_absmax=va)  # fmt: skip
    assert all(map(torch.equal, ops.quantize_state(g, signed=True), (mq, ma)))
    assert all(map(torch.equal, ops.quantize_state(g * g, signed=False), (vq, va)))
    expected = ref_dequantize(mq.long(), ma.double(), ref_dynamic_map(True)).float()
    assert torch.equal(ops.dequantize_state(mq, ma, signed=True), expected)


def _trained(state_dtype, steps=3, n=3000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the same initial weights for every call
    model = torch.nn.Sequential(torch.nn.Linear(n // 100, 100), torch.nn.Linear(100, 3))
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01, state_dtype=state_dtype, min_8bit_size=0)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return model, opt


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_state_dict_round_trips_as_stored_and_resumes_bitwise(state_dtype):
    model, opt = _trained(state_dtype)
    sd = opt.state_dict()
    st = sd["state"][0]
    if state_dtype == "int8":
        assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_sq"].dtype == torch.uint8
        assert st["exp_avg_absmax"].dtype == torch.float32 and st["exp_avg_absmax"].numel() == 2  # 3000 elements
    else:
        assert st["exp_avg"].dtype == torch.bfloat16
    clone = torch.nn.Sequential(torch.nn.Linear(30, 100), torch.nn.Linear(100, 3))
    clone.load_state_dict(model.state_dict())
    opt2 = CPUAdam(clone.parameters(), lr=1e-2, weight_decay=0.01, state_dtype=state_dtype, min_8bit_size=0)
    opt2.load_state_dict(sd)
    for k, v in opt2.state_dict()["state"][0].items():
        assert torch.equal(v, st[k]), k
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        for p, q in zip(model.parameters(), clone.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        opt2.step()
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a if k != "step")


def test_load_converts_between_formats_as_documented():
    model, opt = _trained(torch.float32)
    sd = opt.state_dict()
    opt8 = CPUAdam(model.parameters(), state_dtype="int8", min_8bit_size=0)
    opt8.load_state_dict(sd)
    p0 = next(iter(model.parameters()))
    st8 = opt8.state[p0]
    codes, absmax = ops.quantize_state(sd["state"][0]["exp_avg"], signed=True)
    assert torch.equal(st8["exp_avg"], codes) and torch.equal(st8["exp_avg_absmax"], absmax)
    # back to fp32: exact dequantisation
    opt32 = CPUAdam(model.parameters())
    opt32.load_state_dict(opt8.state_dict())
    m, v = moments_fp32(st8)
    assert torch.equal(opt32.state[p0]["exp_avg"], m) and torch.equal(opt32.state[p0]["exp_avg_sq"], v)
    assert "exp_avg_absmax" not in opt32.state[p0]


@pytest.mark.parametrize("bad", [torch.float16, torch.int8, "fp8", "bf16", None])
def test_bad_state_dtype_fails_at_construction_naming_accepted_values(bad):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"state_dtype=.*torch\.float32.*torch\.bfloat16.*'int8'"):
        CPUAdam([p], state_dtype=bad)


def test_replaced_int8_state_tensors_are_picked_up():
    model, opt = _trained("int8")
    model2, opt2 = _trained("int8")
    p, q = next(iter(model.parameters())), next(iter(model2.parameters()))
    opt.state[p]["exp_avg_absmax"] = opt.state[p]["exp_avg_absmax"] * 2  # a new tensor: the plan must notice
    opt2.state[q]["exp_avg_absmax"].mul_(2)  # in place: the same values
    for a, b in zip(model.parameters(), model2.parameters()):
        a.grad = torch.ones_like(a)
        b.grad = torch.ones_like(b)
    opt.step()
    opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    opt.state[p]["exp_avg_sq_absmax"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"exp_avg_sq_absmax.*ceil\(3000 / 2048\) = 2"):
        opt.step()


def test_missing_absmax_is_refused_by_name():
    model, opt = _trained("int8")
    p = next(iter(model.parameters()))
    del opt.state[p]["exp_avg_absmax"]
    with pytest.raises(ValueError, match=r"CPUAdam param 0 of group 0 .*lacks exp_avg_absmax"):
        opt.step()


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_trajectory_stays_close_to_fp32_adamw(state_dtype):
    """Least squares, 300 steps: the final loss and weights of each format next to torch's AdamW on fp32 state.
    Broken quantisation (wrong map, wrong scale, no requantisation) moves both far past these bounds."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen)
    w_true = torch.randn(64, 1, generator=gen)
    y = x @ w_true + 0.01 * torch.randn(512, 1, generator=gen)

    def train(make_opt):
        w = torch.nn.Parameter(torch.zeros(64, 1))
        opt = make_opt([w])
        for _ in range(300):
            opt.zero_grad()
            loss = ((x @ w - y) ** 2).mean()
            loss.backward()
            opt.step()
        return w.detach(), ((x @ w - y) ** 2).mean().item()

    w_ref, loss_ref = train(lambda ps: torch.optim.AdamW(ps, lr=2e-2, weight_decay=0.0))
    w_q, loss_q = train(lambda ps: CPUAdam(ps, lr=2e-2, weight_decay=0.0, state_dtype=state_dtype, min_8bit_size=0))
    start = (y**2).mean().item()
    assert loss_ref < 0.01 * start
    assert loss_q < loss_ref * 1.5 + 1e-3 * start, (loss_q, loss_ref)
    assert (w_q - w_ref).norm() < 0.05 * w_ref.norm(), (w_q - w_ref).norm() / w_ref.norm()


def test_int8_second_moment_never_reads_back_as_zero():
    """Elements whose gradient stops, in a block where one element's gradient is large: their exp_avg_sq falls below
    half the unsigned map's smallest positive value of the block's absmax. Read back as 0 while exp_avg keeps a code,
    the next step would be lr * m / eps (about 1e3 times the fp32 step here); with code 1 at least it stays within a
    few times fp32's (the step dequantises v to >= 3.25e-7 of the block's absmax, larger than fp32's true v)."""
    n = BLOCK
    steps = []
    for fmt in (torch.float32, "int8"):
        p = torch.nn.Parameter(torch.zeros(n))
        opt = CPUAdam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, state_dtype=fmt, min_8bit_size=0)
        g = torch.full((n,), 1e-4)
        g[0] = 1.0
        opt.step(grads={p: g})
        g[1:] = 0.0  # the gradient of every other element stops
        before = p.detach().clone()
        opt.step(grads={p: g})
        steps.append((p.detach() - before)[1:].abs().max().item())
    fp32_step, int8_step = steps
    assert 0 < int8_step <= 4 * fp32_step, (fp32_step, int8_step)

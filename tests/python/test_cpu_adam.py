"""CPUAdam and zeroshard.ops.adam_step against torch.optim.AdamW / Adam, on every ISA build this CPU can run."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from zeroshard import ops
from zeroshard.isa import cpu_isa, supported_cpu_isas
from zeroshard.optim.cpu_adam import CPUAdam

ISAS = supported_cpu_isas()
SIZES = (1, 15, 17, 1023, 1_000_003)
STEPS = 100
# (adamw_mode, weight_decay, bias_correction, betas). beta1 = 0.3 takes torch lerp's second formula (weight >= 0.5).
CONFIGS = {
    "adamw": (True, 0.0, True, (0.9, 0.999)),
    "adamw-wd": (True, 0.01, True, (0.9, 0.999)),
    "adam": (False, 0.0, True, (0.9, 0.999)),
    "adam-l2": (False, 0.01, True, (0.9, 0.999)),
    "adamw-wd-nobc": (True, 0.01, False, (0.9, 0.999)),
    "adam-l2-nobc": (False, 0.01, False, (0.9, 0.999)),
    "adamw-beta0.3": (True, 0.01, True, (0.3, 0.9)),
}
BIG_CONFIGS = ("adamw-wd", "adam-l2", "adamw-wd-nobc")  # the 1M size is slow in torch: the main paths only
LR = 1e-3
TOL = dict(rtol=1e-6, atol=1e-7)


def grads(n: int, steps: int, seed: int = 0):
    """Deterministic gradients: four random tensors, cycled and rescaled (cheaper than a randn per step)."""
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(n, generator=gen) for _ in range(4)]
    for s in range(steps):
        yield base[s % 4] * (1.0 + 0.01 * s)


def no_bias_correction_reference(p, n, adamw, wd, betas, eps=1e-8):
    """torch has no bias_correction=False: the same op sequence as torch's single-tensor Adam, without it."""
    p = p.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    b1, b2 = betas
    for g in grads(n, STEPS):
        if wd and adamw:
            p.mul_(1 - LR * wd)
        elif wd:
            g = g.add(p, alpha=wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.addcdiv_(m, v.sqrt().add_(eps), value=-LR)
    return p, m, v


_REFERENCE: dict = {}


def reference(n: int, name: str):
    """Final (param, exp_avg, exp_avg_sq) after STEPS torch steps; computed once per case and shared by the ISAs."""
    key = (n, name)
    if key not in _REFERENCE:
        adamw, wd, bc, betas = CONFIGS[name]
        p0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
        if not bc:
            _REFERENCE[key] = (p0, *no_bias_correction_reference(p0, n, adamw, wd, betas))
        else:
            p = torch.nn.Parameter(p0.clone())
            opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([p], lr=LR, betas=betas, weight_decay=wd)
            for g in grads(n, STEPS):
                p.grad = g
                opt.step()
            st = opt.state[p]
            _REFERENCE[key] = (p0, p.detach(), st["exp_avg"], st["exp_avg_sq"])
    return _REFERENCE[key]


CASES = [(n, name) for n in SIZES for name in CONFIGS if n < 1_000_000 or name in BIG_CONFIGS]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("n", "name"), CASES)
def test_matches_torch_after_100_steps(monkeypatch, isa, n, name):
    monkeypatch.setenv("ZEROSHARD_CPU_ISA", isa)
    assert cpu_isa() == isa
    adamw, wd, bc, betas = CONFIGS[name]
    p0, p_ref, m_ref, v_ref = reference(n, name)
    p = torch.nn.Parameter(p0.clone())
    opt = CPUAdam([p], lr=LR, betas=betas, weight_decay=wd, adamw_mode=adamw, bias_correction=bc)
    for g in grads(n, STEPS):
        p.grad = g
        opt.step()
    st = opt.state[p]
    assert type(st["step"]) is int and st["step"] == STEPS  # a plain number while training
    saved = opt.state_dict()["state"][0]["step"]  # torch's format at save time
    assert saved.dtype == torch.float32 and saved.shape == () and saved.item() == STEPS
    torch.testing.assert_close(p.detach(), p_ref, **TOL)
    torch.testing.assert_close(st["exp_avg"], m_ref, **TOL)
    torch.testing.assert_close(st["exp_avg_sq"], v_ref, rtol=1e-6, atol=1e-9)
    assert not torch.equal(p.detach(), p0)  # it did move


def test_isa_builds_agree_bitwise():
    n = 4099
    results = []
    for isa in ISAS:
        p, m, v = torch.randn(n, generator=torch.Generator().manual_seed(3)), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for s, g in enumerate(grads(n, 10), start=1):
            ops.adam_step(p, g.to(torch.float16), m, v, step=s, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.1, adamw_mode=False, bias_correction=True, param_out=out, isa=isa)  # fmt: skip
        results.append((p, m, v, out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))  # fmt: skip


def test_param_groups_match_torch():
    torch.manual_seed(0)
    shapes = [(7, 5), (33,), (4, 4, 4)]
    init = [torch.randn(s) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]

    def groups(ps):
        return [
            {"params": ps[:2], "lr": 3e-3, "weight_decay": 0.1},
            {"params": ps[2:], "betas": (0.8, 0.99), "eps": 1e-6},
        ]

    a = CPUAdam(groups(ours), lr=1e-3, weight_decay=0.01)
    b = torch.optim.AdamW(groups(theirs), lr=1e-3, weight_decay=0.01)
    for _ in range(20):
        for x, y in zip(ours, theirs):
            g = torch.randn(x.shape)
            x.grad, y.grad = g, g.clone()
        a.step()
        b.step()
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, **TOL)
    assert a.param_groups[0]["lr"] == 3e-3 and a.param_groups[1]["betas"] == (0.8, 0.99)


def _train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("direction", ["cpuadam->adamw", "adamw->cpuadam", "adam->cpuadam"])
def test_state_dict_round_trip(direction):
    src_cls, dst_cls = {
        "cpuadam->adamw": (CPUAdam, torch.optim.AdamW),
        "adamw->cpuadam": (torch.optim.AdamW, CPUAdam),
        "adam->cpuadam": (torch.optim.Adam, CPUAdam),
    }[direction]
    adamw = direction != "adam->cpuadam"
    kw = {"adamw_mode": adamw} if src_cls is CPUAdam else {}
    torch.manual_seed(0)
    init = [torch.randn(10, 3), torch.randn(17)]
    src_p = [torch.nn.Parameter(t.clone()) for t in init]
    src = src_cls(src_p, lr=1e-2, weight_decay=0.05, **kw)
    _train(src, src_p, 5, seed=1)
    sd = copy.deepcopy(src.state_dict())  # as if saved: load_state_dict may alias the state tensors
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    dst_p = [torch.nn.Parameter(p.detach().clone()) for p in src_p]
    dst = dst_cls(dst_p, lr=1.0)  # hyperparameters come from the state dict
    dst.load_state_dict(sd)
    if dst_cls is CPUAdam:
        assert dst.param_groups[0]["adamw_mode"] is adamw
    assert dst.param_groups[0]["lr"] == 1e-2
    _train(src, src_p, 5, seed=2)
    _train(dst, dst_p, 5, seed=2)
    for x, y in zip(src_p, dst_p):
        torch.testing.assert_close(x, y, **TOL)
    for k in range(2):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(src.state[src_p[k]][key], dst.state[dst_p[k]][key], **TOL)
        assert float(src.state[src_p[k]]["step"]) == float(dst.state[dst_p[k]]["step"]) == 10


def test_closure_and_params_without_grad():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = CPUAdam([p, q], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert torch.all(p < 1) and torch.equal(q.detach(), torch.ones(3)) and q not in opt.state


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "Invalid learning rate: -1.0"),
        ({"eps": -1e-8}, "Invalid epsilon value: -1e-08"),
        ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
        ({"betas": (0.9, -0.5)}, "Invalid beta parameter at index 1: -0.5"),
        ({"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
    ],
)
def test_init_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPUAdam([torch.nn.Parameter(torch.ones(2))], **kwargs)


def _noncontiguous_param():
    p = torch.nn.Parameter(torch.randn(4, 6).t())
    p.grad = torch.randn(4, 6).t()
    return p


def _sparse_grad_param():
    p = torch.nn.Parameter(torch.randn(4, 6))
    p.grad = torch.randn(4, 6).to_sparse()
    return p


def _meta_param():
    p = torch.nn.Parameter(torch.randn(4, 6, device="meta"))
    p.grad = torch.randn(4, 6, device="meta")
    return p


def _typed_param(dtype):
    p = torch.nn.Parameter(torch.randn(4, 6, dtype=dtype))
    p.grad = torch.randn(4, 6, dtype=dtype)
    return p


BAD_PARAMS = {
    "not-contiguous": (_noncontiguous_param, "param 0 of group 1.*not contiguous"),
    "sparse-grad": (_sparse_grad_param, "gradient of CPUAdam param 0 of group 1.*dense"),
    "meta-device": (_meta_param, "param 0 of group 1.*is on meta"),
    "float64": (lambda: _typed_param(torch.float64), "param 0 of group 1.*float64.*float32"),
    "float16-param": (lambda: _typed_param(torch.float16), "param 0 of group 1.*float16.*float32.*bfloat16"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_step_rejects_bad_param_and_modifies_nothing(case):
    make, match = BAD_PARAMS[case]
    good = torch.nn.Parameter(torch.randn(5))
    opt = CPUAdam([{"params": [good]}], lr=0.1)
    good.grad = torch.randn(5)
    opt.step()
    bad = make()
    opt.add_param_group({"params": [bad]})
    before = (good.detach().clone(), copy.deepcopy(opt.state[good]))
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(good.detach(), before[0])
    for k, v in opt.state[good].items():
        assert torch.equal(v, before[1][k]) if torch.is_tensor(v) else v == before[1][k], k
    assert bad not in opt.state


def test_step_rejects_bad_group_hyperparameter_and_modifies_nothing():
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    opt = CPUAdam([p])
    opt.param_groups[0]["lr"] = -0.5
    with pytest.raises(ValueError, match="param group 0: Invalid learning rate: -0.5"):
        opt.step()
    assert p not in opt.state


@pytest.mark.parametrize("name", ["avx512", "avx2", "sse9"])
def test_forcing_an_isa_the_cpu_lacks_errors(monkeypatch, name):
    if name in ISAS:
        pytest.skip(f"this CPU supports {name}; nothing to reject")
    monkeypatch.setenv("ZEROSHARD_CPU_ISA", name)
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    p0 = p.detach().clone()
    opt = CPUAdam([p])
    supported = ", ".join(ISAS)
    with pytest.raises(ValueError, match=f"ZEROSHARD_CPU_ISA='{name}'.*supports {supported}.*unset ZEROSHARD_CPU_ISA"):
        opt.step()
    assert torch.equal(p.detach(), p0)
    with pytest.raises(ValueError, match=name):
        cpu_isa()
    monkeypatch.delenv("ZEROSHARD_CPU_ISA")
    with pytest.raises(ValueError, match=f"isa argument='{name}'"):
        ops.adam_step(p.detach(), p.grad, torch.zeros(5), torch.zeros(5), step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                      eps=1e-8, weight_decay=0.0, adamw_mode=True, bias_correction=True, isa=name)  # fmt: skip


def test_cpu_isa_api():
    assert ISAS[0] == "scalar"
    assert set(ISAS) <= {"scalar", "avx2", "avx512"}
    assert cpu_isa() == ISAS[-1] or cpu_isa() in ISAS


# The compiled core and ops without zeroshard/__init__.py, which also loads Lightning (seconds a process)
_CORE_ONLY = f"""
import sys, types, torch
sys.modules["zeroshard"] = types.ModuleType("zeroshard")
sys.modules["zeroshard"].__path__ = [{str(Path(ops.__file__).parent)!r}]
"""

_PREFETCH_RUN = (
    _CORE_ONLY
    + """
from zeroshard import _C, ops
gen = torch.Generator().manual_seed(5)
p, g = torch.randn(70_001, generator=gen), torch.randn(70_001, generator=gen)
m, v = torch.zeros_like(p), torch.zeros_like(p)
for isa in ops_isas:
    ops.adam_step(p, g, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True,
                  bias_correction=True, isa=isa)
torch.save({"p": p, "m": m, "v": v, "ahead": _C.adam_prefetch_bytes()}, sys.argv[1])
"""
)


def test_prefetch_distance_changes_no_bit_and_is_checked(tmp_path):
    """ZEROSHARD_ADAM_PREFETCH_BYTES only moves the software prefetch: every distance gives the same bits."""
    import subprocess
    import sys

    results = []
    for value in ("", "0", "4096"):
        out = tmp_path / f"r{value or 'default'}.pt"
        env = dict(os.environ, ZEROSHARD_ADAM_PREFETCH_BYTES=value)
        code = f"ops_isas = {ISAS!r}\n" + _PREFETCH_RUN
        subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, timeout=120)
        results.append(torch.load(out))
    assert [r["ahead"] for r in results[1:]] == [0, 4096]
    for r in results[1:]:
        for k in ("p", "m", "v"):
            assert torch.equal(r[k], results[0][k]), k
    env = dict(os.environ, ZEROSHARD_ADAM_PREFETCH_BYTES="-1")
    code = _CORE_ONLY + "from zeroshard import _C; _C.adam_prefetch_bytes()"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "ZEROSHARD_ADAM_PREFETCH_BYTES=-1 is invalid" in bad.stderr


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_ops_low_precision_grads_and_param_out(isa, grad_dtype, out_dtype):
    n = 70_001  # crosses one 64Ki-element chunk boundary
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(4))
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01)
    for s, g in enumerate(grads(n, 10), start=1):
        g16 = g.to(grad_dtype)
        stats = ops.adam_step(master, g16, m, v, step=s, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.01, adamw_mode=True, bias_correction=True, param_out=out,
                              grad_stats=True, isa=isa)  # fmt: skip
        ref.grad = g16.float()
        opt.step()
        sq, found_inf = stats
        assert sq == pytest.approx(g16.double().pow(2).sum().item(), rel=1e-12)
        assert found_inf is False
        assert torch.equal(out, master.to(out_dtype))  # the same pass writes exactly the rounded master
    torch.testing.assert_close(master, ref.detach(), **TOL)


def test_ops_grad_stats_flags_inf_and_nan():
    for bad in (float("inf"), float("-inf"), float("nan")):
        g = torch.ones(1023, dtype=torch.bfloat16)
        g[1022] = bad
        sq, found_inf = ops.adam_step(torch.zeros(1023), g, torch.zeros(1023), torch.zeros(1023), step=1, lr=1e-3,
                                      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
                                      bias_correction=True, grad_stats=True)  # fmt: skip
        assert found_inf is True


def test_ops_bf16_param_out_keeps_nan_and_rounds_ties_to_even():
    # lr = 0 leaves the master unchanged, so param_out is just its bf16 rounding.
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x7FC00000, 0x7F7FFFFF], dtype=torch.int32)
    master = bits.view(torch.float32).clone()
    out = torch.empty(5, dtype=torch.bfloat16)
    ops.adam_step(master, torch.zeros(5), torch.zeros(5), torch.zeros(5), step=1, lr=0.0, beta1=0.9, beta2=0.999,
                  eps=1e-8, weight_decay=0.0, adamw_mode=True, bias_correction=True, param_out=out)  # fmt: skip
    assert out.view(torch.int16).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7FC0, 0x7F80]


def _ops_call(p, g, m, v, **kw):
    args = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
                bias_correction=True)  # fmt: skip
    args.update(kw)
    return ops.adam_step(p, g, m, v, **args)


@pytest.mark.parametrize(
    ("mutate", "exc", "match"),
    [
        (lambda t: {"g": t["g"].double()}, TypeError, "grad has dtype Double"),
        (lambda t: {"m": t["m"].half()}, TypeError, "exp_avg has dtype Half"),
        (lambda t: {"g": torch.ones(9)}, ValueError, "grad has 9 elements but param has 8"),
        (lambda t: {"v": torch.ones(16)[::2]}, RuntimeError, "exp_avg_sq is not contiguous"),
        (lambda t: {"v": t["m"]}, RuntimeError, "exp_avg and exp_avg_sq share memory"),
        (lambda t: {"out": torch.empty(8, dtype=torch.int8)}, TypeError, "param_out has dtype Char"),
        (lambda t: {"p": t["p"].half()}, TypeError, "param has dtype Half.*float32.*bfloat16"),
        (
            lambda t: {"p": t["p"].bfloat16(), "out": torch.empty(8, dtype=torch.bfloat16)},
            ValueError,
            "param is bfloat16 and param_out is given",
        ),
        (lambda t: {"step": 0}, ValueError, "step=0"),
        (lambda t: {"lr": float("nan")}, ValueError, "invalid learning rate lr=nan"),
        (lambda t: {"beta2": 1.0}, ValueError, "invalid beta2=1"),
    ],
)
def test_ops_rejects_bad_arguments_before_writing(mutate, exc, match):
    t = {"p": torch.randn(8), "g": torch.randn(8), "m": torch.randn(8), "v": torch.rand(8)}
    snapshot = {k: x.clone() for k, x in t.items()}
    change = mutate(t)
    tensors = {k: change.get(k, t[k]) for k in ("p", "g", "m", "v")}
    kw = {k: val for k, val in change.items() if k not in ("p", "g", "m", "v", "out")}
    if "out" in change:
        kw["param_out"] = change["out"]
    with pytest.raises(exc, match=match):
        _ops_call(tensors["p"], tensors["g"], tensors["m"], tensors["v"], **kw)
    for k, x in t.items():
        assert torch.equal(x, snapshot[k]), k


def test_group_step_equals_one_kernel_call_per_tensor_bitwise():
    """One ``_C.adam_step_groups`` call over many tensors (small ones and ones spanning several chunks, bf16 grads
    among them) gives exactly the bits of ``ops.adam_step`` on each tensor, with 1 thread or 2."""
    shapes = [(3,), (1000,), (70_001,), (17, 5), (2, 65_536)] * 3
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen) for s in shapes]
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            ours = [torch.nn.Parameter(t.clone()) for t in init]
            opt = CPUAdam(ours, lr=1e-2, weight_decay=0.1)
            ref = [(t.clone(), torch.zeros_like(t), torch.zeros_like(t)) for t in init]
            for step in range(1, 4):
                g = {p: torch.randn(p.shape, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
                     for i, p in enumerate(ours)}  # fmt: skip
                opt.step(grads=g)
                for p, (rp, rm, rv) in zip(ours, ref):
                    ops.adam_step(rp, g[p], rm, rv, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=0.1, adamw_mode=True, bias_correction=True)  # fmt: skip
            for p, (rp, rm, rv) in zip(ours, ref):
                st = opt.state[p]
                assert (
                    torch.equal(p.detach(), rp) and torch.equal(st["exp_avg"], rm) and torch.equal(st["exp_avg_sq"], rv)
                )
                assert st["step"] == 3
    finally:
        torch.set_num_threads(saved)


def test_state_replaced_or_late_params_are_picked_up():
    """A parameter whose gradient first appears at step 3 gets its state then (as in torch); state dicts assigned
    from outside (as the sharded checkpoint loader does, with torch's tensor ``step``) are used from the next step."""
    torch.manual_seed(0)
    init = [torch.randn(40), torch.randn(7, 3)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    a, b = CPUAdam(ours, lr=1e-2, weight_decay=0.01), torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for k, (x, y) in enumerate(zip(ours, theirs)):
            g = torch.randn(x.shape, generator=gen) if (k == 0 or step >= 2) else None
            x.grad, y.grad = g, None if g is None else g.clone()
        a.step()
        b.step()
        if step == 1:
            assert ours[1] not in a.state
        if step == 3:  # replace the state dicts with torch's, as loaders do
            for x, y in zip(ours, theirs):
                a.state[x] = {k: v.clone() for k, v in b.state[y].items()}
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, **TOL)
        assert a.state[x]["step"] == b.state[y]["step"].item()
    assert a.state[ours[1]]["step"] == 4


def test_bad_gradient_at_a_later_step_modifies_nothing():
    p, q = torch.nn.Parameter(torch.randn(9)), torch.nn.Parameter(torch.randn(5))
    opt = CPUAdam([{"params": [p]}, {"params": [q]}], lr=0.1)
    p.grad, q.grad = torch.randn(9), torch.randn(5)
    opt.step()
    before = copy.deepcopy(opt.state_dict()), p.detach().clone(), q.detach().clone()
    p.grad = torch.randn(9)
    with pytest.raises(ValueError, match="gradient of CPUAdam param 0 of group 1.*torch.float64"):
        opt.step(grads={q: torch.randn(5).double()})
    assert torch.equal(p.detach(), before[1]) and torch.equal(q.detach(), before[2])
    after = opt.state_dict()
    for k in (0, 1):
        for key, v in before[0]["state"][k].items():
            assert torch.equal(after["state"][k][key], v), key


def test_step_hooks_run_as_torch_runs_them():
    """CPUAdam's own step wrapper keeps torch's step pre/post hooks (per optimizer and global)."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = CPUAdam([p], lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o is opt)))
    handle = register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global", True)))
    try:
        opt.step()
    finally:
        handle.remove()
    assert calls == [("pre", True), ("post", True), ("global", True)]
    assert opt.state[p]["step"] == 1

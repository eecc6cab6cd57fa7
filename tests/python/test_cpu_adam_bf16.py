"""CPUAdam and ops.adam_step on bf16 parameters with no fp32 master (DeepSpeedCPUAdam's bf16 mode), against
torch.optim.AdamW / Adam run in fp32 on the same values and rounded once."""

from __future__ import annotations

import copy

import pytest
import torch

from zeroshard import ops
from zeroshard.isa import supported_cpu_isas
from zeroshard.optim.cpu_adam import CPUAdam

ISAS = supported_cpu_isas()
LR = 1e-2
STEPS = 20
# (torch optimizer class, adamw_mode, weight_decay)
MODES = {"adamw-wd": (torch.optim.AdamW, True, 0.1), "adam-l2": (torch.optim.Adam, False, 0.1)}


def torch_step_fp32(p_bf16, g_bf16, m, v, step, cls, wd):
    """One torch step in fp32 from (p, m, v) as they are now; returns (p rounded to bf16, m, v)."""
    p = torch.nn.Parameter(p_bf16.float())
    p.grad = g_bf16.float()
    opt = cls([p], lr=LR, weight_decay=wd)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    st = opt.state[p]
    return p.detach().bfloat16(), st["exp_avg"], st["exp_avg_sq"]


def assert_bf16_within_one_ulp(actual, expected, max_fraction=1e-3):
    """Equal, except where fp32 results 1 ulp apart (zeroshard's denominator multiplies by 1 / sqrt(1 - beta2^t)
    where torch divides) round to neighbouring bf16 values: at most 1 bf16 ulp, on a tiny fraction of elements."""
    a, e = actual.view(torch.int16).int(), expected.view(torch.int16).int()
    diff = (a - e).abs()
    assert int(diff.max()) <= 1, f"max difference {int(diff.max())} bf16 ulps"
    assert float((diff > 0).float().mean()) <= max_fraction


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n", [17, 1023, 100_003])
def test_bf16_params_match_torch_fp32_rounded_once(monkeypatch, isa, mode, n):
    monkeypatch.setenv("ZEROSHARD_CPU_ISA", isa)
    cls, adamw, wd = MODES[mode]
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16())
    opt = CPUAdam([p], lr=LR, weight_decay=wd, adamw_mode=adamw)
    start = p.detach().clone()
    for step in range(1, STEPS + 1):
        p.grad = torch.randn(n, generator=gen).bfloat16()
        st = opt.state.get(p, {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)})
        want = torch_step_fp32(p.detach(), p.grad, st["exp_avg"], st["exp_avg_sq"], step, cls, wd)
        opt.step()
        st = opt.state[p]
        assert p.dtype == torch.bfloat16 and st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert_bf16_within_one_ulp(p.detach(), want[0])
        torch.testing.assert_close(st["exp_avg"], want[1], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(st["exp_avg_sq"], want[2], rtol=1e-6, atol=1e-9)
        p.data.copy_(want[0])  # the next step starts from the reference's value: no drift between the two
        st["exp_avg"].copy_(want[1])
        st["exp_avg_sq"].copy_(want[2])
    assert not torch.equal(p.detach(), start)


def test_bf16_kernel_equals_fp32_kernel_rounded_bitwise():
    """The bf16 path computes exactly what the fp32 master path computes, rounded once (every ISA build)."""
    n = 4099
    for isa in ISAS:
        gen = torch.Generator().manual_seed(1)
        p16 = torch.randn(n, generator=gen).bfloat16()
        p32, m16, v16 = p16.float(), torch.zeros(n), torch.zeros(n)
        m32, v32 = m16.clone(), v16.clone()
        for step in range(1, 6):
            g = torch.randn(n, generator=gen).bfloat16()
            kw = dict(step=step, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True,
                      bias_correction=True, isa=isa)  # fmt: skip
            ops.adam_step(p16, g, m16, v16, **kw)
            ops.adam_step(p32, g, m32, v32, **kw)
            assert torch.equal(p16, p32.bfloat16()) and torch.equal(m16, m32) and torch.equal(v16, v32), (isa, step)
            p32 = p16.float()  # the master path starts the next step from the rounded value, as bf16 does


def _build(opt_cls):
    gen = torch.Generator().manual_seed(2)
    model = torch.nn.Linear(33, 7).to(torch.bfloat16)
    x = torch.randn(64, 33, generator=gen).bfloat16()
    y = torch.randn(64, 7, generator=gen).bfloat16()
    opt = opt_cls(model.parameters(), lr=LR, weight_decay=0.01)
    return model, opt, (x, y)


def _fit(model, opt, data, steps):
    x, y = data
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
        opt.step()


def test_bf16_state_dict_keeps_fp32_moments_and_resumes_bitwise():
    model, opt, data = _build(CPUAdam)
    _fit(model, opt, data, 3)
    sd = copy.deepcopy(opt.state_dict())  # state_dict() holds the live tensors
    assert all(st["exp_avg"].dtype == torch.float32 for st in sd["state"].values())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _fit(model, opt, data, 3)  # uninterrupted: 6 steps
    model2, opt2, _ = _build(CPUAdam)
    model2.load_state_dict(weights)
    opt2.load_state_dict(sd)  # torch would cast the moments to the parameters' bf16
    for p in model2.parameters():
        assert opt2.state[p]["exp_avg"].dtype == opt2.state[p]["exp_avg_sq"].dtype == torch.float32
    _fit(model2, opt2, data, 3)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_torch_adamw_bf16_state_loads_as_fp32_moments():
    model, torch_opt, data = _build(torch.optim.AdamW)
    _fit(model, torch_opt, data, 2)
    sd = torch_opt.state_dict()
    assert next(iter(sd["state"].values()))["exp_avg"].dtype == torch.bfloat16  # torch keeps moments like params
    opt = CPUAdam(model.parameters(), lr=LR, weight_decay=0.01)
    opt.load_state_dict(sd)
    for p in model.parameters():
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(st["exp_avg"], sd["state"][0 if p.dim() == 2 else 1]["exp_avg"].float())
    before = [p.detach().clone() for p in model.parameters()]
    _fit(model, opt, data, 1)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


class Fp32StepAdamW(torch.optim.Optimizer):
    """Reference for bf16 parameters without a master: torch.optim.AdamW stepping fp32 copies of the bf16 values
    with fp32 moments, the result rounded back once (``copy_`` rounds to nearest even)."""

    def __init__(self, params, **kw):
        params = list(params)
        super().__init__(params, {})
        self.shadow = [torch.nn.Parameter(p.detach().float()) for p in params]
        self.inner = torch.optim.AdamW(self.shadow, **kw)

    def step(self, closure=None):
        loss = None if closure is None else closure()
        for p, s in zip(self.param_groups[0]["params"], self.shadow):
            s.data.copy_(p.detach())
            s.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, s in zip(self.param_groups[0]["params"], self.shadow):
            p.data.copy_(s.detach())
        return loss


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_lightning_bf16_true_hf_model_trains_like_fp32_step_rounded_once(kind):
    """A user's run: a Hugging Face model (built from a config) in Lightning's ``precision="bf16-true"`` with CPUAdam,
    against the same run with the reference optimizer."""
    import lightning as L
    from hf_lm import HFLM
    from tiny_lm import token_dataset

    class Module(HFLM):
        def __init__(self, opt_cls):
            super().__init__(kind)
            self.opt_cls = opt_cls

        def configure_optimizers(self):
            return self.opt_cls(self.parameters(), lr=3e-3, weight_decay=0.01)

    def fit(opt_cls):
        torch.manual_seed(0)
        module = Module(opt_cls)
        start = {k: v.to(torch.bfloat16) for k, v in module.state_dict().items()}
        quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", max_steps=8, **quiet)
        loader = torch.utils.data.DataLoader(token_dataset(64), batch_size=8)
        trainer.fit(module, loader)
        return module, start

    ours, start = fit(CPUAdam)
    ref, ref_start = fit(Fp32StepAdamW)
    assert ours.losses[-1] < ours.losses[0]
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert a.dtype == torch.bfloat16, name
        assert torch.equal(start[name], ref_start[name]), name
        moved = (b.float() - start[name].float()).abs().max()
        if moved == 0:  # e.g. a rotary buffer
            assert torch.equal(a, b), name
            continue
        assert (a.float() - b.float()).abs().max() <= 0.05 * moved, name

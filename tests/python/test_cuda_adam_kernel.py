"""zeroshard's CUDA Adam kernel (``csrc/adam/adam_kernel_cuda.cu``, through ``ops.adam_step`` on CUDA tensors) against
the CPU kernel, bit for bit; ``DeviceAdam`` steps CUDA parameters with it. GPU tests: skipped without a GPU.

The reference is the CPU kernel, itself checked against ``torch.optim.AdamW`` / ``Adam`` and an independent int8
reference (``test_cpu_adam.py``, ``test_cpu_adam_state_formats.py``); the claim here is the same bits on both devices,
so states and checkpoints move between them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_device_adam import HYPER, SIZES, _grads, assert_bits

from zeroshard import _C, ops
from zeroshard.optim.cpu_adam import CPUAdam
from zeroshard.optim.state_format import new_moments

pytestmark = pytest.mark.gpu

FORMATS = [torch.float32, torch.bfloat16, "int8"]
LR = 1e-2


@pytest.fixture(autouse=True)
def _needs_the_cuda_kernel():
    if not _C.adam_cuda_available():
        pytest.fail("this build has no CUDA parts: build zeroshard against the CUDA torch on this GPU machine")


def _absmax(st: dict) -> dict:
    return {k: st[k] for k in ("exp_avg_absmax", "exp_avg_sq_absmax") if k in st}


def _run_both(n, fmt, hyper, grads, param_dtype=torch.float32, seed=0):
    """20 steps of ops.adam_step on CPU and on CUDA tensors from the same start; returns (cpu, cuda) (param, state)."""
    p_cpu = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(param_dtype)
    p_gpu = p_cpu.cuda()
    st_cpu = new_moments((n,), fmt)
    st_gpu = {k: v.cuda() for k, v in new_moments((n,), fmt).items()}
    for t, g in enumerate(grads, start=1):
        ops.adam_step(p_cpu, g, st_cpu["exp_avg"], st_cpu["exp_avg_sq"], step=t, lr=LR, **hyper, **_absmax(st_cpu))
        ops.adam_step(p_gpu, g.cuda(), st_gpu["exp_avg"], st_gpu["exp_avg_sq"], step=t, lr=LR, **hyper,
                      **_absmax(st_gpu))  # fmt: skip
    torch.cuda.synchronize()
    return (p_cpu, st_cpu), (p_gpu, st_gpu)


def _assert_same(cpu, gpu):
    assert_bits(gpu[0], cpu[0], "param")
    for k in cpu[1]:
        assert_bits(gpu[1][k], cpu[1][k], k)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hyper", list(HYPER), ids=list(HYPER))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_cuda_kernel_equals_the_cpu_kernel_over_20_steps(n, fmt, hyper, grad_dtype):
    grads = _grads(n, 20, seed=n + 11, dtype=grad_dtype)
    _assert_same(*_run_both(n, fmt, HYPER[hyper], grads))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_bf16_params_without_master_equal_the_cpu_kernel(fmt):
    n = 3 * 2048 + 777
    _assert_same(*_run_both(n, fmt, HYPER["adamw"], _grads(n, 20, seed=5, dtype=torch.bfloat16), torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_large_tensor_equals_the_cpu_kernel(fmt):
    """More elements than one grid covers (65,536 blocks of 256 threads: the grid-stride loop) and many int8 blocks."""
    n = 65536 * 256 + 4097
    _assert_same(*_run_both(n, fmt, HYPER["adam_l2"], _grads(n, 3, seed=9)))


def test_nonfinite_int8_block_goes_nan_as_on_the_cpu():
    n = 3 * 2048 + 5
    grads = _grads(n, 4, seed=2)
    grads[1][2048 + 3] = float("inf")
    grads[2][10] = float("nan")
    cpu, gpu = _run_both(n, "int8", HYPER["adamw"], grads)
    _assert_same(cpu, gpu)
    assert gpu[1]["exp_avg_absmax"][:2].isnan().all() and gpu[1]["exp_avg_absmax"][2:].isfinite().all()


def test_device_adam_steps_cuda_params_with_the_kernel(monkeypatch):
    """DeviceAdam on CUDA equals CPUAdam on the CPU bit for bit (the same gradients given to both: CUDA matmuls
    round differently), and never enters the torch-ops path there."""
    import zeroshard.optim.device_adam as device_adam

    def not_here(*args, **kwargs):
        raise AssertionError("DeviceAdam stepped a CUDA parameter with torch ops, not the CUDA kernel")

    monkeypatch.setattr(device_adam, "adam_step_torch", not_here)
    for fmt in FORMATS:
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(40, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3))
        model = copy.deepcopy(ref).cuda()
        kw = dict(lr=LR, weight_decay=0.05, state_dtype=fmt, min_8bit_size=64)  # the 3-element bias: fp32 moments
        opt_ref, opt = CPUAdam(ref.parameters(), **kw), device_adam.DeviceAdam(model.parameters(), **kw)
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            opt_ref.zero_grad()
            ref(torch.randn(16, 40, generator=gen)).square().mean().backward()
            for a, b in zip(ref.parameters(), model.parameters()):
                b.grad = a.grad.cuda()
            opt_ref.step()
            opt.step()
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            assert_bits(b.detach(), a.detach(), f"{fmt} {name}")
        assert {st["exp_avg"].dtype for st in opt.state.values()} == {
            st["exp_avg"].dtype for st in opt_ref.state.values()
        }


def test_cpu_only_options_fail_before_anything_changes():
    n = 4096
    p = torch.randn(n, device="cuda")
    g = torch.randn(n, device="cuda")
    st = {k: v.cuda() for k, v in new_moments((n,), "int8").items()}
    before = [p.clone()] + [v.clone() for v in st.values()]
    kw = dict(step=1, lr=LR, **HYPER["adamw"], **_absmax(st))
    with pytest.raises(ValueError, match="grad_stats"):
        ops.adam_step(p, g, st["exp_avg"], st["exp_avg_sq"], grad_stats=True, **kw)
    with pytest.raises(ValueError, match="param_out"):
        ops.adam_step(p, g, st["exp_avg"], st["exp_avg_sq"], param_out=torch.empty(n, device="cuda"), **kw)
    with pytest.raises(ValueError, match="isa"):
        ops.adam_step(p, g, st["exp_avg"], st["exp_avg_sq"], isa="avx2", **kw)
    with pytest.raises(RuntimeError, match="grad is on cpu"):
        ops.adam_step(p, g.cpu(), st["exp_avg"], st["exp_avg_sq"], **kw)
    for a, b in zip([p] + list(st.values()), before):
        assert_bits(a, b, "unchanged")

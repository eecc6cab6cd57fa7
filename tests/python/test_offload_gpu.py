"""Offload on a CUDA GPU (skipped without one): results equal the non-offloaded run on the same GPU, host buffers are
pinned at their exact size, and the copies overlap compute (a profiler trace of one step). One process, NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zeroshard import _C, ZeroConfig, ZeroEngine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 256, depth: int = 4, vocab: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(idx)))


def _train(config: ZeroConfig, steps: int, compute_dtype=None, dim: int = 256, tokens: int = 4096):
    torch.manual_seed(0)
    model = Net(dim).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    engine = ZeroEngine(model, opt, config, compute_dtype=compute_dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 512, (tokens // 128, 129), device="cuda", generator=g)
        engine.begin_step()
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 512), idx[:, 1:].reshape(-1))
        loss.backward()
        engine.finish_backward()
        engine.optimizer.step()
        engine.after_step()
        losses.append(loss.item())
    with engine.gathered():
        params = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    return losses, params, engine


@pytest.mark.parametrize(
    "stage, offload_params, compute_dtype",
    [(2, False, None), (3, False, None), (3, True, None), (2, False, torch.bfloat16), (3, True, torch.bfloat16)],
)
def test_offload_equals_the_run_without_offload(group, stage, offload_params, compute_dtype):
    base = dict(stage=stage, wrap_policy=Block if stage == 3 else None, offload_chunk_size=100_000)
    ref_losses, ref_params, _ = _train(ZeroConfig(**base), 8, compute_dtype)
    config = ZeroConfig(**base, offload_optimizer=True, offload_params=offload_params)
    losses, params, engine = _train(config, 8, compute_dtype)
    # torch's CUDA AdamW and the fused CPU kernel differ only in rounding (fp32: ~1e-7 per step; bf16: the same
    # master weights rounded to bf16)
    tol = 1e-5 if compute_dtype is None else 1e-2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=tol)
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}")
    assert all(fp.master.is_pinned() for fp in engine.flat_params)
    if offload_params:
        assert all(fp.shard.is_pinned() and fp.full.is_cuda for fp in engine.all_flat_params)
    stats = engine.offload.copy_stats()
    assert stats["d2h"]["bytes"] > 0 and stats["d2h"]["seconds"] > 0
    if not offload_params:
        assert stats["h2d"]["bytes"] > 0
    engine.remove_hooks()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"], ids=str)
def test_state_formats_step_on_the_gpu_as_the_offloaded_kernel_does(group, stage, state_dtype):
    """Issue 19's device step: without offload, AdamW with bf16 / int8 moments becomes ``DeviceAdam`` on the GPU
    master shards; with optimizer offload, the fused CPU kernel steps the host shards. Same formats, same bits per
    step (``torch_state_step`` mirrors the kernel), so the two runs agree to the forward/backward's own rounding."""
    from zeroshard import CPUAdam
    from zeroshard.optim.device_adam import DeviceAdam

    base = dict(stage=stage, wrap_policy=Block if stage == 3 else None, optimizer_state_dtype=state_dtype)
    ref_losses, ref_params, ref = _train(ZeroConfig(**base, offload_optimizer=True), 8)
    losses, params, engine = _train(ZeroConfig(**base), 8)
    assert type(engine.optimizer) is DeviceAdam  # the offloaded run: the fused kernel's CPUAdam (not DeviceAdam)
    assert isinstance(ref.optimizer, CPUAdam) and not isinstance(ref.optimizer, DeviceAdam)
    # the same layout and formats on both (under int8 the parameters below min_8bit_size sit in flat parameters of
    # their own with fp32 moments), the device run's moments on the GPU
    code_dtype = torch.uint8 if state_dtype == "int8" else torch.bfloat16
    layout = lambda opt: sorted((s["exp_avg"].numel(), str(s["exp_avg"].dtype)) for s in opt.state.values())  # noqa: E731
    assert layout(engine.optimizer) == layout(ref.optimizer)
    assert all(s["exp_avg"].is_cuda for s in engine.optimizer.state.values())
    assert code_dtype in {s["exp_avg"].dtype for s in engine.optimizer.state.values()}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    engine.remove_hooks()
    ref.remove_hooks()


def test_pinned_bytes_are_exact(group):
    before = _C.host_memory_stats()["pinned_bytes"]
    t = _C.empty_host(1_000_003, torch.bfloat16, True)
    assert t.is_pinned() and t.numel() == 1_000_003
    assert _C.host_memory_stats()["pinned_bytes"] - before == 2_000_006
    del t
    assert _C.host_memory_stats()["pinned_bytes"] == before


def test_copies_overlap_compute(group):
    """A profiler trace of one stage-3 step with optimizer and parameter offload: some gradient device-to-host copy
    and some parameter host-to-device copy run while a compute kernel runs on another stream."""
    config = ZeroConfig(stage=3, wrap_policy=Block, offload_optimizer=True, offload_params=True)
    _, _, engine = _train(config, 2, torch.bfloat16, dim=1024, tokens=32768)  # warm-up, records the unit order
    model = engine.module
    idx = torch.randint(0, 512, (256, 129), device="cuda")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        engine.begin_step()
        loss = F.cross_entropy(model(idx[:, :-1]).float().reshape(-1, 512), idx[:, 1:].reshape(-1))
        loss.backward()
        engine.finish_backward()
        engine.optimizer.step()
        engine.after_step()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in gpu if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]

    def overlapping(kind: str) -> int:
        copies = [e for e in gpu if kind in e.name]
        return sum(
            any(k.time_range.start < c.time_range.end and c.time_range.start < k.time_range.end for k in kernels)
            for c in copies
        )

    assert overlapping("DtoH") > 0, "no gradient copy overlapped a kernel"
    assert overlapping("HtoD") > 0, "no parameter copy overlapped a kernel"
    engine.remove_hooks()

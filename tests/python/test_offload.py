"""Optimizer and parameter offload on the CPU: the pipeline's results against torch.optim.AdamW, the host-memory check,
the exact-size host buffers and the per-rank threads. One process (a gloo group of one); the multi-rank runs against
DDP are in test_parity.py, the CUDA ones in test_offload_gpu.py."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from tiny_lm import SEQ, VOCAB, Block, TinyLM

from zeroshard import _C, CPUAdam, ZeroConfig, ZeroEngine
from zeroshard.offload.offload import OffloadedAdam, threads_per_rank


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, SEQ + 1), generator=g) for _ in range(n)]


def _loss(model, batch) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def _optimizer(model) -> torch.optim.AdamW:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)


def test_cpu_adam_takes_bf16_and_fp16_gradients():
    """``CPUAdam.step(grads=...)`` with bf16/fp16 gradients equals AdamW fed the same gradients upcast to fp32."""
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        p = torch.randn(70_001)
        q = p.clone().requires_grad_()
        p.requires_grad_()
        ours, ref = CPUAdam([p], lr=1e-2, weight_decay=0.1), torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
        for _ in range(10):
            g = torch.randn(70_001).to(dtype)
            ours.step(grads={p: g})
            q.grad = g.float()
            ref.step()
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "stage, offload_params, chunk",
    [(1, False, 1000), (2, False, 1000), (2, False, 10**7), (3, False, 1000), (3, True, 1000), (3, True, 3)],
)
def test_offload_pipeline_matches_adamw(group, stage, offload_params, chunk):
    """Five steps through the offload pipeline (chunks smaller than every flat parameter, and one chunk for all) equal
    plain AdamW on an unsharded copy of the model: losses and parameters to fp32 rounding."""
    model, ref = _model(), _model()
    config = ZeroConfig(
        stage=stage,
        offload_optimizer=True,
        offload_params=offload_params,
        offload_chunk_size=chunk,
        wrap_policy=Block if stage == 3 else None,
        reduce_bucket_size=3000,
    )
    engine = ZeroEngine(model, _optimizer(model), config)
    assert isinstance(engine.optimizer, OffloadedAdam) and engine.pipelined
    ref_opt = _optimizer(ref)
    for batch in _batches(5):
        engine.begin_step()
        loss = _loss(model, batch)
        loss.backward()
        engine.finish_backward()
        engine.optimizer.step()
        engine.after_step()
        ref_loss = _loss(ref, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert engine.offload.copy_stats()["d2h"]["bytes"] > 0
    with engine.gathered():
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    if offload_params:  # the shards the step writes are the host shards themselves
        assert all(fp.host_shard and fp.shard.device.type == "cpu" for fp in engine.flat_params)
    engine.remove_hooks()


def test_host_buffers_are_exact_size_and_counted(group):
    """Master, gradient and (stage 3) parameter shards come from ``_C.empty_host``: the live bytes grow by exactly
    their sizes plus the Adam state, nothing rounded up (on CPU nothing is pinned)."""
    before = _C.host_memory_stats()
    model = _model()
    config = ZeroConfig(stage=3, offload_optimizer=True, offload_params=True, wrap_policy=Block)
    engine = ZeroEngine(model, _optimizer(model), config)
    after = _C.host_memory_stats()
    expected = 0
    for fp in engine.all_flat_params:
        n = fp.layout.shard_numel
        expected += n * fp.shard.element_size()  # parameter shard
        if fp.trainable:
            expected += n * (4 + 4 + 4) + n * engine.offload.host_grads[id(fp)].element_size()
    assert after["pinned_bytes"] == before["pinned_bytes"]  # a CPU (gloo) engine pins nothing
    assert after["unpinned_bytes"] - before["unpinned_bytes"] == expected
    assert engine.offload_host_bytes >= expected  # the budget check counted at least what was allocated
    engine.remove_hooks()


def test_too_little_host_memory_fails_before_anything_is_allocated(group):
    model = _model()
    snapshot = copy.deepcopy(model.state_dict())
    before = _C.host_memory_stats()["unpinned_bytes"]
    config = ZeroConfig(stage=2, offload_optimizer=True)
    with pytest.raises(ValueError, match=r"needs [0-9.]+ GiB of host memory but only [0-9.]+ GiB is available"):
        ZeroEngine(model, _optimizer(model), config, local_world_size=10**9)
    assert _C.host_memory_stats()["unpinned_bytes"] == before
    for k, v in model.state_dict().items():
        assert torch.equal(v, snapshot[k]), k


def test_each_rank_steps_with_its_share_of_the_cores(group):
    cores = len(os.sched_getaffinity(0))
    assert threads_per_rank(1) == cores
    assert threads_per_rank(cores * 4) == 1
    saved = torch.get_num_threads()
    try:
        model = _model()
        engine = ZeroEngine(model, _optimizer(model), ZeroConfig(stage=2, offload_optimizer=True), local_world_size=2)
        assert engine.cpu_threads == max(1, cores // 2) == torch.get_num_threads()
        engine.remove_hooks()
    finally:
        torch.set_num_threads(saved)


def test_other_optimizers_step_the_host_masters_unpipelined(group):
    """SGD cannot be fused: it steps the host masters from fp32 ``.grad`` and the shards are refreshed after."""
    model, ref = _model(), _model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match="runs unfused"):
        engine = ZeroEngine(model, opt, ZeroConfig(stage=2, offload_optimizer=True))
    assert not engine.pipelined
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for batch in _batches(3):
        _loss(model, batch).backward()
        engine.finish_backward()
        engine.optimizer.step()
        engine.after_step()
        _loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (k, v), w in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    engine.remove_hooks()

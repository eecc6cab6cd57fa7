"""The offloaded CPU step overlapped with backward (``overlap_step=True``, :mod:`zeroshard.offload.overlap`) on the CPU,
with host copy queues: the same code path as on a GPU. Results must equal the step after backward bit for bit (fp32), at
stages 1-3, with and without parameter offload, with gradient clipping and with an fp16 overflow; and a bucket's step
must start before backward ends. One process (a gloo group of one)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_lm import SEQ, VOCAB, Block, TinyLM

from zeroshard import ZeroConfig, ZeroEngine
from zeroshard.engine.engine import master_gradients
from zeroshard.engine.loss_scaler import ShardedLossScaler

pytestmark = pytest.mark.usefixtures("group")


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, SEQ + 1), generator=g) for _ in range(n)]


def _train(stage: int, offload_params: bool, overlap: bool, mode: str, steps: int = 4):
    """``steps`` steps of TinyLM the way ZeroPrecision and ZeroStrategy drive the engine; returns the engine."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    config = ZeroConfig(
        stage=stage,
        offload_optimizer=True,
        offload_params=offload_params,
        overlap_step=overlap,
        offload_chunk_size=1000,
        wrap_policy=Block if stage == 3 else None,
        reduce_bucket_size=3000,
        max_inflight_buckets=1,
    )
    engine = ZeroEngine(model, opt, config)
    engine.offload.global_scale_expected = mode != "plain"  # what ZeroStrategy sets from the Trainer
    scaler = ShardedLossScaler(init_scale=2.0**10, hysteresis=1) if mode == "fp16" else None
    for i, batch in enumerate(_batches(steps)):
        engine.begin_step()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        if scaler is not None:
            loss = scaler.scale_loss(loss) * (float("inf") if i == 1 else 1.0)  # step 1 overflows
        loss.backward()
        engine.finish_backward()
        overflow = False
        if scaler is not None:
            grads = master_gradients(engine.optimizer)
            overflow = scaler.unscale_and_check(grads, dist.group.WORLD, fold=engine.optimizer.fold_grad_unscale)
        if mode != "plain" and not overflow:
            engine.clip_grad_norm_(0.05)  # small enough to clip every step
        if not overflow:
            engine.optimizer.step()
        if scaler is not None:
            scaler.update(overflow)
        engine.after_step()
    return engine


def _state(engine) -> dict[str, torch.Tensor]:
    out = {}
    for i, fp in enumerate(engine.flat_params):
        st = engine.optimizer.state[fp.master]
        out[f"{i}.master"] = fp.master.detach().clone()
        out[f"{i}.shard"] = fp.shard.detach().clone()
        out[f"{i}.exp_avg"] = st["exp_avg"].clone()
        out[f"{i}.exp_avg_sq"] = st["exp_avg_sq"].clone()
        out[f"{i}.step"] = torch.tensor(st["step"])
    return out


CASES = [(1, False), (2, False), (3, False), (3, True)]


@pytest.mark.parametrize("mode", ["plain", "clip", "fp16"])
@pytest.mark.parametrize(("stage", "offload_params"), CASES, ids=["s1", "s2", "s3", "s3-param-offload"])
def test_overlapped_step_equals_step_after_backward_bitwise(stage, offload_params, mode):
    base = _train(stage, offload_params, overlap=False, mode=mode)
    over = _train(stage, offload_params, overlap=True, mode=mode)
    a, b = _state(base), _state(over)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    early = over.offload.stepper.submitted  # buckets stepped during backward: all of them, unless a global scale
    assert early == (4 * len(over.flat_params) if mode == "plain" else 0)
    n_steps = 4 - (mode == "fp16")  # the overflow step is skipped everywhere
    assert all(a[k].item() == n_steps for k in a if k.endswith(".step"))
    with base.gathered():
        wa = {k: v.clone() for k, v in base.module.state_dict().items()}
    with over.gathered():
        wb = over.module.state_dict()
        for k, v in wa.items():
            assert torch.equal(v, wb[k]), k
    base.remove_hooks()
    over.remove_hooks()


def test_clipping_after_an_early_step_is_refused():
    """Buckets stepped during backward cannot be clipped any more: a clear error, not a silently unclipped step."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = ZeroEngine(
        model, opt, ZeroConfig(stage=2, offload_optimizer=True, overlap_step=True, reduce_bucket_size=3000)
    )
    batch = _batches(1)[0]
    logits = model(batch[:, :-1])
    F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
    engine.finish_backward()
    with pytest.raises(RuntimeError, match="already stepped during backward.*global_scale_expected"):
        engine.clip_grad_norm_(1.0)
    engine.optimizer.step()
    engine.after_step()
    engine.remove_hooks()


def test_overlap_step_needs_offload():
    with pytest.raises(ValueError, match=r"overlap_step=True.*needs offload_optimizer=True"):
        ZeroConfig(stage=2, overlap_step=True)


def test_a_bucket_step_starts_before_backward_ends():
    """The ordering trace: the first buckets (the last layers) are stepped on the worker while backward still runs
    through the earlier layers; every bucket is stepped exactly once."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(8)]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.Tanh())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZeroConfig(
        stage=2, offload_optimizer=True, overlap_step=True, reduce_bucket_size=256 * 257, max_inflight_buckets=1
    )
    engine = ZeroEngine(model, opt, config)
    engine.offload.stepper.trace = True
    x = torch.randn(2048, 256)
    model(x).square().mean().backward()
    backward_end = time.perf_counter()
    engine.finish_backward()
    engine.optimizer.step()
    engine.after_step()
    events = engine.offload.stepper.events
    starts = [t for e, _, t in events if e == "step_start"]
    assert len(starts) == len(engine.flat_params) == 8
    assert sum(t < backward_end for t in starts) >= 1, (events, backward_end)
    assert all(engine.optimizer.state[fp.master]["step"] == 1 for fp in engine.flat_params)
    engine.remove_hooks()

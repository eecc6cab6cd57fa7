"""Several optimizers on one engine (a GAN, Lightning's manual optimization) against Lightning's DDP.

2 processes on gloo, same seed and data, fp32, 20 batches, two optimizers (Adam for the generator, AdamW with two
param groups for the discriminator). Three loops that differ in how gradients from one backward reach both optimizers'
parameters: Lightning's GAN example (the generator's backward reaches the discriminator), ``toggle_optimizer``, and one
backward per batch where the discriminator steps every second batch only, its gradients accumulating in between while
the generator zeroes and steps its own every batch. Losses and final parameters must agree within 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_ranks

from zeroshard.optim.sharded_optimizer import OptimizerSet

SCRIPT = Path(__file__).parent / "scripts" / "gan_runs.py"
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gan")
    runs = [{"name": "ddp_docs", "strategy": "ddp", "loop": "docs"}]
    runs += [{"name": f"stage{s}_docs", "strategy": "zeroshard", "stage": s, "loop": "docs"} for s in (1, 2, 3)]
    runs += [
        {"name": "stage2_docs_offload", "strategy": "zeroshard", "stage": 2, "loop": "docs", "offload": True},
        {"name": "ddp_toggle", "strategy": "ddp", "loop": "toggle"},
        {"name": "stage2_toggle", "strategy": "zeroshard", "stage": 2, "loop": "toggle"},
        {"name": "stage3_toggle_offload", "strategy": "zeroshard", "stage": 3, "loop": "toggle", "offload": True},
        # 20 batches: the generator steps 20 times, the discriminator 10 times
        {"name": "ddp_shared", "strategy": "ddp", "loop": "shared", "max_steps": 30},
        {"name": "stage1_shared", "strategy": "zeroshard", "stage": 1, "loop": "shared", "max_steps": 30},
        {"name": "stage3_shared", "strategy": "zeroshard", "stage": 3, "loop": "shared", "max_steps": 30},
        {"name": "stage2_shared_offload", "strategy": "zeroshard", "stage": 2, "loop": "shared", "max_steps": 30}
        | {"offload": True},
        {"name": "automatic", "strategy": "zeroshard", "loop": "automatic"},
        # checkpoints with two optimizers: 10 batches (one epoch), save, resume for the next 10 at another stage
        {"name": "ddp_half", "strategy": "ddp", "loop": "docs", "max_steps": 20, "save_ckpt": str(out / "ddp.ckpt")},
        {"name": "ddp_resumed", "strategy": "ddp", "loop": "docs", "resume_from": str(out / "ddp.ckpt")},
        {"name": "sharded_half", "strategy": "zeroshard", "stage": 3, "loop": "docs", "sharded": True}
        | {"max_steps": 20, "save_ckpt": str(out / "sharded")},
        {"name": "sharded_resumed", "strategy": "zeroshard", "stage": 2, "loop": "docs", "sharded": True}
        | {"resume_from": str(out / "sharded")},
        {"name": "full_half", "strategy": "zeroshard", "stage": 2, "loop": "docs", "max_steps": 20}
        | {"save_ckpt": str(out / "full.ckpt")},
        {
            "name": "full_resumed",
            "strategy": "zeroshard",
            "stage": 1,
            "loop": "docs",
            "resume_from": str(out / "full.ckpt"),
        },
        # bf16-mixed, then trainer.validate on float inputs
        {"name": "ddp_bf16", "strategy": "ddp", "loop": "docs", "precision": "bf16-mixed", "validate": True},
        {"name": "stage2_bf16", "strategy": "zeroshard", "stage": 2, "loop": "docs", "precision": "bf16-mixed"}
        | {"validate": True},
        {"name": "stage3_bf16", "strategy": "zeroshard", "stage": 3, "loop": "docs", "precision": "bf16-mixed"}
        | {"validate": True},
    ]
    run_ranks(SCRIPT, [str(out), json.dumps(runs)])
    return out


def _result(out: Path, name: str, rank: int) -> dict:
    return json.loads((out / f"{name}_rank{rank}.json").read_text())


def _losses(out: Path, name: str, rank: int) -> torch.Tensor:
    return torch.tensor(_result(out, name, rank)["losses"], dtype=torch.float64)


def _assert_same(out: Path, ref: str, other: str, n_batches: int) -> None:
    for rank in range(2):
        a, b = _losses(out, ref, rank), _losses(out, other, rank)
        assert a.shape == b.shape == (n_batches, 3), (ref, other, a.shape, b.shape)
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m, r=rank: f"{other} vs {ref}, rank {r}: {m}")
    pa, pb = torch.load(out / f"{ref}.pt"), torch.load(out / f"{other}.pt")
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{other} vs {ref}, {k}: {m}")


@pytest.mark.parametrize(
    "loop, others",
    [
        ("docs", ["stage1_docs", "stage2_docs", "stage3_docs", "stage2_docs_offload"]),
        ("toggle", ["stage2_toggle", "stage3_toggle_offload"]),
        ("shared", ["stage1_shared", "stage3_shared", "stage2_shared_offload"]),
    ],
)
def test_gan_loops_match_ddp(runs, loop, others):
    for other in others:
        _assert_same(runs, f"ddp_{loop}", other, 20)
    # the discriminator trained: its loss moved (a run that never stepped it would also "match" a broken reference)
    start, end = _losses(runs, f"ddp_{loop}", 0)[:3, 0].mean(), _losses(runs, f"ddp_{loop}", 0)[-3:, 0].mean()
    assert abs(end - start) > 1e-3, (start, end)


def test_automatic_optimization_with_two_optimizers_is_lightnings_error(runs):
    """Lightning allows several optimizers with manual optimization only; under ZeroStrategy its own error says so."""
    for rank in range(2):
        assert "only supported with manual optimization" in _result(runs, "automatic", rank)["error"]


def test_checkpoints_with_two_optimizers_resume_like_ddp(runs):
    """Sharded (saved at stage 3, resumed at stage 2) and full (stage 2 -> 1) checkpoints of both optimizers resume as
    Lightning's DDP resumes the same checkpoint. The reference is DDP's own resumed run: for this loop Lightning's
    resume leaves the uninterrupted run after its first batch under DDP too; that first batch is compared with it."""
    for resumed in ("sharded_resumed", "full_resumed"):
        _assert_same(runs, "ddp_resumed", resumed, 10)
        for rank in range(2):
            first = _losses(runs, resumed, rank)[0]
            torch.testing.assert_close(first, _losses(runs, "ddp_docs", rank)[10], rtol=RTOL, atol=ATOL)


def test_bf16_mixed_fit_leaves_fp32_parameters_at_stages_1_2(runs):
    """After a bf16-mixed fit the module's parameters are fp32 at stage 2 (the master weights), as under DDP, and
    validation on float inputs then runs under autocast; stage 3 keeps bf16 shards. Losses within bf16 tolerance."""
    assert _result(runs, "ddp_bf16", 0)["dtypes"] == ["torch.float32"]
    assert _result(runs, "stage2_bf16", 0)["dtypes"] == ["torch.float32"]
    assert _result(runs, "stage3_bf16", 0)["dtypes"] == ["torch.bfloat16"]
    ref = _result(runs, "ddp_bf16", 0)["val_err_d"]
    for name in ("stage2_bf16", "stage3_bf16"):
        assert abs(_result(runs, name, 0)["val_err_d"] - ref) < 2e-2 * abs(ref), name
        torch.testing.assert_close(_losses(runs, name, 0), _losses(runs, "ddp_bf16", 0), rtol=3e-2, atol=3e-2)
    pa, pb = torch.load(runs / "ddp_bf16.pt"), torch.load(runs / "stage2_bf16.pt")
    for k in pa:
        rel = ((pb[k] - pa[k]).norm() / pa[k].norm().clamp_min(1e-12)).item()
        assert pb[k].dtype == torch.float32 and rel < 5e-2, (k, pb[k].dtype, rel)


def test_a_parameter_in_two_optimizers_is_refused():
    p = torch.nn.Parameter(torch.zeros(3, 4))
    q = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"shape \(3, 4\) is in optimizers 0 and 1"):
        OptimizerSet([torch.optim.SGD([p, q], lr=0.1), torch.optim.Adam([p], lr=0.1)])
    other = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    optimizers = OptimizerSet([torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=0.1), other])
    assert optimizers.group_optimizer == [0, 0, 1]
    assert optimizers.group_slice(1) == slice(2, 3)

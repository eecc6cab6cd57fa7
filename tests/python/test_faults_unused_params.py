"""Parameters no rank uses keep DDP's ``grad = None`` semantics (issue 18, case 13): after several AdamW steps with
weight decay they equal DDP(find_unused_parameters=True)'s, that is, their initial values, at stages 1-3 and stages 2-3
with optimizer offload. A parameter only one rank uses is averaged with the other rank's zeros, as under DDP. The
reference is torch's DistributedDataParallel on the same seed and data, 2 gloo ranks (one launch for every case).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "unused_runs.py"
ZERO = {
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage2_offload": {"stage": 2, "offload": True},
    "stage3_offload": {"stage": 3, "offload": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("unused")
    plan = [{"name": "ddp", "strategy": "ddp"}]
    plan += [{"name": name, "strategy": "zeroshard", **cfg} for name, cfg in ZERO.items()]
    run_ranks(SCRIPT, [str(out), json.dumps(plan)], timeout=600)
    return out


def _params(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.pt")


def test_ddp_leaves_unused_parameters_alone(runs):
    """The reference itself: DDP's never-used parameters keep their initial values (weight decay 0.1 would move
    them), and the one rank 0 uses moves."""
    initial = torch.load(runs / "initial.pt")
    ddp = _params(runs, "ddp")
    for k in ("never.weight", "never.bias", "never_block.up.weight", "never_block.norm.weight"):
        assert torch.equal(ddp[k], initial[k]), k
    assert not torch.equal(ddp["rank0_only.weight"], initial["rank0_only.weight"])


@pytest.mark.parametrize("config", list(ZERO))
def test_unused_parameters_equal_ddp(runs, config):
    """Every parameter (never used, used on rank 0 only, used everywhere) equals DDP's after 5 AdamW steps."""
    ref, got = _params(runs, "ddp"), _params(runs, config)
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{config} {k}: {m}")
    for rank in range(2):
        a = json.loads((runs / f"ddp_rank{rank}.json").read_text())["losses"]
        b = json.loads((runs / f"{config}_rank{rank}.json").read_text())["losses"]
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)

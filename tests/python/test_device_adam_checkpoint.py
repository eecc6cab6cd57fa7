"""Sharded checkpoints of ``DeviceAdam`` state (bf16 / int8, no offload; ``scripts/state_format_ckpt.py`` with the
``*_dev`` formats): saved as kept, resumed bit for bit at the same shards, resharded 2 -> 3 ranks by the kernel's rule,
and interchangeable with the fused kernel's: the int8 run stepped by ``DeviceAdam`` on the engine's master shards saves
the same state and continues to the same weights as ``CPUAdam`` (the C++ kernel) on the same shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "state_format_ckpt.py"
FMTS = ("int8_dev", "bf16_dev", "int8_cpu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("device_adam_ckpt")
    run_ranks(SCRIPT, ["save", str(out), ",".join(FMTS)])
    return out


def test_device_adam_state_equals_the_kernels(saved):
    for rank in range(2):
        dev, kernel = (
            torch.load(saved / "int8_dev" / f"state_r{rank}.pt"),
            torch.load(saved / "int8_cpu" / f"state_r{rank}.pt"),
        )
        assert len(dev) == len(kernel) > 0
        # the small parameters' flat shards keep fp32 moments (no absmax), the others int8: both optimizers alike
        assert any("exp_avg_absmax" in a for a in dev) and not all("exp_avg_absmax" in a for a in dev)
        for a, b in zip(dev, kernel):
            assert a.keys() == b.keys()
            for k in a.keys() & {"exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"}:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    continued = [torch.load(saved / f / "continued.pt") for f in ("int8_dev", "int8_cpu")]
    torch.testing.assert_close(continued[0], continued[1], rtol=0, atol=0)


def test_resume_bit_for_bit_at_the_same_world_size(saved):
    run_ranks(SCRIPT, ["load", str(saved), "int8_dev,bf16_dev", "2"])
    for fmt in ("int8_dev", "bf16_dev"):
        report = json.loads((saved / fmt / "loaded_2_2.json").read_text())
        assert report["same_shards"] and report["checked"] > 0
        continued, resumed = torch.load(saved / fmt / "continued.pt"), torch.load(saved / fmt / "resumed.pt")
        torch.testing.assert_close(resumed, continued, rtol=0, atol=0)


def test_reshard_2_to_3_ranks(saved):
    run_ranks(SCRIPT, ["load", str(saved), "int8_dev,bf16_dev", "2"], world_size=3)
    for fmt in ("int8_dev", "bf16_dev"):
        report = json.loads((saved / fmt / "loaded_3_2.json").read_text())
        assert not report["same_shards"] and report["checked"] > 0, report

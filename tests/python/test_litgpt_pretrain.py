"""``litgpt.pretrain.main``, LitGPT's own pretraining entry point, unpatched, with ZeroFabricStrategy at stage 3
(``examples/litgpt_pretrain.py``) against the same run under Fabric's DDP: 2 gloo ranks, same seed and data.

LitGPT builds under ``fabric.init_module(empty_init=True)``, overrides ``reset_parameters`` in its
``initialize_weights``, sets the model up before creating the optimizer, wraps it in ``torch.compile``, clips
gradients, validates, and saves its final checkpoint with ``fabric.save``. Every logged training loss must match DDP's
within 1e-5 relative, and the run must leave its checkpoint.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from launch import REPO, run_ranks

SCRIPT = REPO / "examples" / "litgpt_pretrain.py"


def _metrics(out: Path) -> tuple[list[float], float]:
    (path,) = out.glob("logs/*/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    losses = [float(r["loss"]) for r in rows if r.get("loss")]
    val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    return losses, val[-1]


def test_litgpt_pretrain_main_at_stage_3_matches_ddp(tmp_path):
    pytest.importorskip("litgpt")
    small = ["--max-tokens", "4096", "--max-bytes", str(1 << 18)]  # 8 optimizer steps per rank
    run_ranks(SCRIPT, ["--strategy", "ddp", "--out-dir", str(tmp_path / "ddp"), *small])
    outputs = run_ranks(SCRIPT, ["--stage", "3", "--out-dir", str(tmp_path / "zero"), *small])
    ddp_losses, ddp_val = _metrics(tmp_path / "ddp")
    losses, val = _metrics(tmp_path / "zero")
    assert len(losses) == len(ddp_losses) == 8
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=1e-5, atol=0)
    assert val == pytest.approx(ddp_val, rel=1e-5)
    assert losses[-1] < losses[0]  # it trained
    checkpoint = tmp_path / "zero" / "final" / "lit_model.pth"
    assert (checkpoint / "LATEST").is_file() and (checkpoint.parent / "model_config.yaml").is_file()
    assert "Final evaluation" in outputs[0]

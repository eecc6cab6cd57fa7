"""The main job end to end: examples/train_gpt.py through Lightning's own launcher (devices=2 re-runs the script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "extra",
    [["--stage", "2"], ["--stage", "1", "--offload_optimizer"], ["--stage", "3"]],
    ids=["stage2", "stage1_offload", "stage3"],
)
def test_train_gpt_smoke(tmp_path, extra):
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        str(REPO / "examples" / "train_gpt.py"),
        *("--n_layer 1 --n_embd 64 --n_head 2 --block_size 32 --batch_size 8 --max_steps 12".split()),
        *("--val_check_interval 6 --limit_val_batches 2 --sample_tokens 20".split()),
        "--summary_json",
        str(summary),
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(summary.read_text())
    assert out["world_size"] == 2
    assert len(out["ranks"]) == 2
    assert all(r["tokens_per_s"] > 0 and r["host_peak_mib"] > 0 for r in out["ranks"])
    assert out["last_train_loss"] < out["first_train_loss"]
    assert out["val_losses"], "validation did not run"
    assert "tokens/s" in proc.stdout and "sample" in proc.stdout

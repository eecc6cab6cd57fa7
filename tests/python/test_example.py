"""The main job end to end: examples/train_gpt.py through Lightning's own launcher (devices=2 re-runs the script)."""

from __future__ import annotations

import csv
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
    assert "largest GPT this machine could train" in proc.stdout and "DDP" in proc.stdout
    assert out["largest_params"]["stage 3"] >= out["largest_params"]["DDP"] > 0
    check_logs_and_picture(tmp_path, out, proc.stdout)


def check_logs_and_picture(cwd: Path, out: dict, stdout: str) -> None:
    """The default CSV logger wrote runs/train_gpt/version_0/metrics.csv (train loss per step, val loss per validation,
    tokens/s per rank) and a readable loss.png beside it, whose path the run printed."""
    log_dir = cwd / "runs" / "train_gpt" / "version_0"
    assert Path(out["log_dir"]) == log_dir.resolve()
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {"step", "train_loss", "val_loss", "tokens_per_s/rank0", "tokens_per_s/rank1"} <= set(rows[0])

    def steps(column: str) -> list[int]:
        return [int(r["step"]) for r in rows if r[column]]

    assert steps("train_loss") == list(range(12)), "train loss not logged once per step"
    assert len(steps("val_loss")) == 2
    assert steps("tokens_per_s/rank0") == steps("tokens_per_s/rank1") != []
    assert all(float(r["tokens_per_s/rank1"]) > 0 for r in rows if r["tokens_per_s/rank1"])

    png = log_dir / "loss.png"
    assert Path(out["plot"]) == png.resolve() and "loss curves: runs/train_gpt/version_0/loss.png" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    image = imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.min() < image.max(), "blank picture"


def test_fine_tune_from_a_consolidated_checkpoint(tmp_path):
    """train -> sharded checkpoint -> `python -m zeroshard.consolidate` -> `--init_from` at stage 3: the new run starts
    from the trained weights (each rank reading its shards' slices), so its first loss is the old run's last."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    tiny = "--n_layer 1 --n_embd 64 --n_head 2 --block_size 32 --batch_size 8 --sample_tokens 0".split()
    script = str(REPO / "examples" / "train_gpt.py")

    def train(*extra: str) -> dict:
        summary = tmp_path / f"summary{len(list(tmp_path.glob('summary*')))}.json"
        cmd = [sys.executable, script, *tiny, "--summary_json", str(summary), *extra]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(summary.read_text())

    first = train("--max_steps", "30", "--save_ckpt", str(tmp_path / "ckpt"))
    cmd = [sys.executable, "-m", "zeroshard.consolidate", str(tmp_path / "ckpt"), str(tmp_path / "weights")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tuned = train("--max_steps", "2", "--stage", "3", "--init_from", str(tmp_path / "weights" / "model.safetensors"))
    assert first["first_train_loss"] - first["last_train_loss"] > 0.5, first["loss_curve"]
    assert tuned["first_train_loss"] < first["first_train_loss"] - 0.4, (tuned["loss_curve"], first["loss_curve"])

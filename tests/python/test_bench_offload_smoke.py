"""benchmarks/bench_offload.py --smoke: every config it can run here trains the same GPT on the same data (zeroshard
with and without offload against FSDP2, the independent reference), and the DeepSpeed rows say why they are skipped
when DeepSpeed is not importable (it lives in the benchmark's own venv), so the GPU run finds a working script."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_offload_smoke_rows_agree_with_fsdp2(tmp_path):
    configs = ",".join(["zeroshard_no_offload", "zeroshard_opt_offload", "zeroshard_opt_param_offload",
                        "deepspeed_opt_offload", "fsdp2_cpu_offload"])  # fmt: skip
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_offload.py"), "--smoke", "--configs", configs,
           "--out", str(tmp_path)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(REPO / "examples")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("offload_smoke_*.json")
    rows = {r["config"]: r for r in json.loads(path.read_text())["rows"]}
    ref = rows["fsdp2_cpu_offload"]["losses"]
    for name in ("zeroshard_no_offload", "zeroshard_opt_offload", "zeroshard_opt_param_offload"):
        assert rows[name]["losses"] == pytest.approx(ref, rel=1e-4), name
    if importlib.util.find_spec("deepspeed") is None:
        assert "deepspeed is not importable" in rows["deepspeed_opt_offload"]["skipped"]
    else:
        assert rows["deepspeed_opt_offload"]["losses"] == pytest.approx(ref, rel=1e-3)

"""ZeRO stage 3 under Lightning's spawn and fork launchers (issue 17).

Lightning's ``_MultiProcessingLauncher`` calls ``state_dict()`` on every rank at the end of each Trainer entry point
and saves it on rank 0 only. At stage 3 that used to start an all-gather only rank 0 joined. ``fit``, ``validate``,
``test`` and ``predict`` must finish, and the main process must get the trained weights: the ones every rank held at
the end of fit. Also: Lightning's ``ModelPruning`` at stage 3 fails before training, naming pruning and stage 3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "launcher_runs.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_stage3_spawn_and_fork(tmp_path, method):
    proc = _run(method, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    main, rank0, rank1 = (torch.load(tmp_path / f"{n}.pt") for n in ("main", "rank0", "rank1"))
    assert main.keys() == rank0.keys() == {"layer.weight", "layer.bias"}
    for k in main:
        assert torch.equal(rank0[k], rank1[k]), k
        assert torch.equal(main[k], rank0[k]), f"{k}: the main process did not get the trained weights"
    results = torch.load(tmp_path / "results.pt")
    if method == "spawn":
        assert results == {"predict": "done"}
    else:
        assert torch.isfinite(torch.tensor(results["validate"][0]["val_loss"]))
        assert torch.isfinite(torch.tensor(results["test"][0]["test_loss"]))


def test_pruning_at_stage3_is_refused(tmp_path):
    proc = _run("spawn", str(tmp_path), "prune")
    assert proc.returncode != 0
    err = proc.stderr
    assert "ZeroStrategy(stage=3) cannot run the ModelPruning callback" in err, err[-4000:]
    assert "stage=2" in err

"""Runs a script as N ranks on this machine, the way torchrun does (env:// rendezvous, gloo on CPU).

Lightning sees ``LOCAL_RANK`` and treats the processes as created externally, so one script can run several
``Trainer.fit`` calls in a row over the same process group. Every run has a deadline: a rank that hangs is killed and
the test fails with every rank's output, never a silent hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str | Path, args: list[str], world_size: int = 2, timeout: float = 600.0) -> list[str]:
    """Starts ``world_size`` copies of ``script`` and waits for all; returns each rank's combined output.

    Raises:
        AssertionError: if a rank fails or the deadline passes, with the output of every rank.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(
                [str(REPO / "python"), str(REPO / "tests" / "python"), env.get("PYTHONPATH", "")]
            ),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs, failed = [], False
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n[rank {rank} killed after {timeout} s]"
            failed = True
        failed |= p.returncode != 0
        outputs.append(out)
    if failed:
        report = "\n".join(
            f"===== rank {r} (exit {p.returncode}) =====\n{o[-6000:]}" for r, (p, o) in enumerate(zip(procs, outputs))
        )
        raise AssertionError(f"{script} failed:\n{report}")
    return outputs

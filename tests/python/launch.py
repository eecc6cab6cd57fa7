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

    The rendezvous port is picked free, but another process may take it before rank 0 binds it (parallel test workers
    do): rank 0 then fails at once with EADDRINUSE, and the run starts again on a new port (at most 3 tries) instead of
    leaving the other ranks waiting for a store that will never come.

    Raises:
        AssertionError: if a rank fails or the deadline passes, with the output of every rank.
    """
    for _ in range(3):
        procs, outputs, failed, port_taken = _launch(script, args, world_size, timeout)
        if not port_taken:
            break
    if failed:
        report = "\n".join(
            f"===== rank {r} (exit {p.returncode}) =====\n{o[-6000:]}" for r, (p, o) in enumerate(zip(procs, outputs))
        )
        raise AssertionError(f"{script} failed:\n{report}")
    return outputs


def _launch(script: str | Path, args: list[str], world_size: int, timeout: float):
    """One run: ``(processes, outputs, failed, port_taken)``; ``port_taken``: rank 0 could not bind the port."""
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
        if rank == 0 and p.returncode != 0 and "EADDRINUSE" in out:
            for q in procs[1:]:
                q.kill()
            outputs += [q.communicate()[0] for q in procs[1:]]
            return procs, outputs, True, True
    return procs, outputs, failed, False

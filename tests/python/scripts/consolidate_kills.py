"""Runs ``python -m zeroshard.consolidate`` jobs, each in a forked child that may SIGKILL itself at a named step
(``ZEROSHARD_TEST_KILL_AT``), and records after each job its exit status and what is on disk: the imports are paid
once, not per job (tests/python/test_faults_consolidate.py).

Usage: consolidate_kills.py JOBS.json RESULTS.json
    JOBS.json: ``{scenario: [{"argv": [...], "kill": "consolidate_file" | null, "snap": DIR}, ...]}``, in order.
    RESULTS.json: ``{scenario: [per job {"rc": exit status (-9: killed), "files": {path under DIR: sha256 or
    "dir"}}]}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch

from zeroshard.consolidate import main

KILL = "ZEROSHARD_TEST_KILL_AT"


def run(argv: list[str], kill: str | None) -> int:
    pid = os.fork()
    if pid == 0:
        os.environ.pop(KILL, None)
        if kill:
            os.environ[KILL] = kill
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def snapshot(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(d.rglob("*"))
        if not p.is_symlink()
    }


def main_() -> None:
    torch.set_num_threads(1)  # no thread pool in the parent: the children are forked
    jobs = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for scenario, steps in jobs.items():
        results[scenario] = []
        for job in steps:
            rc = run(job["argv"], job["kill"])
            results[scenario].append({"rc": rc, "files": snapshot(Path(job["snap"]))})
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main_()

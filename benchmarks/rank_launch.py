"""Shared by the multi-process benchmarks (bench_train.py, soak_memory.py): start one process per rank of a script's
own rank mode on 127.0.0.1, collect each rank's JSON, and describe the machine and versions for the result files."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, name: str, args: argparse.Namespace, rank_args: tuple[str, ...], tmp: Path):
    """Runs ``script --rank_of name`` as ``args.devices`` ranks within ``args.timeout`` seconds; each rank writes
    ``rank{r}.json`` to its ``--rank_out`` directory. Returns (per-rank results or None, wall s, error text)."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"{name}_", dir=tmp))  # a config may be listed twice
    port = free_port()
    cmd = [sys.executable, script, "--rank_of", name, "--rank_out", str(out_dir)]
    cmd += [f"--{k}={getattr(args, k)}" for k in rank_args]
    procs, logs = [], []
    t0 = time.perf_counter()
    for rank in range(args.devices):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.devices),
                   RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
        logs.append((out_dir / f"rank{rank}.log").open("w"))
        procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    failed = False
    for p in procs:
        try:
            failed |= p.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - t0))) != 0
        except subprocess.TimeoutExpired:
            failed = True
            for q in procs:
                q.kill()
            p.wait()
    wall = time.perf_counter() - t0
    for f in logs:
        f.close()
    if failed:
        tails = [f"--- rank {r} (exit {p.returncode}) ---\n" + (out_dir / f"rank{r}.log").read_text()[-3000:]
                 for r, p in enumerate(procs)]  # fmt: skip
        return None, wall, "\n".join(tails)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(args.devices)], wall, ""


def machine() -> dict:
    model = platform.processor()
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    return {"hostname": socket.gethostname(), "cpu_model": model, "logical_cpus": os.cpu_count(),
            "platform": platform.platform()}  # fmt: skip


def versions() -> dict:
    import lightning
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__}
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        v["gpu"] = torch.cuda.get_device_name(0)
    return v


def gpt_step_parser(description: str, json_path: Path, **defaults) -> argparse.ArgumentParser:
    """The arguments of the two-rank GPT step benchmarks (bench_module_grads, bench_nonfinite, bench_gather_check):
    model size, batch, timed and warm-up rounds, the result file; ``defaults`` overrides any of them."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (one step of each engine per round)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=str(json_path))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(**defaults)
    return p


def worker_or_two_ranks(script: Path, args: argparse.Namespace, worker) -> None:
    """Runs ``worker(args)`` when this process is a rank (``--worker``); otherwise starts ``script`` as 2 gloo ranks
    (tests/python/launch.py) and prints rank 0's output."""
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
    from launch import run_ranks

    outs = run_ranks(script, [*sys.argv[1:], "--worker"], world_size=2, timeout=3600)
    print(outs[0])

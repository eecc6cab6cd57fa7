"""Run Lightning's own multi-process CPU tests with zeroshard in place of DDP (``make peer-test``).

Lightning's tests of its Trainer and Fabric under DDP (strategies, callbacks, checkpointing, loops, logging,
precision, ...) are a test suite written by others for exactly the contract ZeroStrategy claims to honour: "a drop-in
for DDP". This runs them unchanged, one pytest process per test, under three configs:

    ddp  Lightning's own DDP (the baseline: a test that fails here says nothing about zeroshard)
    2    every DDP strategy the test asks for replaced by ZeroStrategy/ZeroFabricStrategy at stage 2
    3    the same at stage 3

Steps: get Lightning's test sources for the installed version (``tests/peer/peer_sources.py``); collect and select
the multi-process CPU tests (``tests/peer/peer_select.py``, cached per source tree); run each selected test as
``python -m pytest -x -q -p zeroshard_peer <id>`` from Lightning's ``tests/`` folder with ``ZEROSHARD_PEER_STAGE``
set (``tests/peer/zeroshard_peer.py`` substitutes the strategy and records launches and outcomes). At stages 2 and 3
only the tests that passed under ddp and started 2+ processes run (``--all`` runs every selected test); the stage
pass rates are over those. Results merge into ``benchmarks/results/peer_lightning.{json,md}`` (``--fresh`` starts
over), so ``--only-failed benchmarks/results/peer_lightning.json`` re-runs just the failures after a fix.

    python benchmarks/peer_lightning.py                       # ddp, then stages 2 and 3
    python benchmarks/peer_lightning.py --configs 2,3 --jobs 2
    python benchmarks/peer_lightning.py --only-failed benchmarks/results/peer_lightning.json --configs 3
    python benchmarks/peer_lightning.py --list -k checkpoint
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "build" / "peer"
PLUGINS = ROOT / "tests" / "peer"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(PLUGINS))

from peer_report import counts_for_goal, write_report  # noqa: E402
from peer_sources import get_sources  # noqa: E402

CONFIGS = ("ddp", "1", "2", "3")
# Inherited rank variables would make Lightning think it runs inside a launched job.
RANK_VARIABLES = ("LOCAL_RANK", "RANK", "GLOBAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="ddp,2,3", help="comma-separated, from ddp,1,2,3 (default: ddp,2,3)")
    p.add_argument("--jobs", type=int, default=1, help="tests run at once (each test starts 2+ processes itself)")
    p.add_argument("-k", dest="keyword", action="append", default=[], help="only test ids containing this")
    p.add_argument("--list", action="store_true", help="list the selection and exit")
    p.add_argument("--timeout", type=float, default=300, help="seconds per test; past it the test fails as timeout")
    p.add_argument("--only-failed", type=Path, help="results JSON: re-run only the tests that failed there")
    p.add_argument("--all", action="store_true", help="at stages, also run tests that did not pass under ddp")
    p.add_argument("--recollect", action="store_true", help="collect the selection again")
    p.add_argument("--fresh", action="store_true", help="do not merge into the existing results")
    p.add_argument("--out", type=Path, default=RESULTS / "peer_lightning.json")
    args = p.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {','.join(CONFIGS)}")
    return args


# -- selection ------------------------------------------------------------------------------------------------------


def collect(src: Path, recollect: bool) -> dict:
    """Collect Lightning's tests and classify each (peer_select.py); cached until the source or the rules change."""
    rules = hashlib.sha256((PLUGINS / "peer_select.py").read_bytes()).hexdigest()[:12]
    cache = PEER / f"selection-{src.name}-{rules}.json"
    if cache.exists() and not recollect:
        return json.loads(cache.read_text())
    out = PEER / "collected.json"
    command = [
        *("-m", "pytest", "--collect-only", "-q", "-p", "peer_select", "-p", "no:cacheprovider"),
        *("--continue-on-collection-errors", "tests_pytorch", "tests_fabric"),
    ]
    print(f"collecting Lightning's tests in {src / 'tests'} ...", flush=True)
    env = test_env({"ZEROSHARD_PEER_SELECT_OUT": str(out)}, standalone=False)
    done = subprocess.run([sys.executable, *command], cwd=src / "tests", env=env, capture_output=True, text=True)
    errors = re.findall(r"^ERROR (\S+)(?: - (.*))?$", done.stdout, re.M)
    rows = json.loads(out.read_text())
    for row in rows:
        row["id"] = row["id"].removeprefix("tests/")  # node ids are relative to Lightning's root; we run in tests/
    selection = {
        "how": (
            f"cd <lightning>/tests && python {' '.join(command)}; rules in tests/peer/peer_select.py (sha {rules}); "
            "at stages, only tests that passed under ddp and launched 2+ processes run"
        ),
        "collected": len(rows),
        "collection_errors": [f"{path}: {why}" for path, why in errors],
        "tests": rows,
    }
    cache.write_text(json.dumps(selection, indent=1))
    return selection


# -- running one test -----------------------------------------------------------------------------------------------


def test_env(extra: dict, standalone: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES and k != "PL_RUN_STANDALONE_TESTS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH")]))
    if standalone:
        env["PL_RUN_STANDALONE_TESTS"] = "1"  # Lightning's CI runs these one per process with this set
    return env | extra


def safe_name(test_id: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id)
    return name[:150] + "-" + hashlib.sha256(test_id.encode()).hexdigest()[:8]


class Workers:
    """One copy of Lightning's test tree per job: its conftest fails a test that leaves files in the tree, which a
    test running beside it would otherwise do."""

    def __init__(self, src: Path, jobs: int) -> None:
        self.free = []
        for i in range(jobs):
            root = PEER / "work" / f"w{i}"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(src / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy2(src / "pyproject.toml", root / "pyproject.toml")
            (PEER / "tmp" / f"w{i}").mkdir(parents=True, exist_ok=True)
            self.free.append(i)
        self.lock = threading.Lock()

    def take(self) -> int:
        with self.lock:
            return self.free.pop()

    def give(self, i: int) -> None:
        with self.lock:
            self.free.append(i)


def run_one(test: dict, config: str, worker: int, timeout: float) -> dict:
    name = safe_name(test["id"])
    record = PEER / "records" / config / f"{name}.jsonl"
    log = PEER / "logs" / config / f"{name}.log"
    for path in (record, log):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
    env = test_env(
        {
            "ZEROSHARD_PEER_STAGE": config,
            "ZEROSHARD_PEER_RECORD": str(record),
            "PYTEST_DEBUG_TEMPROOT": str(PEER / "tmp" / f"w{worker}"),  # away from other pytest runs' tmp dirs
        },
        standalone=test["standalone"],
    )
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "zeroshard_peer", "-p", "no:cacheprovider"]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*command, test["id"]],
            cwd=PEER / "work" / f"w{worker}" / "tests",
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout ends the ranks it started too
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # ranks left behind by a failed test
            except ProcessLookupError:
                pass
            proc.wait()
    seconds = round(time.monotonic() - start, 1)
    return {"seconds": seconds, "log": str(log.relative_to(ROOT))} | outcome(record, log, proc.pid, code, timeout)


def outcome(record: Path, log: Path, pid: int, code: int | None, timeout: float) -> dict:
    events = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    launched = max((e["processes"] for e in events if e["event"] == "launch"), default=0)
    substituted = sum(e["event"] == "substituted" for e in events)
    facts = {"launched": launched, "substituted": substituted, "exit_code": code}
    if code is None:
        return facts | {"outcome": "failed", "error": f"timeout after {timeout:.0f} s"}
    reports = [e for e in events if e["event"] == "report"]
    mine = [e for e in reports if e["pid"] == pid]
    failed = [e for e in mine if e["outcome"] == "failed"] + [
        e for e in reports if e["pid"] != pid and e["outcome"] == "failed"
    ]
    if failed:
        error = failed[0]["error"] if failed[0]["pid"] == pid else f"(rank {failed[0]['rank']}) {failed[0]['error']}"
        return facts | {"outcome": "failed", "error": error}
    if any(e["outcome"] in ("skipped", "xfailed") for e in mine):
        return facts | {"outcome": "skipped", "error": ""}
    if code == 0 and any(e["when"] == "call" and e["outcome"] == "passed" for e in mine):
        return facts | {"outcome": "passed", "error": ""}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    error_lines = [line for line in lines if line.startswith("E ")]
    last = (error_lines or lines or [f"exit code {code}"])[-1]
    return facts | {"outcome": "failed", "error": f"exit code {code}: {last.strip()[:300]}"}


# -- the run --------------------------------------------------------------------------------------------------------


def to_run(tests: list[dict], config: str, results: dict, args) -> list[dict]:
    if args.only_failed:
        previous = json.loads(args.only_failed.read_text())["results"].get(config, {})
        tests = [t for t in tests if previous.get(t["id"], {}).get("outcome") == "failed"]
    baseline = results.get("ddp", {})
    if config == "ddp" or args.all or not baseline:
        return tests
    return [t for t in tests if t["id"] not in baseline or counts_for_goal(baseline[t["id"]])]


def run_config(config: str, tests: list[dict], workers: Workers, args) -> dict:
    results: dict = {}
    started = time.monotonic()
    done_count = 0
    print(f"\n== config {config}: {len(tests)} tests, {args.jobs} at a time", flush=True)

    def job(test: dict) -> None:
        nonlocal done_count
        worker = workers.take()
        try:
            result = run_one(test, config, worker, args.timeout)
        finally:
            workers.give(worker)
        result["zeroshard_commit"] = zeroshard_commit()
        result["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with workers.lock:
            results[test["id"]] = result
            done_count += 1
            elapsed = time.monotonic() - started
            eta = elapsed / done_count * (len(tests) - done_count)
            mp = f"{result['launched']}p" if result["launched"] else "1p"
            error = f"  {result['error'][:160]}" if result["error"] else ""
            print(
                f"[{done_count:4d}/{len(tests)}] {config:>3} {result['outcome']:<7} {result['seconds']:6.1f}s {mp:>3}"
                f"  ETA {eta / 60:5.1f} min  {test['id']}{error}",
                flush=True,
            )

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(job, tests))
    return results


_COMMIT: list[str] = []


def zeroshard_commit() -> str:
    if not _COMMIT:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "python/zeroshard"], capture_output=True, text=True)
        _COMMIT.append(head + ("+uncommitted" if dirty.stdout.strip() else ""))
    return _COMMIT[0]


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
    return {"cpu": model.group(1) if model else "unknown", "cores": os.cpu_count()}


def versions() -> dict:
    import lightning
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "lightning": lightning.__version__}


def main() -> None:
    args = parse_args()
    import lightning

    src, origin = get_sources(lightning.__version__, PEER, sys.executable)
    print(f"Lightning's tests: {src} ({origin['from']}, {origin['ref']}, {origin['commit'][:12]})", flush=True)
    selection = collect(src, args.recollect)
    selected = [t for t in selection["tests"] if t["selected"]]
    tests = [t for t in selected if all(k in t["id"] for k in args.keyword)]
    if args.list:
        for t in tests:
            print(t["id"] + ("   [standalone]" if t["standalone"] else ""))
        print(f"{len(tests)} selected of {selection['collected']} collected", file=sys.stderr)
        return

    previous = {} if args.fresh or not args.out.exists() else json.loads(args.out.read_text())
    results = previous.get("results", {})
    workers = Workers(src, args.jobs)
    wall = time.monotonic()
    ran = {}
    for config in args.configs:
        ran[config] = run_config(config, to_run(tests, config, results, args), workers, args)
        results.setdefault(config, {}).update(ran[config])
    run = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - wall),
        "tests_run": {config: len(results_run) for config, results_run in ran.items()},
        "zeroshard": zeroshard_commit(),
    }
    report = {
        "runs": previous.get("runs", []) + [run],
        "machine": machine(),
        "versions": versions() | {"zeroshard": zeroshard_commit()},
        "lightning_tests": origin,
        "selection": {k: v for k, v in selection.items() if k != "tests"} | {"selected": len(selected)},
        "results": results,
    }
    write_report(report, args.out, selection["tests"])


if __name__ == "__main__":
    main()

"""The table of ``benchmarks/peer_lightning.py``: counts per config, pass rates over the tests that measure
zeroshard (those Lightning's DDP passes with 2+ processes), and every failure with its last error line, grouped by
that line with numbers and quoted names masked (one group is usually one cause)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path


def counts_for_goal(ddp_result: dict | None) -> bool:
    """A test measures zeroshard only if Lightning's DDP passes it and it starts 2+ processes."""
    return bool(ddp_result) and ddp_result["outcome"] == "passed" and ddp_result.get("launched", 0) >= 2


def cause(error: str) -> str:
    masked = re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?", "N", error)
    masked = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "'…'", masked)
    return masked[:140]


def summarize(results: dict, selected: set[str]) -> tuple[list[str], dict]:
    """Markdown lines and the summary numbers."""
    baseline = {t: r for t, r in results.get("ddp", {}).items() if t in selected}
    goal = {t for t, r in baseline.items() if counts_for_goal(r)}
    summary: dict = {"goal_tests": len(goal)}
    lines = [
        f"| config | tests run | passed | failed | skipped | passed, of the {len(goal)} DDP passes with 2+ processes |",
        "|---|---|---|---|---|---|",
    ]
    for config in sorted(results, key=lambda c: (c != "ddp", c)):
        rows = {t: r for t, r in results[config].items() if t in selected}
        n = {o: sum(r["outcome"] == o for r in rows.values()) for o in ("passed", "failed", "skipped")}
        in_goal = {t: r for t, r in rows.items() if t in goal}
        goal_passed = sum(r["outcome"] == "passed" for r in in_goal.values())
        not_run = len(goal - set(in_goal))
        rate = f"{goal_passed} ({100 * goal_passed / len(goal):.0f}%)" if goal else "-"
        if not_run:
            rate += f", {not_run} not run"
        name = "ddp (Lightning, baseline)" if config == "ddp" else f"zeroshard stage {config}"
        lines.append(f"| {name} | {len(rows)} | {n['passed']} | {n['failed']} | {n['skipped']} | {rate} |")
        summary[config] = n | {"run": len(rows), "goal_passed": goal_passed, "goal_not_run": not_run}

    single = sorted(t for t, r in baseline.items() if r["outcome"] == "passed" and r.get("launched", 0) < 2)
    failed = {t: r for t, r in baseline.items() if r["outcome"] == "failed"}
    lines += ["", f"Baseline failures (fail under Lightning's own DDP here; excluded from the rates): {len(failed)}"]
    lines += _grouped(failed)
    lines += ["", f"Selected, passed under ddp, but started no 2+ processes (excluded): {len(single)}"]
    lines += [f"- `{t}`" for t in single]
    for config in sorted(c for c in results if c != "ddp"):
        rows = {t: r for t, r in results[config].items() if t in selected}
        failures = {t: r for t, r in rows.items() if r["outcome"] == "failed" and t in goal}
        outside = {t: r for t, r in rows.items() if r["outcome"] == "failed" and t not in goal}
        unsubstituted = sorted(t for t, r in rows.items() if r["outcome"] == "passed" and not r.get("substituted"))
        lines += ["", f"Failures at stage {config} (of tests DDP passes): {len(failures)}"]
        lines += _grouped(failures)
        if outside:
            lines += ["", f"Failures at stage {config} of tests outside the goal (`--all`): {len(outside)}"]
            lines += _grouped(outside)
        if unsubstituted:
            lines += ["", f"Passed at stage {config} without building a zeroshard strategy: {len(unsubstituted)}"]
            lines += [f"- `{t}`" for t in unsubstituted]
    return lines, summary


def _grouped(failures: dict) -> list[str]:
    groups: dict[str, list[str]] = defaultdict(list)
    for test, result in sorted(failures.items()):
        groups[cause(result["error"])].append(test)
    lines = []
    for _, tests in sorted(groups.items(), key=lambda g: -len(g[1])):
        lines.append(f"- {len(tests)} x `{failures[tests[0]]['error']}`")
        lines += [f"  - `{t}`" for t in tests]
    return lines


def write_report(report: dict, out: Path, tests: list[dict]) -> None:
    selected = {t["id"] for t in tests if t["selected"]}
    table, summary = summarize(report["results"], selected)
    report["summary"] = summary
    sel = report["selection"]
    lines = [
        "# Lightning's own multi-process CPU tests with zeroshard in place of DDP",
        "",
        *[
            f"- run: `{r['command']}` ({r['date']}, {r['seconds']} s, tests run {r['tests_run']})"
            for r in report["runs"]
        ],
        f"- machine: {report['machine']['cpu']}, {report['machine']['cores']} cores",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "- Lightning's tests: {from} at {ref} ({commit})".format(**report["lightning_tests"]),
        f"- selection: {sel['selected']} of {sel['collected']} collected tests; {sel['how']}",
        "- each result keeps the zeroshard commit it ran at (`results.<config>.<test>.zeroshard_commit` in the JSON)",
        "",
        *table,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(table))
    print(f"\nwrote {out} and {out.with_suffix('.md')}")

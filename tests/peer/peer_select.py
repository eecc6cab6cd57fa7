"""pytest plugin: select Lightning's multi-process CPU tests at collection time (``--collect-only -p peer_select``).

It writes every collected test to ``ZEROSHARD_PEER_SELECT_OUT`` (JSON) with ``selected`` true or false and the
reason, so the list can be audited. The rules, applied to each test item (one parametrization each):

1. It runs on this machine: no ``skipif`` marker whose condition holds, except Lightning's ``RunIf(standalone=True)``
   alone (those tests run with ``PL_RUN_STANDALONE_TESTS=1``, as Lightning's CI runs them). GPU, TPU, MPS,
   DeepSpeed, ... tests drop out here.
2. It asks for DDP: a parameter named ``*strategy*`` holds a DDP name (``ddp``, ``ddp_spawn``, ``ddp_fork``,
   ``ddp_notebook``, ``*_find_unused_parameters_*``) or a ``DDPStrategy``; without such a parameter, the test's source
   (with its decorators and the functions it calls from Lightning's test modules, 3 levels down) names one of those
   strings or ``DDPStrategy(``, or passes ``devices=N`` with N >= 2 and no ``strategy=`` (Lightning picks ``ddp``
   then). A parametrization with a non-DDP strategy, one device, or a GPU/TPU/MPS accelerator is left out.
3. It runs something: the source calls ``.fit/.validate/.test/.predict/.launch/.run(`` (tests that only build a
   Trainer and inspect it are connector unit tests, not multi-process ones).

Whether a selected test really starts 2+ processes is confirmed at run time (``zeroshard_peer`` records launches).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import textwrap

OUT_ENV = "ZEROSHARD_PEER_SELECT_OUT"
STANDALONE_REASON = "Requires: [Standalone execution]"
DDP_NAME = re.compile(r"^ddp(_spawn|_fork|_notebook)?(_find_unused_parameters_(true|false))?$")
DDP_IN_SOURCE = re.compile(
    r"[\"']ddp(_spawn|_fork|_notebook)?(_find_unused_parameters_(true|false))?[\"']|DDPStrategy\("
)
MANY_DEVICES = re.compile(r"devices[\"']?\s*[=:]\s*([2-9]|\[[^\]]*,[^\]]*\])")
STRATEGY_KWARG = re.compile(r"strategy\s*=")
RUNS = re.compile(r"\.(fit|validate|test|predict|launch|run)\(")
NOT_CPU = ("cuda", "gpu", "mps", "tpu")


def _is_ddp(value) -> bool:
    if isinstance(value, str):
        return bool(DDP_NAME.match(value.lower()))
    return (value if isinstance(value, type) else type(value)).__name__ == "DDPStrategy"


def _source_with_helpers(function, depth: int = 3) -> str:
    """The test's source plus that of the functions it calls from Lightning's test modules (``_run_test(...)``,
    ``tpipes.run_model_test(...)``), and theirs, ``depth`` levels down."""
    parts: dict[str, str] = {}
    todo = [(function, depth)]
    while todo:
        fn, level = todo.pop()
        key = f"{fn.__module__}.{fn.__qualname__}"
        if key in parts:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(fn))
            tree = ast.parse(source)
        except (OSError, TypeError, SyntaxError):
            continue
        parts[key] = source
        if level == 0:
            continue
        module = inspect.getmodule(fn)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                helper = _resolve(module, node.func)
                if inspect.isfunction(helper) and helper.__module__.startswith(("tests_pytorch", "tests_fabric")):
                    todo.append((helper, level - 1))
    return "\n".join(parts.values())


def _resolve(module, func):
    if isinstance(func, ast.Name):
        return getattr(module, func.id, None)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = getattr(module, func.value.id, None)
        return getattr(owner, func.attr, None) if inspect.ismodule(owner) else None
    return None


def _skip_here(item) -> str | None:
    for marker in item.iter_markers("skipif"):
        condition = marker.args[0] if marker.args else marker.kwargs.get("condition", False)
        reason = marker.kwargs.get("reason", "")
        if isinstance(condition, bool) and condition and reason != STANDALONE_REASON:
            return f"skipped here: {reason}"
    for _ in item.iter_markers("skip"):
        return "unconditional skip"
    return None


def _from_parameters(item) -> tuple[bool | None, str | None]:
    """(asks for DDP, reason to leave out) from the item's parametrization; None where the parameters don't say."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    ddp = None
    for name, value in params.items():
        lname = name.lower()
        if "strategy" in lname and value is not None:
            if not _is_ddp(value):
                return False, f"parametrized {name}={value!r}"
            ddp = True
        if lname in ("devices", "num_devices", "num_processes") and (
            (isinstance(value, int) and value < 2) or (isinstance(value, (list, tuple)) and len(value) < 2)
        ):
            return False, f"parametrized {name}={value!r}"
        if "accelerator" in lname and isinstance(value, str) and value in NOT_CPU:
            return False, f"parametrized {name}={value!r}"
    return ddp, None


def classify(item) -> tuple[bool, str]:
    skip = _skip_here(item)
    if skip:
        return False, skip
    ddp, excluded = _from_parameters(item)
    if excluded:
        return False, excluded
    source = _source_with_helpers(item.function)
    if not ddp:
        if DDP_IN_SOURCE.search(source):
            ddp = True
        elif MANY_DEVICES.search(source) and not STRATEGY_KWARG.search(source):
            ddp = True  # strategy="auto" with several devices is DDP
    if not ddp:
        return False, "no DDP strategy"
    if not RUNS.search(source):
        return False, "builds a Trainer/Fabric but runs nothing"
    return True, "standalone" if _is_standalone(item) else "ddp"


def _is_standalone(item) -> bool:
    return any(m.kwargs.get("standalone") for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(session, config, items) -> None:
    rows = []
    for item in items:
        if not hasattr(item, "function"):
            continue  # doctests
        selected, reason = classify(item)
        rows.append({"id": item.nodeid, "selected": selected, "reason": reason, "standalone": _is_standalone(item)})
    with open(os.environ[OUT_ENV], "w") as f:
        json.dump(rows, f, indent=1)

"""The package layout: every import inside ``python/zeroshard`` (module level and lazy, inside functions) points down
the layers, never up or sideways into a layer not listed, so the layers form no cycle.

Layers, bottom to top (``zeroshard/<layer>/__init__.py`` says what each holds): ``base`` (``loaded_classes``: pure
Python that imports nothing of ours, for every layer, ``checkpoint`` included) under all of them;
``core`` (``_C``, ``ops``, ``isa``) <- ``sharding`` <- ``optim`` <- ``offload``; ``init`` (``init/``, ``meta_init``,
``pretrained``) <- ``sharding``; ``plan`` <- ``init``, ``sharding``; ``engine`` (``engine/``, ``gathered``) <- all of
those; ``checkpoint`` (``checkpoint/``, ``consolidate``) imports only ``base``; ``strategies`` <- everything;
``zeroshard/__init__.py`` re-exports the public API from any layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "zeroshard"

# Top-level modules that belong to a layer whose other modules live in a subpackage.
TOP_LEVEL = {
    "loaded_classes": "base",
    "_C": "core",
    "ops": "core",
    "isa": "core",
    "meta_init": "init",
    "pretrained": "init",
    "gathered": "engine",
    "consolidate": "checkpoint",
}
SUBPACKAGES = {"sharding", "optim", "offload", "init", "plan", "engine", "checkpoint", "strategies"}

# What each layer may import (besides itself).
ALLOWED = {
    "base": set(),
    "core": {"base"},
    "sharding": {"base", "core"},
    "optim": {"base", "core", "sharding"},
    "offload": {"base", "core", "sharding", "optim"},
    "init": {"base", "core", "sharding"},
    "plan": {"base", "core", "sharding", "init"},
    "engine": {"base", "core", "sharding", "optim", "offload", "init", "plan"},
    "checkpoint": {"base"},
    "strategies": {"base", "core", "sharding", "optim", "offload", "init", "plan", "engine", "checkpoint"},
}


def _layer(dotted: str) -> str | None:
    """The layer of module ``zeroshard.<...>`` (None for the package root)."""
    parts = dotted.split(".")[1:]
    if not parts:
        return None
    if parts[0] in SUBPACKAGES:
        return parts[0]
    if parts[0] in TOP_LEVEL:
        return TOP_LEVEL[parts[0]]
    raise AssertionError(f"{dotted}: not in a known layer; add it to TOP_LEVEL or SUBPACKAGES in {__file__}")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every zeroshard import in ``path``, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zeroshard":
            if node.module == "zeroshard":
                found += [(node.lineno, f"zeroshard.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "zeroshard"]
    return found


def test_imports_point_down_the_layers():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if rel.parts == ("zeroshard", "__init__"):
            continue  # the public API re-exports from every layer
        own = _layer(".".join(p for p in rel.parts if p != "__init__"))
        for line, target in _imports(path):
            other = _layer(target)
            if other is not None and other != own and other not in ALLOWED[own]:
                bad.append(f"{rel}.py:{line} ({own}) imports {target} ({other})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_allowed_layers_form_no_cycle():
    seen: dict[str, str] = {}

    def visit(layer: str, stack: tuple[str, ...]) -> None:
        assert layer not in stack, f"cycle: {' -> '.join(stack + (layer,))}"
        if seen.get(layer) == "done":
            return
        for below in ALLOWED[layer]:
            visit(below, stack + (layer,))
        seen[layer] = "done"

    for layer in ALLOWED:
        visit(layer, ())


def test_command_line_modules_run_without_import_warnings():
    """`python -m zeroshard.consolidate` / `zeroshard.plan` (documented commands): importing the package must not
    import the module being run, or runpy warns "found in sys.modules ... prior to execution"."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent), PYTHONWARNINGS="error::RuntimeWarning")
    for module in ("zeroshard.consolidate", "zeroshard.plan"):
        proc = subprocess.run([sys.executable, "-m", module, "--help"], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0 and "usage" in proc.stdout, (module, proc.stderr[-2000:])
        assert "RuntimeWarning" not in proc.stderr, (module, proc.stderr[-2000:])

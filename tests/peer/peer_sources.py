"""Get Lightning's own test sources (``tests/tests_pytorch``, ``tests/tests_fabric``) for the installed version.

PyPI's packages carry no tests (checked for 2.6.6: neither the ``lightning`` nor the ``pytorch-lightning`` sdist has
``tests/``), so they come from Lightning's git repository, at the release tag nearest the installed version
(``2.6.6`` if it exists, else the nearest ``2.6.x``: ``2.6.5`` differs from 2.6.6 in ``core/saving.py`` only). Tried in
order, the first that works is cached under ``build/peer/lightning-<ref>/`` (with Lightning's ``pyproject.toml``, which
holds its pytest settings) and reused:

a. ``LIGHTNING_SRC``: a local checkout or git directory (bare mirrors included);
b. ``git clone --depth 1 --branch <tag>`` of ``LIGHTNING_GIT_URL`` (default: GitHub), sparse to the test folders;
c. ``pip download --no-binary :all: lightning==<version>``, used only if that sdist has the tests.

Tests always run against the installed ``lightning`` package, never the repository's ``src/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

GIT_URL = os.environ.get("LIGHTNING_GIT_URL", "https://github.com/Lightning-AI/pytorch-lightning")
PATHS = ("tests/tests_pytorch", "tests/tests_fabric", "pyproject.toml")
RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


def nearest_tag(tags: list[str], version: str) -> str | None:
    """The release tag of the same minor version closest to ``version`` (the older one on a tie), else None."""
    want = RELEASE.match(version)
    if not want:
        return None
    major, minor, patch = map(int, want.groups())
    same_minor = [
        (abs(int(m[3]) - patch), int(m[3]), t)
        for t in tags
        if (m := RELEASE.match(t)) and (int(m[1]), int(m[2])) == (major, minor)
    ]
    return min(same_minor)[2] if same_minor else None


def _git(*args: str, cwd: Path | None = None) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _from_git_dir(git_dir: str, version: str, dest_root: Path) -> tuple[Path, dict]:
    tags = _git("--git-dir", git_dir, "tag").split()
    tag = nearest_tag(tags, version)
    ref = tag or "HEAD"
    commit = _git("--git-dir", git_dir, "rev-parse", f"{ref}^{{commit}}").strip()
    tmp = Path(tempfile.mkdtemp(dir=dest_root))
    archive = subprocess.run(
        ["git", "--git-dir", git_dir, "archive", "--format=tar", commit, "--", *PATHS], check=True, capture_output=True
    ).stdout
    (tmp / "src.tar").write_bytes(archive)
    with tarfile.open(tmp / "src.tar") as tar:
        tar.extractall(tmp / "tree", filter="data")
    dest = dest_root / f"lightning-{tag or commit[:12]}"
    _install(tmp / "tree", dest)
    shutil.rmtree(tmp)
    return dest, {"from": f"git dir {git_dir}", "ref": ref, "commit": commit}


def _from_checkout(checkout: Path, dest_root: Path) -> tuple[Path, dict]:
    commit = _git("rev-parse", "HEAD", cwd=checkout).strip() if (checkout / ".git").exists() else "unknown"
    dest = dest_root / f"lightning-checkout-{commit[:12]}"
    _install(checkout, dest)
    return dest, {"from": f"checkout {checkout}", "ref": "working tree", "commit": commit}


def _from_clone(version: str, dest_root: Path) -> tuple[Path, dict]:
    refs = _git("ls-remote", "--tags", GIT_URL).split()
    tags = [r.removeprefix("refs/tags/") for r in refs if r.startswith("refs/tags/") and not r.endswith("^{}")]
    tag = nearest_tag(tags, version)
    if tag is None:
        raise RuntimeError(f"no {version.rsplit('.', 1)[0]}.x tag at {GIT_URL}")
    clone = dest_root / f"clone-{tag}"
    shutil.rmtree(clone, ignore_errors=True)
    _git("clone", "--depth", "1", "--branch", tag, "--filter=blob:none", "--no-checkout", GIT_URL, str(clone))
    _git("sparse-checkout", "set", "--no-cone", *[f"/{p}" for p in PATHS], cwd=clone)
    _git("checkout", tag, cwd=clone)
    commit = _git("rev-parse", "HEAD", cwd=clone).strip()
    dest = dest_root / f"lightning-{tag}"
    _install(clone, dest)
    shutil.rmtree(clone)
    return dest, {"from": GIT_URL, "ref": tag, "commit": commit}


def _from_sdist(version: str, dest_root: Path, python: str) -> tuple[Path, dict]:
    tmp = Path(tempfile.mkdtemp(dir=dest_root))
    pip = [python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(tmp)]
    subprocess.run([*pip, f"lightning=={version}"], check=True, capture_output=True)
    (sdist,) = tmp.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        if not any(n.startswith(f"{top}/tests/tests_pytorch/") for n in names):
            shutil.rmtree(tmp)
            raise RuntimeError(f"{sdist.name} has no tests/ (PyPI's sdists carry only the package sources)")
        tar.extractall(tmp, filter="data")
    dest = dest_root / f"lightning-sdist-{version}"
    _install(tmp / top, dest)
    shutil.rmtree(tmp)
    return dest, {"from": f"PyPI sdist {sdist.name}", "ref": version, "commit": "n/a"}


def _last_line(error: Exception) -> str:
    stderr = getattr(error, "stderr", None)
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    lines = (stderr or "").strip().splitlines()
    return lines[-1] if lines else str(error)


def _install(tree: Path, dest: Path) -> None:
    if not (tree / "tests" / "tests_pytorch" / "conftest.py").exists():
        raise RuntimeError(f"{tree} has no tests/tests_pytorch")
    shutil.rmtree(dest, ignore_errors=True)
    for path in PATHS:
        src = tree / path
        if src.is_dir():
            shutil.copytree(src, dest / path)
        elif src.exists():
            shutil.copy2(src, dest / path)


def get_sources(version: str, dest_root: Path, python: str) -> tuple[Path, dict]:
    """Lightning's source tree holding ``tests/``, and where it came from. Cached per Lightning version; a cache made
    from another ``LIGHTNING_SRC`` than the one set now is not reused."""
    dest_root.mkdir(parents=True, exist_ok=True)
    local = os.environ.get("LIGHTNING_SRC")
    cache = dest_root / f"sources-{version}.json"
    if cache.exists():
        cached = json.loads(cache.read_text())
        if local in (None, cached["LIGHTNING_SRC"]) and (Path(cached["dest"]) / "tests" / "tests_pytorch").is_dir():
            return Path(cached["dest"]), cached["origin"]
    attempts: list[str] = []
    ways = []
    if local:
        if (Path(local) / "tests" / "tests_pytorch").is_dir():
            ways.append(("LIGHTNING_SRC checkout", lambda: _from_checkout(Path(local), dest_root)))
        else:
            ways.append(("LIGHTNING_SRC git dir", lambda: _from_git_dir(local, version, dest_root)))
    ways.append(("git clone", lambda: _from_clone(version, dest_root)))
    ways.append(("PyPI sdist", lambda: _from_sdist(version, dest_root, python)))
    for name, way in ways:
        try:
            dest, origin = way()
        except (subprocess.CalledProcessError, RuntimeError, OSError, ValueError) as e:
            attempts.append(f"{name}: {_last_line(e)}")
            continue
        origin |= {"lightning_version": version, "failed_attempts": attempts}
        cache.write_text(json.dumps({"LIGHTNING_SRC": local, "dest": str(dest), "origin": origin}, indent=1))
        return dest, origin
    raise SystemExit("could not get Lightning's test sources:\n  " + "\n  ".join(attempts))

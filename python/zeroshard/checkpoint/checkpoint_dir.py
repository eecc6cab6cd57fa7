"""The commit protocol of a sharded checkpoint directory: versioned subdirectories and an atomically replaced pointer.

Layout::

    <path>/LATEST      {"version": "v00007", "manifest_sha256": ...}: the committed version and its manifest's hash
    <path>/v00006/     the previous committed version (kept until the next save commits)
    <path>/v00007/     the current one: index.json, rank files, trainer state, manifest.json

A save writes a new version directory ``v{N+1}`` beside the current one, fsyncs every file and the directory, then
commits by replacing ``LATEST``: written to ``LATEST.tmp``, fsynced, ``os.replace``-d over ``LATEST`` (atomic on POSIX
file systems) and the directory fsynced. Only then are versions older than the previous one deleted.

Why this protocol (and not "rename ``path`` to ``path.old``, then ``path.partial`` to ``path``"): a rename of a
directory over a non-empty directory is impossible, so swapping whole directories needs two renames and leaves a
moment with no ``path`` at all; a SIGKILL there left the user with ``FileNotFoundError``. Replacing one small file is a
single atomic step: before it ``LATEST`` names the old version, after it the new one, and both versions are complete
on disk at that moment (fsynced before the commit), so a crash at any point loads either the old or the new
checkpoint. Uncommitted version directories left by a crash are never read and are deleted by the next save.

A failed commit (``LATEST.tmp`` written, then ``os.replace`` or the fsync after it failed) leaves a complete but
uncommitted version and ``LATEST.tmp``. Neither is ever read (a load reads ``LATEST`` only), and the next save cleans
both: it numbers its version after every ``v*`` entry present, replaces ``LATEST.tmp`` (unlinked, then created anew) by
its own pointer, and after its commit deletes every version but the previous committed one and its own. (If the
failed commit had already replaced ``LATEST``, the "uncommitted" version is in fact the committed one, and is kept.)

The directory may have been written by someone else (:mod:`zeroshard.checkpoint.safe_paths`): the pointer and the
version it names must be a regular file and a real directory inside it, never symbolic links, and the pointer's
temporary file is created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW`` after unlinking whatever has its name), so a
planted ``LATEST.tmp`` link is never written through and ``LATEST`` is always a regular file.

One case keeps two renames: when ``path`` is a symbolic link or a file (Lightning's ``save_last="link"`` makes
``last.ckpt`` a link), a directory cannot replace it atomically. The whole new checkpoint (version and pointer) is then
built in ``<path>.partial``, the link is removed and ``.partial`` renamed to ``path``; between the two, :func:`resolve`
finds the committed checkpoint in ``.partial`` and loads it (its pointer and manifest verify it), and the next save
finishes the rename.

The older single-version layout (``index.json`` directly in ``path``) loads once adopted by hand (it has no manifest:
``python -m zeroshard.checkpoint.adopt``), and counts as the previous version when a new one is saved into the same
directory.

Test hook: ``ZEROSHARD_TEST_KILL_AT=<step>[:<rank>]`` makes :func:`kill_point` SIGKILL the process (only that rank,
if given) at the named step of a save; used only by ``tests/python/test_faults_checkpoint.py``. Steps, in order:
``before_write``, ``rank_file_written`` (a rank's file written, not yet fsynced), ``after_rank_files``,
``before_pointer``, ``between_renames`` (link or file replaced only), ``after_pointer``, ``after_cleanup``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from zeroshard.checkpoint import bounded_json
from zeroshard.checkpoint.safe_paths import create_exclusive, kind, real_dir, regular_file

POINTER = "LATEST"
LEGACY = "legacy"  # the version name of the single-version layout (index.json directly in the directory)
_VERSION = re.compile(r"^v(\d{5,})$")
KILL_ENV = "ZEROSHARD_TEST_KILL_AT"


def kill_point(step: str, rank: int) -> None:
    """SIGKILLs this process when ``ZEROSHARD_TEST_KILL_AT`` is ``step`` or ``step:rank`` (tests only)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    name, _, only = spec.partition(":")
    if name == step and (not only or int(only) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Makes the directory's entries (created, renamed, removed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Writes ``data`` to a new file at ``path`` and fsyncs it (the directory entry is made durable by the caller's dir
    fsync). Whatever had the name is unlinked first and the file created exclusively, so a planted link is never
    followed (:func:`zeroshard.checkpoint.safe_paths.create_exclusive`)."""
    create_exclusive(path, data)


def version_name(n: int) -> str:
    return f"v{n:05d}"


def _versions(root: Path, dirs_only: bool = True) -> list[str]:
    """Version directories under ``root``, oldest first (committed or not); with ``dirs_only=False`` every entry with a
    version name (links and files too: a new version's number must not collide with any)."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p.name)
        for p in root.iterdir()
        if (m := _VERSION.match(p.name)) and (not dirs_only or kind(root, p.name) == "dir")
    ]
    return [name for _, name in sorted(found)]


def read_pointer(root: Path) -> dict:
    """``{"version", "manifest_sha256"}`` from ``root/LATEST``.

    Raises:
        ValueError: the pointer is not the JSON object a save writes (it is replaced atomically, so this means it was
            edited or the disk corrupted it).
    """
    regular_file(root, POINTER, "the directory")  # a link or a non-file is refused, naming nothing outside
    try:
        pointer = bounded_json.read(root, POINTER, "the directory", max_bytes=4096, max_depth=1)
        ok = isinstance(pointer, dict) and isinstance(pointer.get("version"), str)
        if not (ok and _VERSION.fullmatch(pointer["version"]) and isinstance(pointer.get("manifest_sha256"), str)):
            raise ValueError("not a pointer object")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"sharded checkpoint {root}: {POINTER} is corrupt ({e}); it should be "
            '{"version": "v00001", "manifest_sha256": ...}. Load a version directory directly, e.g. '
            f"{root / (_versions(root) or ['v00001'])[-1]}"
        ) from None
    return pointer


@dataclass
class Resolved:
    """Where a checkpoint's committed files are: ``dir`` holds index.json and the rank files."""

    root: Path  # the directory the user named (or its .partial, when a link was being replaced)
    dir: Path
    version: str  # "v00007", or LEGACY
    manifest_sha256: str | None  # from the pointer; None for the legacy layout or a version directory given directly


def resolve(path: str | os.PathLike, index_name: str = "index.json") -> Resolved:
    """The committed version of the checkpoint at ``path`` (a checkpoint directory, or one version directory).

    Raises:
        FileNotFoundError: nothing at ``path`` (nor a committed ``<path>.partial``).
        ValueError: ``path`` is not a sharded checkpoint (the message says what it lacks), or its pointer is corrupt
            or names a missing version.
    """
    root = Path(path)
    if not root.exists():
        partial = root.with_name(root.name + ".partial")
        if _committed_partial(partial):  # a save replacing a link or file stopped between its two renames
            root = partial
        else:
            raise FileNotFoundError(f"sharded checkpoint {root} does not exist")
    if not root.is_dir():
        raise ValueError(f"{root} is a file, not a sharded checkpoint directory")
    if kind(root, POINTER) != "missing":
        pointer = read_pointer(root)  # a link or non-file pointer is refused there
        if kind(root, pointer["version"]) == "missing":
            raise ValueError(
                f"sharded checkpoint {root}: {POINTER} names {pointer['version']}, which is missing "
                f"(versions present: {_versions(root) or 'none'})"
            )
        version = real_dir(root, pointer["version"], POINTER)  # never a link out of the directory
        return Resolved(root, version, pointer["version"], pointer["manifest_sha256"])
    if kind(root, index_name) == "file":
        name = root.name if _VERSION.match(root.name) else LEGACY
        return Resolved(root, root, name, None)
    held = sorted(p.name for p in root.iterdir())
    hint = (
        f"; it holds uncommitted versions {_versions(root)}: a save was interrupted before its first commit"
        if _versions(root)
        else ""
    )
    raise ValueError(
        f"{root} is not a zeroshard sharded checkpoint: it has no {POINTER} (the pointer to the committed version) "
        f"and no {index_name} (the single-version layout){hint}. It holds {held[:12]}"
        f"{' ...' if len(held) > 12 else ''}. Pass a directory written by ZeroStrategy(state_dict_type='sharded') "
        "or zeroshard.checkpoint.sharded_checkpoint.save_sharded"
    )


def _committed_partial(partial: Path) -> bool:
    """Whether ``<path>.partial`` is a real directory (not a link) holding a pointer."""
    return kind(partial.parent, partial.name) == "dir" and kind(partial, POINTER) == "file"


def committed_version(path: str | os.PathLike) -> str | None:
    """The version a load of ``path`` would read (``"v00007"`` or ``LEGACY``), or None when nothing is committed
    there (or it cannot be told); never raises. For error messages."""
    try:
        return resolve(path).version
    except (OSError, ValueError):
        return None


@dataclass
class Pending:
    """A save in progress: the new version's directory, and what to commit and clean up."""

    path: Path  # what the user named
    root: Path  # where the versions live: ``path``, or ``<path>.partial`` when ``path`` is a link or a file
    version: str
    previous: str | None  # the committed version before this save (LATEST's, or LEGACY), kept after the commit

    @property
    def dir(self) -> Path:
        return self.root / self.version


def begin(path: str | os.PathLike) -> Pending:
    """Creates the next version directory (rank 0 only) and returns the save's plan.

    A ``<path>.partial`` holding a committed checkpoint while ``path`` is missing (an interrupted link replacement)
    is first renamed to ``path``.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if not path.exists() and not path.is_symlink() and _committed_partial(partial):
        partial.rename(path)
        fsync_dir(path.parent)
    replace = path.is_symlink() or (path.exists() and not path.is_dir())
    if replace:
        if partial.is_symlink() or (partial.exists() and not partial.is_dir()):
            partial.unlink()  # never build the new checkpoint through a link
        shutil.rmtree(partial, ignore_errors=True)
        root, previous = partial, None
    else:
        root = path
        previous = None
        if kind(root, POINTER) != "missing":
            previous = read_pointer(root)["version"]
        elif kind(root, "index.json") == "file":
            previous = LEGACY
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    if created:
        fsync_dir(root.parent)
    existing = _versions(root, dirs_only=False)
    last = int(_VERSION.match(existing[-1]).group(1)) if existing else 0
    pending = Pending(path, root, version_name(last + 1), previous)
    pending.dir.mkdir()
    fsync_dir(root)
    return pending


def commit(pending: Pending, manifest_sha256: str, rank: int = 0) -> None:
    """The commit point: atomically points ``LATEST`` at the new version (all its files already fsynced), then, for a
    link or file at ``path``, swaps ``<path>.partial`` in. ``LATEST.tmp`` is created exclusively (a planted link is
    removed, not followed), and ``os.replace`` replaces the entry ``LATEST`` itself, so ``LATEST`` is a regular file."""
    fsync_dir(pending.dir)
    tmp = pending.root / (POINTER + ".tmp")
    write_durable(tmp, json.dumps({"version": pending.version, "manifest_sha256": manifest_sha256}).encode())
    os.replace(tmp, pending.root / POINTER)
    fsync_dir(pending.root)
    if pending.root != pending.path:
        pending.path.unlink()
        kill_point("between_renames", rank)
        pending.root.rename(pending.path)
        fsync_dir(pending.path.parent)
        pending.root = pending.path


def cleanup(pending: Pending, legacy_files: list[str]) -> None:
    """After the commit: deletes every version but the previous and the new one (and uncommitted leftovers), and the
    single-version layout's files once they are no longer the previous version. Errors are ignored (tidying only)."""
    keep = {pending.version, pending.previous}
    for name in _versions(pending.root):
        if name not in keep:
            shutil.rmtree(pending.root / name, ignore_errors=True)
    if LEGACY not in keep:
        for name in legacy_files:
            for file in pending.root.glob(name):
                if file.is_file():
                    file.unlink(missing_ok=True)
    fsync_dir(pending.root)

"""Outputs written so that a kill never leaves a partial or mixed output under a final name (``consolidate``).

Every file is first written under a temporary name created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, so a
planted file or link is never followed or reused), flushed and fsynced, and only then renamed to its final name; the
directory is fsynced after the renames. Temporary names are ``.<name>.zeroshard-tmp-<16 hex>`` (files and staging
directories beside the output) and ``.zeroshard-tmp-<16 hex>`` (a staging directory inside an existing output
directory). Each is ``flock``-ed by its writer while it lives; the next run removes the leftovers of a killed one
(those whose lock is free) before writing. One writer per output at a time.

A directory output (:class:`StagedDir`: safetensors files, their index, ``config.json`` ...):

- ``OUT`` missing, or an empty directory on the same file system as its parent: everything is written in a staging
  directory beside it, which is then renamed to ``OUT`` in one step. A kill at any point leaves either no ``OUT`` (or
  the empty one) or the whole new output.
- ``OUT`` holds files: the new files are written in a staging directory inside ``OUT`` while the previous output
  stays whole; then the previous output's *markers* (``model.safetensors``, ``model.safetensors.index.json``,
  ``config.json``: what a loader looks for first) are removed first, then its other files that the new output
  does not replace (older shards), then the new files are renamed in, markers last (the index after every shard,
  ``config.json`` last). Files of other names (a tokenizer) are left alone. This commit renames only (no data is
  written), but it is several steps: a kill inside it leaves no marker, so no loader takes what is there for a
  complete output, but it can leave shards without an index; the next run into ``OUT`` removes them. For an
  all-or-nothing replacement, write to a new directory.

A single-file output (:func:`atomic_file`, ``--format torch|lightning``): the temporary beside it is renamed over it.

Test hook: ``ZEROSHARD_TEST_KILL_AT=<step>`` SIGKILLs the process at a named step (``checkpoint_dir.kill_point``;
``tests/python/test_faults_consolidate.py``): ``consolidate_tensor`` (after each tensor's bytes: the first call kills,
so inside the first file), ``consolidate_file`` (after each file is written and fsynced under its temporary name),
``consolidate_commit`` (every file written, before the first rename) and ``consolidate_renamed`` (in-place commit:
after the old markers are removed and the first new file is renamed in).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from zeroshard.checkpoint.checkpoint_dir import fsync_dir, kill_point

__all__ = ["StagedDir", "atomic_file", "clean_leftovers", "kill_point"]

TAG = "zeroshard-tmp-"


def _tmp_name(base: str) -> str:
    return f".{base}.{TAG}{secrets.token_hex(8)}" if base else f".{TAG}{secrets.token_hex(8)}"


def _is_tmp(name: str, base: str) -> bool:
    return re.fullmatch(re.escape(f".{base}.{TAG}" if base else f".{TAG}") + "[0-9a-f]{16}", name) is not None


def clean_leftovers(directory: Path, base: str = "") -> list[str]:
    """Removes this module's temporaries for ``base`` (``.<base>.zeroshard-tmp-*``; inside an output directory,
    ``base=""``: ``.zeroshard-tmp-*``) in ``directory`` whose writer is gone (their ``flock`` is free); returns the
    names removed. A link of that name is removed, never followed."""
    removed = []
    if not directory.is_dir():
        return removed
    for entry in os.scandir(directory):
        if not _is_tmp(entry.name, base):
            continue
        path = Path(entry.path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # a link (ELOOP) or already gone
            path.unlink(missing_ok=True)
            removed.append(entry.name)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live writer
            os.close(fd)
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(entry.name)
        finally:
            os.close(fd)
    if removed:
        fsync_dir(directory)
    return removed


def _create(path: Path) -> BinaryIO:
    """A new file at ``path`` for writing, created exclusively (never an existing file or link) and locked."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return os.fdopen(fd, "wb")


def _finish(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[BinaryIO]:
    """Yields a binary file that becomes ``final`` (replacing it in one step) when the block exits normally; on an
    error the temporary is removed and ``final`` is untouched.

    Raises:
        OSError: ``final``'s directory cannot be written, or ``final`` is a directory.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(final.parent, final.name)
    tmp = final.parent / _tmp_name(final.name)
    f = _create(tmp)
    try:
        with f:
            yield f
            _finish(f)
        kill_point("consolidate_commit", 0)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


class StagedDir:
    """A directory output written as a whole (see the module docstring): :meth:`open` each file, then :meth:`commit`.

    Args:
        out: the output directory.
        ours: which names in ``out`` belong to an output of this kind (a previous one is replaced: its files that the
            new output does not write are removed).
        markers: the names a loader looks for first (``model.safetensors``, ``model.safetensors.index.json``,
            ``config.json``): a previous output's are removed before anything else changes, and the new ones are
            renamed in last, in the order they were written.
    """

    def __init__(self, out: Path, ours: Callable[[str], bool], markers: set[str]) -> None:
        self.out, self.ours, self.markers = out, ours, markers
        self.names: list[str] = []
        clean_leftovers(out.parent, out.name)
        clean_leftovers(out)
        if os.path.lexists(out) and not out.is_dir():
            raise NotADirectoryError(f"output {out} exists and is not a directory: name a new or existing directory")
        self.fresh = not os.path.lexists(out) or (not out.is_symlink() and _empty(out) and _same_fs(out, out.parent))
        out.parent.mkdir(parents=True, exist_ok=True)
        self.stage = (out.parent / _tmp_name(out.name)) if self.fresh else out / _tmp_name("")
        self.stage.mkdir()
        self._lock: int | None = os.open(self.stage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    def open(self, name: str) -> BinaryIO:
        """A new file in the staging directory; it becomes ``out/name`` at :meth:`commit`. Close it normally (its
        bytes are fsynced then) before committing."""
        self.names.append(name)
        return _Durable(_create(self.stage / name))

    def write(self, name: str, data: bytes) -> None:
        with self.open(name) as f:
            f.write(data)

    def commit(self) -> list[Path]:
        """Moves every file into ``out`` (markers last, in the order written); returns their final paths in the order
        written."""
        kill_point("consolidate_commit", 0)
        fsync_dir(self.stage)
        if self.fresh:
            os.rename(self.stage, self.out)  # onto nothing or an empty directory: one step
            fsync_dir(self.out.parent)
        else:
            old = [e.name for e in os.scandir(self.out) if e.is_file(follow_symlinks=False) and self.ours(e.name)]
            for name in sorted(old, key=lambda n: n not in self.markers):  # the previous output's markers first
                if name in self.markers or name not in self.names:
                    (self.out / name).unlink()
            fsync_dir(self.out)
            order = [n for n in self.names if n not in self.markers] + [n for n in self.names if n in self.markers]
            for i, name in enumerate(order):
                os.replace(self.stage / name, self.out / name)
                if i == 0:
                    kill_point("consolidate_renamed", 0)
            fsync_dir(self.out)
            self.stage.rmdir()
        self.close()
        return [self.out / n for n in self.names]

    def close(self) -> None:
        """Releases the lock; an uncommitted staging directory is removed (used on errors)."""
        if self._lock is not None:
            if self.stage.exists():
                shutil.rmtree(self.stage, ignore_errors=True)
            os.close(self._lock)
            self._lock = None


def _empty(directory: Path) -> bool:
    with os.scandir(directory) as entries:
        return next(entries, None) is None


def _same_fs(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


class _Durable:
    """A file that is flushed and fsynced when closed normally (removed by :meth:`StagedDir.close` otherwise)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def write(self, data) -> int:
        return self.f.write(data)

    def __enter__(self) -> _Durable:
        return self

    def __exit__(self, kind, *_) -> None:
        try:
            if kind is None:
                _finish(self.f)
                kill_point("consolidate_file", 0)
        finally:
            self.f.close()

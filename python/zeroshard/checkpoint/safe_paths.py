"""Names read from a checkpoint directory stay inside it.

A checkpoint directory may have been written by someone else, so every name that comes from its files (the pointer
``LATEST``, ``manifest.json``, ``index.json``) is checked before use: a plain file name (no ``/``, no ``..``, not
absolute), naming a regular file or a real directory, never a symbolic link (checked with ``os.lstat`` and opened with
``O_NOFOLLOW``). Only the directory the user named (and the files and directories inside it) is trusted to be where it
says: that directory itself may be a link (Lightning's ``save_last="link"``), what is inside it may not.

Errors never describe anything outside the directory: a refused name is reported as the name the checkpoint gave,
never with the size, type or content of what it points to.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

MAX_NAME_BYTES = 255  # NAME_MAX on Linux


class CheckpointError(ValueError):
    """A sharded checkpoint is corrupt, inconsistent, outside its directory or does not fit the model."""


def plain_name(directory: Path, name: object, listed_in: str) -> str:
    """``name`` if it is a plain file name inside ``directory``: a non-empty ``str`` without ``/``, ``\\`` or NUL,
    not ``.`` or ``..`` and at most 255 bytes.

    Raises:
        CheckpointError: naming ``listed_in`` (the file that gave the name) and the name.
    """
    ok = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
        and len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
    )
    if not ok:
        raise CheckpointError(
            f"sharded checkpoint {directory}: {listed_in} names {str(name)[:100]!r}, which is not a plain file name "
            "inside the checkpoint directory (no '/', '..' or absolute paths); refusing to read it"
        )
    return name


def _lstat(directory: Path, name: str) -> os.stat_result | None:
    try:
        return os.lstat(directory / name)
    except FileNotFoundError:
        return None


def kind(directory: Path, name: str) -> str:
    """``"file"``, ``"dir"``, ``"link"``, ``"other"`` or ``"missing"`` for the entry ``name`` of ``directory``
    (links not followed)."""
    st = _lstat(directory, name)
    if st is None:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        return "link"
    return "file" if stat.S_ISREG(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "other"


def _refuse(directory: Path, name: str, listed_in: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"sharded checkpoint {directory}: {name} ({listed_in} names it) is {what}; the files of a checkpoint must be "
        "regular files and directories inside its directory, so it is not read. Replace it with the real file"
    )


def regular_file(directory: Path, name: object, listed_in: str) -> os.stat_result:
    """The ``lstat`` of ``directory/name`` after checking it is a plain name of a regular file there.

    Raises:
        CheckpointError: not a plain name, a symbolic link or not a regular file. FileNotFoundError: missing.
    """
    name = plain_name(directory, name, listed_in)
    st = _lstat(directory, name)
    if st is None:
        raise FileNotFoundError(f"sharded checkpoint {directory}: {name} is missing ({listed_in} lists it)")
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(directory, name, listed_in, "a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(directory, name, listed_in, "not a regular file")
    return st


def real_dir(directory: Path, name: str, listed_in: str) -> Path:
    """``directory/name`` after checking it is a plain name of a directory there (not a link to one).

    Raises:
        CheckpointError: not a plain name, a link or not a directory. FileNotFoundError: missing.
    """
    name = plain_name(directory, name, listed_in)
    what = kind(directory, name)
    if what == "missing":
        raise FileNotFoundError(f"sharded checkpoint {directory}: {name} is missing ({listed_in} names it)")
    if what == "link":
        raise _refuse(directory, name, listed_in, "a symbolic link")
    if what != "dir":
        raise _refuse(directory, name, listed_in, "not a directory")
    return directory / name


def open_regular(directory: Path, name: object, listed_in: str) -> int:
    """A read-only descriptor of the regular file ``directory/name`` (checked as :func:`regular_file`; opened with
    ``O_NOFOLLOW | O_NONBLOCK``, so a link or FIFO swapped in after the check is not followed or waited on)."""
    regular_file(directory, name, listed_in)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(directory / str(name), flags)
    except OSError as e:
        raise _refuse(directory, str(name), listed_in, f"not readable ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refuse(directory, str(name), listed_in, "not a regular file")
    return fd


def read_bounded(directory: Path, name: str, limit: int, listed_in: str) -> bytes:
    """The bytes of the regular file ``directory/name``, refused before reading if it has more than ``limit``.

    Raises:
        CheckpointError: as :func:`open_regular`, or larger than ``limit`` bytes. FileNotFoundError: missing.
    """
    fd = open_regular(directory, name, listed_in)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CheckpointError(
                f"sharded checkpoint {directory}: {name} has {size} bytes, more than the {limit} a checkpoint's "
                f"{name} may have; refusing to read it"
            )
        data = f.read(size + 1)  # read(n) allocates n bytes up front: ask for what fstat says (and one more)
    if len(data) > limit:
        raise CheckpointError(f"sharded checkpoint {directory}: {name} grew past {limit} bytes while read")
    return data


def sha256_of(directory: Path, name: str, listed_in: str) -> str:
    """The SHA-256 (hex) of the regular file ``directory/name``, read through a descriptor opened without following
    links."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(directory, name, listed_in), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def create_exclusive(path: Path, data: bytes) -> None:
    """Writes ``data`` to a new file at ``path`` and fsyncs it. Whatever was at ``path`` (a file, or a link planted
    to make the write land elsewhere) is unlinked first, never followed: the file is created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW``. The directory entry is made durable by the caller's directory fsync."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

"""Adopt, by hand, a checkpoint directory that has no ``manifest.json``: check what its own files allow, then write one.

    python -m zeroshard.checkpoint.adopt DIR

A load refuses a version without a manifest (:mod:`zeroshard.checkpoint.checkpoint_verify`): nothing in it can be
verified as a whole, and an edited ``trainer.json`` or ``index.json`` would be read as is. That happens to the older
single-version layout (``index.json`` directly in the directory, written by zeroshard before versioned checkpoints)
and to a version whose manifest was lost. Run this only on a directory whose origin you trust: it is the user's
decision, taken knowingly, that these files are the checkpoint.

What is checked before anything is written (every name confined to the directory, as on load):
  - ``index.json``: its consistency (:func:`~zeroshard.checkpoint.checkpoint_verify.check_index`);
  - each rank file against the size and SHA-256 the index lists, and its safetensors header against the index;
  - the trainer state's structure and schema (``trainer.json``; never unpickled: ``trainer.pickle`` and the older
    ``trainer.pt`` still load only under the ``weights_only`` rule).
Then ``manifest.json`` lists every one of those files, created exclusively and fsynced. When ``DIR`` is a checkpoint
whose ``LATEST`` names the version, ``LATEST`` is rewritten (atomically) with the new manifest's hash.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from zeroshard.checkpoint import checkpoint_dir, trainer_state
from zeroshard.checkpoint.checkpoint_dir import POINTER, fsync_dir
from zeroshard.checkpoint.checkpoint_verify import (
    INDEX,
    MANIFEST,
    _read_json,
    check_headers,
    check_index,
    check_index_files,
    file_entry,
    write_manifest,
)
from zeroshard.checkpoint.safe_paths import CheckpointError, kind

_TRAINER_FILES = (trainer_state.STRUCTURE, trainer_state.TENSORS, trainer_state.PICKLED, trainer_state.LEGACY)


def adopt_checkpoint(path: str | os.PathLike) -> tuple[Path, list[str]]:
    """Checks the manifest-less checkpoint version at ``path`` (a checkpoint directory, a version directory, or the
    older single-version layout) and writes its ``manifest.json`` (module docstring); returns the manifest's path and
    what was checked, one line each.

    Raises:
        CheckpointError: it already has a manifest, or a check failed (naming the file and the key); nothing written.
        FileNotFoundError: a file the index lists is missing.
    """
    where = checkpoint_dir.resolve(path, INDEX)
    d = where.dir
    if kind(d, MANIFEST) != "missing":
        raise CheckpointError(
            f"sharded checkpoint {d} already has a {MANIFEST}; nothing to adopt (zeroshard.checkpoint.sharded_"
            "checkpoint.verify(path) checks it)"
        )
    index = _read_json(d, INDEX)
    check_index(d, index)
    check_index_files(d, index)
    check_headers(d, index)
    done = [f"{INDEX}: consistent; its {len(index['files'])} rank files match its sizes, SHA-256 and layout"]
    done.append(f"trainer state: {trainer_state.check(d)}")
    names = [INDEX, *sorted(index["files"]), *(n for n in _TRAINER_FILES if kind(d, n) != "missing")]
    sha = write_manifest(d, {name: file_entry(d / name) for name in names})
    fsync_dir(d)
    done.append(f"wrote {d / MANIFEST} listing {names}")
    if where.manifest_sha256 is not None:  # LATEST names this version: seal the new manifest there
        tmp = where.root / (POINTER + ".tmp")
        checkpoint_dir.write_durable(tmp, json.dumps({"version": where.version, "manifest_sha256": sha}).encode())
        os.replace(tmp, where.root / POINTER)
        fsync_dir(where.root)
        done.append(f"rewrote {where.root / POINTER} with its SHA-256")
    return d / MANIFEST, done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zeroshard.checkpoint.adopt",
        description="Check a sharded checkpoint that has no manifest.json and write one (only for files you trust).",
    )
    parser.add_argument("path", help="checkpoint directory, version directory, or the older single-version layout")
    args = parser.parse_args(argv)
    try:
        _, done = adopt_checkpoint(args.path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())

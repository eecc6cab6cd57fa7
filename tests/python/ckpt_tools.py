"""Test helpers that edit a sharded checkpoint the way a user (or an attacker) would: change a file, then re-seal the
manifest and pointer so that only the layout checks or the pickle rule can catch it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from zeroshard.checkpoint import trainer_state
from zeroshard.checkpoint.checkpoint_dir import POINTER, resolve
from zeroshard.checkpoint.checkpoint_verify import INDEX, MANIFEST, file_entry, write_manifest


def version_dir(ckpt: Path) -> Path:
    return resolve(ckpt).dir


def reseal(ckpt: Path) -> None:
    """Recomputes the committed version's manifest (every file in it) and the pointer's hash of the manifest."""
    where = resolve(ckpt)
    names = sorted(p.name for p in where.dir.iterdir() if p.is_file() and p.name != MANIFEST)
    sha = write_manifest(where.dir, {name: file_entry(where.dir / name) for name in names})
    (where.root / POINTER).write_text(json.dumps({"version": where.version, "manifest_sha256": sha}))


def edit_index(ckpt: Path, edit, seal: bool) -> None:
    """``edit(index)`` in place on the committed version's index.json; re-sealed when ``seal``."""
    file = version_dir(ckpt) / INDEX
    index = json.loads(file.read_text())
    edit(index)
    file.write_text(json.dumps(index))
    if seal:
        reseal(ckpt)


def make_legacy(ckpt: Path, out: Path) -> None:
    """The single-version layout (index.json, rank files and a torch.save-d trainer.pt directly in ``out``) holding
    the same checkpoint."""
    d = version_dir(ckpt)
    out.mkdir(parents=True)
    for f in d.iterdir():
        if f.name == INDEX or f.name.startswith("rank"):
            shutil.copy(f, out / f.name)
    torch.save(trainer_state.load(d, weights_only=False), out / trainer_state.LEGACY)


class Exploit:
    """Unpickling this writes ``marker``: the crafted pickle of issue 10."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))

"""Verification of a sharded checkpoint before anything is loaded from it: every file, then the layout.

1. Files: ``manifest.json`` lists the size and SHA-256 of every other file of the version (``index.json``, the rank
   files, the trainer state); the pointer (``LATEST``, :mod:`zeroshard.checkpoint.checkpoint_dir`) holds the manifest's
   own SHA-256, so a changed byte anywhere, the index included, is caught and the file named. (The older single-version
   layout has no manifest: its rank files are checked against the index's sizes and hashes.)
2. Layout: the index is consistent (names, shapes and offsets fit each flat buffer; one rank file per saving rank)
   and agrees with every rank file's safetensors header (each shard's element count and dtype).
3. Model (:func:`check_model`, on load into an engine): every parameter and persistent buffer of the model is in the
   checkpoint with the same shape, and the same dtype (or, for floating dtypes, another floating dtype: values are
   converted, as ``load_state_dict`` does; a run saved in fp32 may resume in bf16), and the checkpoint holds nothing
   the model lacks. Checked before any state changes.

Every failure is a :class:`CheckpointError` (a ``ValueError``; ``FileNotFoundError`` for a missing file) naming the
file or the parameter and both values.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from safetensors import safe_open

from zeroshard.checkpoint.checkpoint_dir import Resolved

INDEX = "index.json"
MANIFEST = "manifest.json"
_ST_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip
_FLOATING = {"F64", "F32", "F16", "BF16"}


class CheckpointError(ValueError):
    """A sharded checkpoint is corrupt, inconsistent or does not fit the model."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def write_manifest(directory: Path, entries: dict[str, dict[str, Any]]) -> str:
    """Writes ``manifest.json`` (``{"files": {name: {"bytes", "sha256"}}}``) and returns its SHA-256 (for the
    pointer). Not fsynced here."""
    (directory / MANIFEST).write_text(json.dumps({"format_version": 1, "files": entries}, indent=1, sort_keys=True))
    return sha256(directory / MANIFEST)


def _check_file(directory: Path, name: str, meta: dict[str, Any], listed_in: str) -> None:
    file = directory / name
    if not file.is_file():
        raise FileNotFoundError(f"sharded checkpoint {directory}: {name} is missing ({listed_in} lists it)")
    size = file.stat().st_size
    if size != meta["bytes"]:
        raise CheckpointError(
            f"sharded checkpoint {directory}: {name} has {size} bytes, {listed_in} says {meta['bytes']} (truncated "
            "or changed)"
        )
    if sha256(file) != meta["sha256"]:
        raise CheckpointError(f"sharded checkpoint {directory}: {name} is corrupt (SHA-256 differs from {listed_in})")


def _read_json(directory: Path, name: str) -> Any:
    try:
        return json.loads((directory / name).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"sharded checkpoint {directory}: {name} is missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"sharded checkpoint {directory}: {name} is not valid JSON ({e})") from None


def verify_files(where: Resolved) -> dict[str, Any]:
    """Checks every file of the resolved version (module docstring, step 1) and the index (step 2); returns the index.

    Raises:
        FileNotFoundError: a listed file is missing. CheckpointError: a changed, truncated or inconsistent file.
    """
    d = where.dir
    if (d / MANIFEST).is_file() or where.manifest_sha256 is not None:
        if where.manifest_sha256 is not None and sha256(d / MANIFEST) != where.manifest_sha256:
            raise CheckpointError(
                f"sharded checkpoint {d}: {MANIFEST} is corrupt (SHA-256 differs from {where.root / 'LATEST'})"
            )
        manifest = _read_json(d, MANIFEST)
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or INDEX not in files:
            raise CheckpointError(f"sharded checkpoint {d}: {MANIFEST} lists no {INDEX}")
        for name, meta in files.items():
            _check_file(d, name, meta, MANIFEST)
        index = _read_json(d, INDEX)
        check_index(d, index)
        unlisted = sorted(set(index["files"]) - set(files))
        if unlisted:
            raise CheckpointError(f"sharded checkpoint {d}: {INDEX} names {unlisted}, which {MANIFEST} does not list")
    else:
        if not (d / INDEX).is_file():
            raise CheckpointError(f"sharded checkpoint {d}: {INDEX} is missing")
        index = _read_json(d, INDEX)
        check_index(d, index)
        for name, meta in index["files"].items():
            _check_file(d, name, meta, INDEX)
    check_headers(d, index)
    return index


def check_index(directory: Path, index: Any) -> None:
    """The index's own consistency: required keys, one rank file per saving rank, and each flat parameter's names,
    shapes and offsets fitting its padded buffer (``world_size * shard_numel`` elements)."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"sharded checkpoint {directory}: {INDEX} {what}")

    if not isinstance(index, dict):
        raise bad("is not a JSON object")
    for key in ("world_size", "flat_params", "optimizer", "files"):
        if key not in index:
            raise bad(f"lacks {key!r}")
    world = index["world_size"]
    if not isinstance(world, int) or world < 1:
        raise bad(f"has world_size {world!r}; expected a positive int")
    expected = {rank_file(r) for r in range(world)}
    if set(index["files"]) != expected:
        raise bad(f"lists rank files {sorted(index['files'])}, but world_size {world} means {sorted(expected)}")
    for i, entry in enumerate(index["flat_params"]):
        names, shapes, offsets = entry.get("names"), entry.get("shapes"), entry.get("offsets")
        shard = entry.get("shard_numel")
        if not (isinstance(names, list) and isinstance(shapes, list) and isinstance(offsets, list)):
            raise bad(f"flat parameter {i} lacks names, shapes or offsets")
        if not len(names) == len(shapes) == len(offsets):
            raise bad(f"flat parameter {i}: {len(names)} names, {len(shapes)} shapes, {len(offsets)} offsets")
        if not isinstance(shard, int) or shard < 0:
            raise bad(f"flat parameter {i}: shard_numel {shard!r}")
        if entry.get("dtype") not in _ST_NAMES:
            raise bad(f"flat parameter {i}: dtype {entry.get('dtype')!r}")
        end = 0
        for name, shape, offset in zip(names, shapes, offsets):
            numel = math.prod(shape) if isinstance(shape, list) and all(isinstance(s, int) for s in shape) else -1
            if numel < 0 or not isinstance(offset, int) or offset < end:
                raise bad(f"parameter {name}: shape {shape} at offset {offset} overlaps the previous parameter")
            end = offset + numel
        if end > world * shard:
            raise bad(
                f"parameter {names[-1]}: ends at element {end}, past the flat buffer's {world} x {shard} elements"
            )


def check_headers(directory: Path, index: dict[str, Any]) -> None:
    """Every rank file's safetensors header against the index: each ``flat.{i}.*`` shard has ``shard_numel``
    elements, the parameter shard the index's dtype, the master fp32, and no flat index is beyond the index's."""
    entries = index["flat_params"]
    for name in sorted(index["files"]):
        with safe_open(str(directory / name), framework="pt") as f:
            for key in f.keys():
                if not key.startswith("flat."):
                    continue
                i_text, kind = key[5:].split(".", 1)
                i = int(i_text)
                if i >= len(entries):
                    raise CheckpointError(
                        f"sharded checkpoint {directory}: {name} holds {key}, but {INDEX} lists {len(entries)} flat "
                        "parameters"
                    )
                sl = f.get_slice(key)
                numel, dtype = math.prod(sl.get_shape()), sl.get_dtype()
                want_dtype = _ST_NAMES[entries[i]["dtype"]] if kind == "param" else "F32"
                if numel != entries[i]["shard_numel"] or (kind in ("param", "master") and dtype != want_dtype):
                    raise CheckpointError(
                        f"sharded checkpoint {directory}: {name} holds {key} with {numel} elements of {dtype}; "
                        f"{INDEX} says {entries[i]['shard_numel']} elements"
                        f"{f' of {want_dtype}' if kind in ('param', 'master') else ''} (flat parameter {i}: "
                        f"{entries[i]['names'][:3]}...)"
                    )
            for i, entry in enumerate(entries):
                if f"flat.{i}.param" not in f.keys():
                    raise CheckpointError(
                        f"sharded checkpoint {directory}: {name} lacks flat.{i}.param ({entry['names'][:3]}...)"
                    )


def saved_tensors(directory: Path, index: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
    """``name -> (shape, safetensors dtype)`` of every saved parameter and persistent buffer (``buffer.`` prefixed)."""
    out = {}
    for entry in index["flat_params"]:
        for name, shape in zip(entry["names"], entry["shapes"]):
            out[name] = (list(shape), _ST_NAMES[entry["dtype"]])
    with safe_open(str(directory / rank_file(0)), framework="pt") as f:
        for key in f.keys():
            if key.startswith(("param.", "buffer.")):
                sl = f.get_slice(key)
                kind, name = key.split(".", 1)
                out[name if kind == "param" else key] = (list(sl.get_shape()), sl.get_dtype())
    return out


def check_model(directory: Path, index: dict[str, Any], engine, buffers: list[tuple[str, Any]]) -> None:
    """The checkpoint against the engine's model (module docstring, step 3), before anything is loaded.

    Raises:
        CheckpointError: naming the parameter or buffer and both shapes (or dtypes), or the missing or extra names.
    """
    saved = saved_tensors(directory, index)
    want: dict[str, tuple[list[int], str]] = {}
    for fp in engine.all_flat_params:
        for name, shape in zip(fp.names, fp.layout.shapes):
            want[name] = (list(shape), _ST_NAMES[str(fp.dtype).removeprefix("torch.")])
    for name, p in engine.unsharded_parameters():
        want[name] = (list(p.shape), _ST_NAMES[str(p.dtype).removeprefix("torch.")])
    for name, b in buffers:
        want[f"buffer.{name}"] = (list(b.shape), _ST_NAMES[str(b.dtype).removeprefix("torch.")])
    missing = [n for n in want if n not in saved]
    extra = [n for n in saved if n not in want]
    if missing or extra:
        raise CheckpointError(
            f"sharded checkpoint {directory} does not fit the model: the model has {missing[:8]} that the checkpoint "
            f"lacks, the checkpoint has {extra[:8]} that the model lacks ('buffer.' marks persistent buffers). Build "
            "the same model as the run that saved it"
        )
    for name, (shape, dtype) in want.items():
        s_shape, s_dtype = saved[name]
        if s_shape != shape:
            raise CheckpointError(
                f"sharded checkpoint {directory}: {name} has shape {s_shape} in the checkpoint and {shape} in the model"
            )
        if s_dtype != dtype and not (s_dtype in _FLOATING and dtype in _FLOATING):
            raise CheckpointError(
                f"sharded checkpoint {directory}: {name} is {s_dtype} in the checkpoint and {dtype} in the model"
            )

"""Verification of a sharded checkpoint before anything is loaded from it: every file, then the layout.

1. Files: ``manifest.json`` lists the size and SHA-256 of every other file of the version (``index.json``, the rank
   files, the trainer state); the pointer (``LATEST``, :mod:`zeroshard.checkpoint.checkpoint_dir`) holds the manifest's
   own SHA-256, so a changed byte anywhere, the index included, is caught and the file named. The manifest is
   required: a directory without one (the older single-version layout, or a version whose manifest was lost) is
   refused, and can be checked and adopted by hand with ``python -m zeroshard.checkpoint.adopt DIR``
   (:mod:`zeroshard.checkpoint.adopt`). Every name the manifest and index give must be a plain name of a regular file
   inside the directory (:mod:`zeroshard.checkpoint.safe_paths`): ``..``, absolute paths and symbolic links are
   refused before anything is opened, and errors say nothing about files outside the directory.
2. Layout: the index is consistent (names, shapes and offsets fit each flat buffer; one rank file per saving rank)
   and agrees with every rank file's safetensors header (each shard's element count and dtype). Every size is checked
   before it is used: ``world_size`` against the number of rank files listed (so ``10**9`` is refused at once), shapes
   as lists of at most 64 non-negative ints whose products fit the flat buffer of ``world_size * shard_numel``
   elements that the headers hold, and JSON depth and size (:mod:`zeroshard.checkpoint.bounded_json`).
3. Model (:func:`check_model`, on load into an engine): every parameter and persistent buffer of the model is in the
   checkpoint with the same shape, and the same dtype (or, for floating dtypes, another floating dtype: values are
   converted, as ``load_state_dict`` does; a run saved in fp32 may resume in bf16), and the checkpoint holds nothing
   the model lacks. Checked before any state changes.

Every failure is a :class:`CheckpointError` (a ``ValueError``; ``FileNotFoundError`` for a missing file) naming the
file or the parameter and both values.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open

from zeroshard.checkpoint import bounded_json
from zeroshard.checkpoint.checkpoint_dir import POINTER, Resolved
from zeroshard.checkpoint.safe_paths import CheckpointError, create_exclusive, regular_file, sha256_of

__all__ = ["CheckpointError", "check_headers", "check_index", "check_model", "verify_files", "write_manifest"]
INDEX = "index.json"
MANIFEST = "manifest.json"
MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
_RANK_FILE = re.compile(r"rank(\d{5,10})\.safetensors")
_ADOPT = "python -m zeroshard.checkpoint.adopt"
_ST_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip
_FLOATING = {"F64", "F32", "F16", "BF16"}


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def sha256(path: Path) -> str:
    """The SHA-256 (hex) of the regular file ``path`` (not followed if a link: refused)."""
    return sha256_of(path.parent, path.name, "the checkpoint")


def file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": regular_file(path.parent, path.name, "the checkpoint").st_size, "sha256": sha256(path)}


def write_manifest(directory: Path, entries: dict[str, dict[str, Any]]) -> str:
    """Writes ``manifest.json`` (``{"files": {name: {"bytes", "sha256"}}}``), created exclusively and fsynced, and
    returns its SHA-256 (for the pointer)."""
    text = json.dumps({"format_version": 1, "files": entries}, indent=1, sort_keys=True)
    create_exclusive(directory / MANIFEST, text.encode())
    return sha256(directory / MANIFEST)


def open_safetensors(directory: Path, name: str):
    """``safe_open`` of the regular file ``directory/name`` (a plain name, not a link); its errors name the file.

    Raises:
        CheckpointError: not a regular file inside ``directory``, or not a valid safetensors file.
    """
    regular_file(directory, name, "the checkpoint")
    try:
        return safe_open(str(directory / name), framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        raise CheckpointError(
            f"sharded checkpoint {directory}: {name} is not a valid safetensors file ({type(e).__name__}: "
            f"{str(e)[:200]})"
        ) from None


def _check_meta(directory: Path, name: str, meta: Any, listed_in: str) -> None:
    ok = isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and not isinstance(meta["bytes"], bool)
    if not (ok and meta["bytes"] >= 0 and isinstance(meta.get("sha256"), str)):
        raise CheckpointError(
            f'sharded checkpoint {directory}: {listed_in} lists {name} as {str(meta)[:100]}; expected {{"bytes": '
            'int, "sha256": str}'
        )


def _check_file(directory: Path, name: str, meta: dict[str, Any], listed_in: str) -> None:
    """``name`` (a plain name of a regular file inside ``directory``) has the size and SHA-256 ``meta`` says."""
    size = regular_file(directory, name, listed_in).st_size  # outside names and links refused before any stat
    if size != meta["bytes"]:
        raise CheckpointError(
            f"sharded checkpoint {directory}: {name} has {size} bytes, {listed_in} says {meta['bytes']} (truncated "
            "or changed)"
        )
    if sha256_of(directory, name, listed_in) != meta["sha256"]:
        raise CheckpointError(f"sharded checkpoint {directory}: {name} is corrupt (SHA-256 differs from {listed_in})")


def _read_json(directory: Path, name: str) -> Any:
    """The JSON in ``directory/name``, size and depth bounded (:mod:`zeroshard.checkpoint.bounded_json`)."""
    try:
        return bounded_json.read(directory, name, "the checkpoint")
    except FileNotFoundError:
        raise FileNotFoundError(f"sharded checkpoint {directory}: {name} is missing") from None


def missing_manifest(directory: Path) -> CheckpointError:
    """The refusal of a version directory without ``manifest.json``, with the way to adopt it."""
    return CheckpointError(
        f"sharded checkpoint {directory} has no {MANIFEST}, so its files cannot be verified, and it is not loaded "
        "(every save since versioned checkpoints writes one; a directory lacks it when an older zeroshard wrote it, or "
        "when the manifest was lost or removed). If you trust these files, check and adopt them by hand: "
        f"`{_ADOPT} "
        f"{directory}` (or zeroshard.checkpoint.adopt.adopt_checkpoint(path)) checks the rank files against the "
        f"index's sizes and SHA-256, the index against their safetensors headers and the trainer state's structure, "
        f"then writes {MANIFEST}"
    )


def verify_files(where: Resolved) -> dict[str, Any]:
    """Checks every file of the resolved version (module docstring, step 1) and the index (step 2); returns the index.

    Raises:
        FileNotFoundError: a listed file is missing. CheckpointError: a changed, truncated, inconsistent or unconfined
            file, or no manifest.
    """
    d = where.dir
    try:
        regular_file(d, MANIFEST, "the checkpoint layout")
    except FileNotFoundError:
        raise missing_manifest(d) from None
    if where.manifest_sha256 is not None and sha256(d / MANIFEST) != where.manifest_sha256:
        raise CheckpointError(
            f"sharded checkpoint {d}: {MANIFEST} is corrupt (SHA-256 differs from {where.root / POINTER})"
        )
    manifest = _read_json(d, MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or INDEX not in files:
        raise CheckpointError(f"sharded checkpoint {d}: {MANIFEST} lists no {INDEX}")
    for name, meta in files.items():  # every name confined and every entry well-formed before any file is hashed
        regular_file(d, name, MANIFEST)
        _check_meta(d, name, meta, MANIFEST)
    for name, meta in files.items():
        _check_file(d, name, meta, MANIFEST)
    index = _read_json(d, INDEX)
    check_index(d, index)
    unlisted = sorted(set(index["files"]) - set(files))
    if unlisted:
        raise CheckpointError(f"sharded checkpoint {d}: {INDEX} names {unlisted}, which {MANIFEST} does not list")
    check_headers(d, index)
    return index


def check_index_files(directory: Path, index: dict[str, Any]) -> None:
    """The rank files against the sizes and SHA-256 the index lists (what :mod:`.adopt` can check without a
    manifest). Call after :func:`check_index`."""
    for name, meta in index["files"].items():
        _check_meta(directory, name, meta, INDEX)
        _check_file(directory, name, meta, INDEX)


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
    world, files = index["world_size"], index["files"]
    if not _is_int(world) or world < 1:
        raise bad(f"has world_size {world!r}; expected a positive int")
    if not isinstance(files, dict):
        raise bad(f"has files {str(files)[:100]}; expected an object of rank file names")
    # bounded by the files listed (which a JSON of bounded size holds), never by world_size itself
    parsed = [(name, _RANK_FILE.fullmatch(name)) for name in files if isinstance(name, str)]
    ranks = {int(m.group(1)) for name, m in parsed if m and name == rank_file(int(m.group(1)))}
    if len(files) != world or ranks != set(range(len(files))):
        means = [rank_file(r) for r in range(world)] if world <= 16 else f"{rank_file(0)} .. {rank_file(world - 1)}"
        raise bad(f"lists rank files {sorted(map(str, files))[:16]}, but world_size {world} means {means}")
    if not isinstance(index["flat_params"], list):
        raise bad("has flat_params that is not a list")
    for i, entry in enumerate(index["flat_params"]):
        if not isinstance(entry, dict):
            raise bad(f"flat parameter {i} is not an object")
        names, shapes, offsets = entry.get("names"), entry.get("shapes"), entry.get("offsets")
        shard = entry.get("shard_numel")
        if not (isinstance(names, list) and isinstance(shapes, list) and isinstance(offsets, list)):
            raise bad(f"flat parameter {i} lacks names, shapes or offsets")
        if not len(names) == len(shapes) == len(offsets):
            raise bad(f"flat parameter {i}: {len(names)} names, {len(shapes)} shapes, {len(offsets)} offsets")
        if not _is_int(shard) or shard < 0:
            raise bad(f"flat parameter {i}: shard_numel {shard!r}")
        if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in _ST_NAMES:
            raise bad(f"flat parameter {i}: dtype {str(entry.get('dtype'))[:40]!r}")
        end = 0
        for name, shape, offset in zip(names, shapes, offsets):
            if not isinstance(name, str):
                raise bad(f"flat parameter {i}: parameter name {str(name)[:60]!r} is not a string")
            if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_int(s) and s >= 0 for s in shape)):
                raise bad(
                    f"parameter {name}: shape {str(shape)[:100]}; expected a list of at most {MAX_DIMS} non-negative "
                    "ints"
                )
            if not _is_int(offset) or offset < end:
                raise bad(f"parameter {name}: shape {shape} at offset {offset} overlaps the previous parameter")
            end = offset + math.prod(shape)
        if end > world * shard:
            raise bad(
                f"parameter {names[-1]}: ends at element {end}, past the flat buffer's {world} x {shard} elements"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _quant_block(index: dict[str, Any]) -> int:
    """Elements per absmax of int8 optimizer moments (``index["optimizer"]["quant_block"]``, 2048 when absent).

    Raises:
        CheckpointError: a value that is not a positive int.
    """
    block = index.get("optimizer", {}).get("quant_block", 2048) if isinstance(index.get("optimizer"), dict) else 2048
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 2**30:
        raise CheckpointError(
            f"sharded checkpoint: {INDEX} optimizer.quant_block {str(block)[:40]!r} is not a block size (int >= 1)"
        )
    return block


def check_headers(directory: Path, index: dict[str, Any]) -> None:
    """Every rank file's safetensors header against the index: each ``flat.{i}.*`` shard has ``shard_numel``
    elements, the parameter shard the index's dtype, the master fp32, and no flat index is beyond the index's."""
    entries = index["flat_params"]
    for name in sorted(index["files"]):
        with open_safetensors(directory, name) as f:
            for key in f.keys():
                if not key.startswith("flat."):
                    continue
                m = re.fullmatch(r"flat\.(\d{1,9})\.(param|master|optim\..+)", key)
                if m is None:
                    raise CheckpointError(
                        f"sharded checkpoint {directory}: {name} holds {key[:100]!r}; expected flat.<i>.param, "
                        "flat.<i>.master or flat.<i>.optim.<key>"
                    )
                i, kind = int(m.group(1)), m.group(2)
                if i >= len(entries):
                    raise CheckpointError(
                        f"sharded checkpoint {directory}: {name} holds {key}, but {INDEX} lists {len(entries)} flat "
                        "parameters"
                    )
                sl = f.get_slice(key)
                numel, dtype = math.prod(sl.get_shape()), sl.get_dtype()
                want_dtype = _ST_NAMES[entries[i]["dtype"]] if kind == "param" else "F32"
                want_numel = entries[i]["shard_numel"]
                if kind.endswith("_absmax"):  # int8 moments' block scales: one fp32 per block of the shard
                    block = _quant_block(index)
                    want_numel, kind = -(-want_numel // block), "absmax"
                if numel != want_numel or (kind in ("param", "master", "absmax") and dtype != want_dtype):
                    raise CheckpointError(
                        f"sharded checkpoint {directory}: {name} holds {key} with {numel} elements of {dtype}; "
                        f"{INDEX} says {want_numel} elements"
                        f"{f' of {want_dtype}' if kind in ('param', 'master', 'absmax') else ''} (flat parameter {i}: "
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
    with open_safetensors(directory, rank_file(0)) as f:
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

"""Consolidate a sharded checkpoint into plain files, one parameter at a time, with no GPU and no process group.

    python -m zeroshard.consolidate CKPT_DIR OUT [--format safetensors|torch|lightning] [--dtype bf16|fp32|fp16]
                                                [--max_shard_size 5GB] [--no-master]
    python -m zeroshard.consolidate CKPT_DIR OUT_DIR --hf [--dtype bf16] [--hf_module NAME]

Each parameter is assembled from the saved flat shards of every rank (reading only its element ranges) and streamed
into the output before the next is read: safetensors headers are written first (every shape is in the index), so
peak memory is about the largest parameter, not the model. ``--format torch`` and ``--format lightning`` hold the
whole state dict, as ``torch.save`` needs. The fp32 master weights are used when the run
kept them apart from the parameters (mixed precision), so nothing is lost to bf16 rounding unless ``--dtype bf16``.
Only what ``module.state_dict()`` holds is written: parameters and persistent buffers.

Output:
    ``--format safetensors``: ``OUT/model.safetensors``, or ``OUT/model-0000k-of-0000n.safetensors`` plus
    ``OUT/model.safetensors.index.json`` (the Hugging Face layout) when larger than ``--max_shard_size``; the names are
    the saved module's own (``model.transformer.wte.weight`` for a LightningModule holding ``self.model``).
    ``--format torch``: ``OUT`` is one file for ``torch.load`` / ``module.load_state_dict``.
    ``--format lightning``: ``OUT`` is one file in Lightning's checkpoint format (``state_dict`` plus the saved
    trainer state: ``hyper_parameters``, ``pytorch-lightning_version``, loops, ...; no optimizer state), for
    ``LightningModule.load_from_checkpoint`` (as Lightning's FSDP ``consolidate_checkpoint`` and DeepSpeed's
    ``convert_zero_checkpoint_to_fp32_state_dict`` do).
    ``--hf``: ``OUT`` is a directory ``transformers``' ``from_pretrained`` loads: the Hugging Face model recorded at
    save time (:mod:`zeroshard.checkpoint.hf_export`) under its own names (prefix removed, tied duplicates dropped, LoRA
    merged), safetensors, ``config.json`` and ``generation_config.json``.

Every output is written atomically (:mod:`zeroshard.checkpoint.atomic_write`): all checks (shapes, dtypes, sizes, LoRA
shapes and patterns) run and every header is built before the first byte is written; each file is written under a
temporary name created exclusively, fsynced, then renamed; a directory output is staged whole and renamed into place
(into a new or empty ``OUT``: one step, so a kill leaves nothing or everything), the shard index and ``config.json``
last. Into an ``OUT`` holding a previous output, the previous one stays whole until every new file is written, then is
replaced: its files of these names that the new output does not write (older shards, an index) are removed; other
files are kept. A killed run's temporaries are removed by the next run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zeroshard.checkpoint.atomic_write import StagedDir, atomic_file, kill_point
from zeroshard.checkpoint.hf_export import hf_config_files, hf_tensor_plan, merge_lora
from zeroshard.checkpoint.sharded_checkpoint import _SavedShards, open_checkpoint, read_trainer_state, verify

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


_ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


class _Item:
    """One output tensor: its name, shape and dtype (known from the index before any data is read) and its reader."""

    def __init__(self, name: str, shape: list[int], dtype: torch.dtype, read) -> None:
        self.name, self.shape, self.dtype, self.read = name, list(shape), dtype, read

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def plan_parameters(ckpt: str | Path, *, master: bool = True) -> list[_Item]:
    """Every parameter and buffer of a sharded checkpoint, without reading any values yet.

    Tied weights appear under every name the module's ``state_dict()`` had.

    Raises:
        FileNotFoundError / ValueError: for a missing, corrupt or inconsistent file, the index included (every file is
            checked first: :func:`zeroshard.checkpoint.sharded_checkpoint.verify`).
    """
    where, index = open_checkpoint(ckpt)
    saved = _SavedShards(where.dir, index)
    index = saved.index

    def parameter(name: str) -> _Item:
        i, _ = saved.where[name]
        entry = index["flat_params"][i]
        shape = entry["shapes"][entry["names"].index(name)]
        kind = "master" if master and entry["trainable"] else "param"
        dtype = torch.float32 if kind == "master" else getattr(torch, entry["dtype"])

        def read() -> torch.Tensor:
            out = torch.empty(torch.Size(shape).numel(), dtype=dtype)
            saved.read(kind, name, 0, out.numel(), out)
            return out.view(shape)

        return _Item(name, shape, dtype, read)

    items = [parameter(name) for entry in index["flat_params"] for name in entry["names"]]
    rank0 = saved._file(0)
    for key in rank0.keys():
        if key.startswith(("buffer.", "param.")):
            sl = rank0.get_slice(key)
            dtype = {v: k for k, v in _ST_DTYPES.items()}[sl.get_dtype()]
            items.append(_Item(key.split(".", 1)[1], sl.get_shape(), dtype, lambda key=key: saved.read_whole(key)))
    by_name = {item.name: item for item in items}
    for alias, name in index.get("aliases", {}).items():
        if name in by_name:  # a flat parameter, or a whole one (frozen at stages 1-2) or a buffer
            item = by_name[name]
            items.append(_Item(alias, item.shape, item.dtype, item.read))
    return items


def iter_parameters(ckpt: str | Path, *, master: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` for every parameter and buffer of a sharded checkpoint, one at a time (CPU)."""
    for item in plan_parameters(ckpt, master=master):
        yield item.name, item.read()


def _st_dtype(item: _Item, dtype: torch.dtype) -> str:
    if dtype not in _ST_DTYPES:
        raise ValueError(f"tensor {item.name}: dtype {dtype} has no safetensors form; use --dtype to cast it")
    return _ST_DTYPES[dtype]


def _item_bytes(item: _Item, cast) -> int:
    """Bytes of ``item`` in its output dtype, after checking its shape (non-negative integer sizes)."""
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item.shape):
        raise ValueError(f"tensor {item.name}: shape {item.shape} is not a list of non-negative sizes")
    dtype = cast(item.dtype)
    _st_dtype(item, dtype)
    return math.prod(item.shape) * torch.empty((), dtype=dtype).element_size()


def _safetensors_header(items: list[_Item], cast, metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """The safetensors header of ``items`` (8-byte little-endian length, then the JSON, padded so the data starts
    8-byte aligned) and the data's size in bytes. Raises ValueError for a bad shape or dtype, or a repeated name."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for item in items:
        if item.name in header:
            raise ValueError(f"tensor {item.name} appears twice in the output")
        n = _item_bytes(item, cast)
        header[item.name] = {
            "dtype": _st_dtype(item, cast(item.dtype)),
            "shape": item.shape,
            "data_offsets": [offset, offset + n],
        }
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob, offset


def _write_safetensors(f, header: bytes, items: list[_Item], cast) -> None:
    """Streams ``items`` into ``f`` after ``header``: each tensor's bytes as it is read, so only one tensor is in
    memory at a time. Each tensor read is checked against the header's shape before its bytes go out."""
    f.write(header)
    for item in items:
        t = item.read().to(cast(item.dtype)).contiguous()
        if list(t.shape) != item.shape:
            raise ValueError(f"tensor {item.name}: read {list(t.shape)}, the plan says {item.shape}")
        if t.numel():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        kill_point("consolidate_tensor", 0)


def _check_written(path: Path, header: bytes, size: int) -> None:
    """The file safetensors reads back has the planned size and header (checked before it gets its final name)."""
    if path.stat().st_size != len(header) + size:
        raise OSError(f"{path.name}: wrote {path.stat().st_size} bytes, expected {len(header) + size}")
    with safe_open(str(path), framework="pt") as f:
        f.keys()  # parses the header and checks the offsets against the file's size


_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_INDEX_NAME = "model.safetensors.index.json"


def _write_files(
    out: Path, items: list[_Item], cast, max_shard_size: int, metadata=None, extra: dict[str, bytes] | None = None
) -> list[Path]:
    """``out/model.safetensors``, or numbered files of at most ``max_shard_size`` bytes plus the HF index JSON, and
    ``extra`` files (``config.json``: written last), committed together (:class:`StagedDir`): every check runs and
    every header is built before the first byte is written, and nothing appears under a final name before every file
    is complete. Files of a previous output in ``out`` that this one does not replace (older shards) are removed."""
    extra = extra or {}
    groups: list[list[_Item]] = [[]]
    size = total = 0
    for item in items:
        n = _item_bytes(item, cast)
        if groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
        total += n
    if len(groups) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)]
    headers = [_safetensors_header(group, cast, metadata) for group in groups]
    index = None
    if len(groups) > 1:
        weight_map = {item.name: name for name, group in zip(names, groups) for item in group}
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
    ours = set(extra) | {"model.safetensors", _INDEX_NAME}
    markers = {"model.safetensors", _INDEX_NAME, "config.json"}
    staged = StagedDir(out, lambda n: n in ours or _SHARD.fullmatch(n) is not None, markers)
    try:
        for name, group, (header, nbytes) in zip(names, groups, headers):
            with staged.open(name) as f:
                _write_safetensors(f, header, group, cast)
            _check_written(staged.stage / name, header, nbytes)
        if index is not None:
            staged.write(_INDEX_NAME, index)
        for name in sorted(extra, key=lambda n: n == "config.json"):
            staged.write(name, extra[name])
        files = staged.commit()
    finally:
        staged.close()
    return [f for f in files if f.name.endswith(".safetensors")]  # the weights (the index and extras apart)


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for suffix, mult in units.items():
        if text.upper().endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def _caster(dtype: torch.dtype | None):
    """dtype -> output dtype: floating tensors become ``dtype`` when one is asked for; others keep theirs."""
    return lambda d: dtype if dtype is not None and d.is_floating_point else d


def consolidate(
    ckpt: str | Path,
    out: str | Path,
    *,
    fmt: str = "safetensors",
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    master: bool = True,
    weights_only: bool | None = None,
) -> list[Path]:
    """Writes the checkpoint's full parameters to ``out``; returns the files written.

    safetensors output is streamed (peak memory about the largest tensor); ``fmt="torch"`` (the state dict) and
    ``fmt="lightning"`` (:func:`lightning_checkpoint`: Lightning's format, for ``load_from_checkpoint``) build the whole
    state dict in memory, as ``torch.save`` needs. ``weights_only=False`` (``--allow-pickle``) lets ``lightning``
    read trainer-state objects saved with pickle (:mod:`zeroshard.checkpoint.trainer_state`).

    Raises:
        ValueError: for an unknown ``fmt``; FileNotFoundError / ValueError for a missing or corrupt checkpoint file;
        UnsafeCheckpointError: ``fmt="lightning"``, pickled trainer state and ``weights_only`` not False.
    """
    if fmt not in ("safetensors", "torch", "lightning"):
        raise ValueError(f"--format {fmt!r}: use 'safetensors', 'torch' or 'lightning'")
    out, cast = Path(out), _caster(dtype)
    items = plan_parameters(ckpt, master=master)
    if fmt in ("torch", "lightning"):
        state = {item.name: item.read().to(cast(item.dtype)) for item in items}
        if fmt == "lightning":
            state = {**read_trainer_state(ckpt, weights_only), "state_dict": state}
        with atomic_file(out) as f:
            torch.save(state, f)
        return [out]
    return _write_files(out, items, cast, max_shard_size)


def full_state_dict(ckpt: str | Path, *, master: bool = True) -> dict[str, torch.Tensor]:
    """The saved module's whole ``state_dict()`` (CPU tensors; fp32 masters where kept), for ``load_state_dict``.

    Holds every tensor in memory at once (unlike the streamed safetensors output).
    """
    return {item.name: item.read() for item in plan_parameters(ckpt, master=master)}


def lightning_checkpoint(ckpt: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """The checkpoint in Lightning's format without optimizer state: the saved trainer state (``hyper_parameters``,
    ``pytorch-lightning_version``, loops, callbacks, ...; pickled objects only with ``weights_only=False``) plus
    ``state_dict`` (:func:`full_state_dict`)."""
    return {**read_trainer_state(ckpt, weights_only), "state_dict": full_state_dict(ckpt)}


def export_hf(
    ckpt: str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
    module: str | None = None,
    max_shard_size: int = 5 * 10**9,
) -> list[Path]:
    """Writes the Hugging Face model recorded in a sharded checkpoint as a directory ``from_pretrained`` loads.

    Tensors are streamed as in :func:`consolidate`, under the HF model's own names (see
    :func:`zeroshard.checkpoint.hf_export.hf_tensor_plan`), in ``dtype`` (floating tensors; default as saved, fp32
    masters where kept); ``config.json`` (``dtype`` set to the written dtype, ``architectures`` to the class) and
    ``generation_config.json`` are written beside them. Tensors of the module outside the HF model are left out,
    with a warning naming them. Returns the files written.

    Raises:
        ValueError: the checkpoint records no Hugging Face model (it was saved from a module holding none, or before
            this was recorded), several and ``module`` is not given or names none of them, or a PEFT setting the
            LoRA merge does not support.
    """
    ckpt, out = Path(ckpt), Path(out)
    models = verify(ckpt).get("hf_models") or []
    if not models:
        raise ValueError(
            f"{ckpt} records no Hugging Face model (the saved module held no transformers.PreTrainedModel, or the "
            "checkpoint predates this record); use --format safetensors and map the names yourself"
        )
    names = [m["name"] for m in models]
    if module is None and len(models) > 1:
        raise ValueError(f"{ckpt} holds {len(models)} Hugging Face models {names}: pick one with --hf_module NAME")
    chosen = [m for m in models if module is None or m["name"] == module]
    if not chosen:
        raise ValueError(f"--hf_module {module!r}: the checkpoint's Hugging Face models are {names}")
    model = chosen[0]
    items = {item.name: item for item in plan_parameters(ckpt)}
    plan, left_out = hf_tensor_plan(list(items), {n: i.shape for n, i in items.items()}, model)
    if left_out:
        warnings.warn(
            f"--hf leaves out {len(left_out)} tensors outside the Hugging Face model: {left_out[:8]}", stacklevel=2
        )

    def item(t) -> _Item:
        base = items[t.source]
        if t.lora_a is None:
            return _Item(t.name, base.shape, base.dtype, base.read)
        read_a, read_b = items[t.lora_a].read, items[t.lora_b].read
        return _Item(
            t.name, base.shape, base.dtype, lambda: merge_lora(base.read(), read_a(), read_b(), t.scaling, t.transpose)
        )

    cast = _caster(dtype)
    floating = {cast(items[t.source].dtype) for t in plan if items[t.source].dtype.is_floating_point}
    configs = {
        name: (json.dumps(content, indent=2, sort_keys=True) + "\n").encode()
        for name, content in hf_config_files(model, floating.pop() if len(floating) == 1 else None).items()
    }
    files = _write_files(out, [item(t) for t in plan], cast, max_shard_size, {"format": "pt"}, configs)
    return files + [out / name for name in configs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zeroshard.consolidate", description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", help="a sharded checkpoint directory (ZeroStrategy(state_dict_type='sharded'))")
    p.add_argument("out", help="output directory (safetensors, --hf) or file (torch, lightning)")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "torch", "lightning"])
    p.add_argument("--hf", action="store_true", help="write the Hugging Face model for from_pretrained (a directory)")
    p.add_argument("--hf_module", default=None, help="with --hf: which HF model, when the module held several")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="cast floating tensors (default: as saved)")
    p.add_argument("--max_shard_size", default="5GB", help="largest output file, e.g. 500MB, 5GB")
    p.add_argument("--no-master", action="store_true", help="write the compute-dtype parameters, not fp32 masters")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="--format lightning: also load trainer-state objects saved with pickle (e.g. a dataclass in "
        "hyper_parameters); unpickling can run code: only for checkpoints you trust (weights_only=False)",
    )
    args = p.parse_args(argv)
    dtype = _DTYPES[args.dtype] if args.dtype else None
    if args.hf:
        if args.format != "safetensors" or args.no_master:
            p.error("--hf writes safetensors from the fp32 masters: drop --format / --no-master")
        files = export_hf(
            args.ckpt, args.out, dtype=dtype, module=args.hf_module, max_shard_size=_parse_size(args.max_shard_size)
        )
    else:
        files = consolidate(
            args.ckpt,
            args.out,
            fmt=args.format,
            dtype=dtype,
            max_shard_size=_parse_size(args.max_shard_size),
            master=not args.no_master,
            weights_only=False if args.allow_pickle else None,
        )
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} file(s), {total / 2**20:.1f} MiB: " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

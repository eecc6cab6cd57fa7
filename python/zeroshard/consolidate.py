"""Consolidate a sharded checkpoint into plain files, one parameter at a time, with no GPU and no process group.

    python -m zeroshard.consolidate CKPT_DIR OUT [--format safetensors|torch] [--dtype bf16|fp32]
                                                [--max_shard_size 5GB] [--no-master]

Each parameter is assembled from the saved flat shards of every rank (reading only its element ranges) and streamed
into the output before the next is read: safetensors headers are written first (every shape is in the index), so
peak memory is about the largest parameter, not the model. ``--format torch`` holds the whole state dict, as
``torch.save`` needs. The fp32 master weights are used when the run
kept them apart from the parameters (mixed precision), so nothing is lost to bf16 rounding unless ``--dtype bf16``.

Output:
    ``--format safetensors``: ``OUT/model.safetensors``, or ``OUT/model-0000k-of-0000n.safetensors`` plus
    ``OUT/model.safetensors.index.json`` (the Hugging Face layout) when larger than ``--max_shard_size``.
    ``--format torch``: ``OUT`` is one file for ``torch.load`` / ``module.load_state_dict``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from zeroshard.sharded_checkpoint import _SavedShards, verify

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
        FileNotFoundError / ValueError: for a missing or corrupt file (checked against the index first).
    """
    ckpt = Path(ckpt)
    saved = _SavedShards(ckpt, verify(ckpt))
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
    for alias, name in index.get("aliases", {}).items():
        if name in saved.where:
            item = parameter(name)
            items.append(_Item(alias, item.shape, item.dtype, item.read))
    return items


def iter_parameters(ckpt: str | Path, *, master: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` for every parameter and buffer of a sharded checkpoint, one at a time (CPU)."""
    for item in plan_parameters(ckpt, master=master):
        yield item.name, item.read()


def _write_safetensors(path: Path, items: list[_Item], cast) -> None:
    """Streams ``items`` into one safetensors file: the header first (shapes are known), then each tensor's bytes as
    it is read, so only one tensor is in memory at a time."""
    header, offset = {}, 0
    for item in items:
        dtype = cast(item.dtype)
        n = torch.Size(item.shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[item.name] = {"dtype": _ST_DTYPES[dtype], "shape": item.shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for item in items:
            t = item.read().to(cast(item.dtype)).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for suffix, mult in units.items():
        if text.upper().endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def consolidate(
    ckpt: str | Path,
    out: str | Path,
    *,
    fmt: str = "safetensors",
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    master: bool = True,
) -> list[Path]:
    """Writes the checkpoint's full parameters to ``out``; returns the files written.

    safetensors output is streamed (peak memory about the largest tensor); ``fmt="torch"`` builds the whole state dict
    in memory, as ``torch.save`` needs.

    Raises:
        ValueError: for an unknown ``fmt``; FileNotFoundError / ValueError for a missing or corrupt checkpoint file.
    """
    out = Path(out)

    def cast(d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    items = plan_parameters(ckpt, master=master)
    if fmt == "torch":
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({item.name: item.read().to(cast(item.dtype)) for item in items}, out)
        return [out]
    if fmt != "safetensors":
        raise ValueError(f"--format {fmt!r}: use 'safetensors' or 'torch'")
    out.mkdir(parents=True, exist_ok=True)
    groups: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        n = torch.Size(item.shape).numel() * torch.empty((), dtype=cast(item.dtype)).element_size()
        if groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    if len(groups) == 1:
        path = out / "model.safetensors"
        _write_safetensors(path, groups[0], cast)
        return [path]
    files, weight_map = [], {}
    for k, group in enumerate(groups, 1):
        path = out / f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        _write_safetensors(path, group, cast)
        files.append(path)
        weight_map.update({item.name: path.name for item in group})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zeroshard.consolidate", description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", help="a sharded checkpoint directory (ZeroStrategy(state_dict_type='sharded'))")
    p.add_argument("out", help="output directory (safetensors) or file (torch)")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "torch"])
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="cast floating tensors (default: as saved)")
    p.add_argument("--max_shard_size", default="5GB", help="largest output file, e.g. 500MB, 5GB")
    p.add_argument("--no-master", action="store_true", help="write the compute-dtype parameters, not fp32 masters")
    args = p.parse_args(argv)
    files = consolidate(
        args.ckpt,
        args.out,
        fmt=args.format,
        dtype=_DTYPES[args.dtype] if args.dtype else None,
        max_shard_size=_parse_size(args.max_shard_size),
        master=not args.no_master,
    )
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} file(s), {total / 2**20:.1f} MiB: " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

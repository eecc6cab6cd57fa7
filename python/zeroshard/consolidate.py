"""Consolidate a sharded checkpoint into plain files, one parameter at a time, with no GPU and no process group.

    python -m zeroshard.consolidate CKPT_DIR OUT [--format safetensors|torch] [--dtype bf16|fp32]
                                                [--max_shard_size 5GB] [--no-master]

Each parameter is assembled from the saved flat shards of every rank (reading only its element ranges) and written
out before the next is read, so peak memory is about one output shard (``--max_shard_size``), not the model; with
``--format torch`` it is the whole state dict, as ``torch.save`` needs. The fp32 master weights are used when the run
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
from safetensors.torch import save_file

from zeroshard.sharded_checkpoint import _SavedShards, verify

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _read_parameter(saved: _SavedShards, name: str, master: bool) -> torch.Tensor:
    i, _ = saved.where[name]
    entry = saved.index["flat_params"][i]
    shape = entry["shapes"][entry["names"].index(name)]
    kind = "master" if master and entry["trainable"] else "param"
    out = torch.empty(
        torch.Size(shape).numel(), dtype=torch.float32 if kind == "master" else getattr(torch, entry["dtype"])
    )
    saved.read(kind, name, 0, out.numel(), out)
    return out.view(shape)


def iter_parameters(ckpt: str | Path, *, master: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` for every parameter and buffer of a sharded checkpoint, one at a time (CPU).

    Tied weights appear under every name the module's ``state_dict()`` had.

    Raises:
        FileNotFoundError / ValueError: for a missing or corrupt file (checked against the index first).
    """
    ckpt = Path(ckpt)
    index = verify(ckpt)
    saved = _SavedShards(ckpt, index)
    for entry in index["flat_params"]:
        for name in entry["names"]:
            yield name, _read_parameter(saved, name, master)
    for key in saved._file(0).keys():
        if key.startswith(("buffer.", "param.")):
            yield key.split(".", 1)[1], saved.read_whole(key)
    for alias, name in index.get("aliases", {}).items():
        if name in saved.where:
            yield alias, _read_parameter(saved, name, master)


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
    """Writes the checkpoint's full parameters to ``out``; returns the files written."""
    out = Path(out)
    cast = (lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t) if dtype else (lambda t: t)
    if fmt == "torch":
        state = {name: cast(t) for name, t in iter_parameters(ckpt, master=master)}
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, out)
        return [out]
    if fmt != "safetensors":
        raise ValueError(f"--format {fmt!r}: use 'safetensors' or 'torch'")
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    written: list[Path] = []
    for name, t in iter_parameters(ckpt, master=master):
        t = cast(t).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            path = out / f"part-{len(shards):05d}.safetensors"
            save_file(shards[-1], str(path))
            written.append(path)
            shards[-1] = {}  # free the written tensors: peak memory stays about one shard
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(written) == 0:
        path = out / "model.safetensors"
        save_file(shards[-1], str(path))
        return [path]
    path = out / f"part-{len(shards):05d}.safetensors"
    save_file(shards[-1], str(path))
    written.append(path)
    # rename to the Hugging Face pattern and write the index
    n = len(written)
    final, weight_map = [], {}
    for k, p in enumerate(written, 1):
        target = out / f"model-{k:05d}-of-{n:05d}.safetensors"
        p.rename(target)
        final.append(target)
        from safetensors import safe_open

        with safe_open(str(target), framework="pt") as f:
            weight_map.update({key: target.name for key in f.keys()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return final


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

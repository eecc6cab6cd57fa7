"""Sharded checkpoints: each rank writes its own flat shards; any world size and stage loads them.

Layout of a checkpoint directory::

    index.json                 layouts of every flat parameter (names, shapes, offsets, shard size), optimizer param
                               groups and scalar state, the size and SHA-256 of every file, and the Hugging Face
                               models inside the module (prefix, class, config; for ``consolidate --hf``)
    rank00000.safetensors ...  one per saving rank (with hybrid sharding only replica group 0 writes; the index
                               says so): its parameter shard, fp32 master shard and per-element optimizer
                               state shards for every flat parameter (``flat.{i}.param``, ``flat.{i}.master``,
                               ``flat.{i}.optim.{key}``) and its torch (and CUDA) RNG state (``rng.*``); rank 0 adds
                               persistent buffers and unsharded parameters
    trainer.pt                 Lightning's non-model state (loops, schedulers, RNG, precision), ``torch.save``

No rank gathers anything to save. A save goes to ``<path>.partial`` and is renamed to ``<path>`` only when every rank
has finished, so a crash mid-save leaves the previous checkpoint whole. On load each rank works out, from the saved
layouts and its own new ones (``FlatParamLayout.shard_slices``), which element ranges of which saved shards it needs
and reads only those (safetensors slices are memory-mapped), so N ranks can save and M ranks load (DeepSpeed needs an
offline conversion for that; FSDP2 does it through DCP). Files are checked against the index's sizes and checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from zeroshard.hf_export import describe_hf_models

INDEX = "index.json"
TRAINER_STATE = "trainer.pt"
FORMAT_VERSION = 1


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_sharded(engine, path: str | os.PathLike, trainer_state: dict[str, Any] | None = None) -> None:
    """Writes a sharded checkpoint directory; collective (every rank calls it with the same ``path``).

    Raises:
        OSError: from the file system; the previous checkpoint at ``path`` is then untouched.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    rank, world = engine.rank, engine.world_size
    group = engine.groups.world  # every data-parallel rank takes part in the barriers
    if engine.replicate_rank != 0:  # hybrid sharding: replica group 0 holds the same shards and writes them
        _wait_for_writers(group)
        return
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier(group=group)

    tensors: dict[str, torch.Tensor] = {}
    layouts, scalar_state = [], {}
    for i, fp in enumerate(engine.all_flat_params):
        tensors[f"flat.{i}.param"] = fp.shard.detach().cpu()
        entry = {
            "names": fp.names,
            "shapes": [list(s) for s in fp.layout.shapes],
            "offsets": list(fp.layout.offsets),
            "shard_numel": fp.layout.shard_numel,
            "dtype": str(fp.dtype).removeprefix("torch."),
            "trainable": fp.trainable,
        }
        if fp.trainable:
            if not fp.master_aliases_shard:
                tensors[f"flat.{i}.master"] = fp.master.detach().cpu()
            for key, value in engine.optim.optimizer_of(fp).state.get(fp.master, {}).items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == fp.layout.shard_numel:
                    tensors[f"flat.{i}.optim.{key}"] = value.detach().cpu()
                else:
                    scalar_state.setdefault(str(i), {})[key] = value.item() if torch.is_tensor(value) else value
            entry["group"] = engine.optim.group_index_of(fp)  # numbered across optimizers (OptimizerSet)
        layouts.append(entry)
    # this rank's random-number generators, restored when the same rank count loads the checkpoint
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    if rank == 0:
        for name, b in persistent_buffers(engine.module):
            tensors[f"buffer.{name}"] = b.detach().cpu()
        for name, p in engine.unsharded_parameters():
            tensors[f"param.{name}"] = p.detach().cpu()
    file = partial / _rank_file(rank)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file))
    info = {"file": file.name, "bytes": file.stat().st_size, "sha256": _sha256(file)}

    infos: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(infos, info, group=group)
    infos = [i for i in infos if i is not None]
    if rank == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optim.param_groups]
        index = {
            "format_version": FORMAT_VERSION,
            "world_size": world,
            "replicate_size": engine.replicate_size,  # shard groups in the saving run; the files are group 0's
            "written_by_replica": 0,
            "stage": engine.config.stage,
            "flat_params": layouts,
            "optimizer": {
                "param_groups": groups,
                "scalar_state": scalar_state,
                "group_optimizer": engine.optim.group_optimizer,  # which optimizer owns each group
            },
            "files": {i["file"]: {"bytes": i["bytes"], "sha256": i["sha256"]} for i in infos},
            "aliases": _aliases(engine.module),
            "hf_models": describe_hf_models(engine.module),  # what `consolidate --hf` needs: prefix, config
        }
        (partial / INDEX).write_text(json.dumps(index, indent=1, default=str))
        torch.save(trainer_state or {}, partial / TRAINER_STATE)
        old = path.with_name(path.name + ".old")
        _remove(old)
        if path.exists() or path.is_symlink():
            path.rename(old)
        partial.rename(path)  # the commit point: before it, `path` is the previous checkpoint, whole
        _remove(old)
    dist.barrier(group=group)


def _wait_for_writers(group) -> None:
    """The collectives of :func:`save_sharded` on a rank that writes nothing (another replica group writes)."""
    dist.barrier(group=group)
    dist.all_gather_object([None] * dist.get_world_size(group), None, group=group)
    dist.barrier(group=group)


def _remove(path: Path) -> None:
    """Removes a directory tree, a file or a symbolic link (``save_last="link"`` makes ``last.ckpt`` a link to a
    checkpoint directory: the link goes, its target stays). Errors are ignored: this only tidies up."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` for the buffers ``module.state_dict()`` holds: non-persistent ones (e.g. rotary ``inv_freq``,
    recomputed at init) are neither saved nor loaded, so a checkpoint loads strictly into a fresh model."""
    keys = set(module.state_dict(keep_vars=True))
    return [(name, b) for name, b in module.named_buffers() if name in keys]


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    """State-dict keys that name a tensor already listed under an earlier key (tied weights): alias -> first key."""
    first: dict[int, str] = {}
    aliases = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in first:
            aliases[key] = first[id(value)]
        else:
            first[id(value)] = key
    return aliases


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path, INDEX).is_file()


class _SavedShards:
    """Element ranges of the saved flat shards, read lazily per rank file."""

    def __init__(self, path: Path, index: dict) -> None:
        self.path = path
        self.index = index
        self.where: dict[str, tuple[int, int]] = {}  # parameter name -> (saved flat index, element offset)
        for i, entry in enumerate(index["flat_params"]):
            for name, off in zip(entry["names"], entry["offsets"]):
                self.where[name] = (i, off)
        self._files: dict[int, Any] = {}

    def _file(self, rank: int):
        if rank not in self._files:
            self._files[rank] = safe_open(str(self.path / _rank_file(rank)), framework="pt")
        return self._files[rank]

    def read(self, kind: str, name: str, start: int, end: int, out: torch.Tensor) -> bool:
        """Copies elements [start, end) of parameter ``name``'s ``kind`` (param, master, optim.KEY) into ``out``."""
        if name not in self.where:
            return False
        i, off = self.where[name]
        shard = self.index["flat_params"][i]["shard_numel"]
        pos, end = off + start, off + end
        done = 0
        while pos < end:
            rank, local = divmod(pos, shard)
            n = min(end - pos, shard - local)
            f = self._file(rank)
            key = f"flat.{i}.{kind}"
            if key not in f.keys():
                if kind == "master":  # the master aliased the fp32 parameter shard when it was saved
                    key = f"flat.{i}.param"
                else:
                    return False
            out[done : done + n].copy_(f.get_slice(key)[local : local + n])
            pos, done = pos + n, done + n
        return True

    def read_whole(self, key: str) -> torch.Tensor:
        return self._file(0).get_tensor(key)


def verify(path: str | os.PathLike) -> dict:
    """Checks that every file the index lists exists with its size and checksum; returns the index.

    Raises:
        FileNotFoundError / ValueError: naming the missing, truncated or corrupt file.
    """
    path = Path(path)
    index = json.loads((path / INDEX).read_text())
    for name, meta in index["files"].items():
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(f"sharded checkpoint {path}: {name} is missing (the index lists it)")
        size = file.stat().st_size
        if size != meta["bytes"]:
            raise ValueError(f"sharded checkpoint {path}: {name} has {size} bytes, the index says {meta['bytes']}")
        if _sha256(file) != meta["sha256"]:
            raise ValueError(f"sharded checkpoint {path}: {name} is corrupt (SHA-256 differs from the index)")
    return index


@torch.no_grad()
def load_sharded(engine, path: str | os.PathLike) -> dict[str, Any]:
    """Loads a sharded checkpoint saved at any world size and stage into ``engine``; returns the trainer state.

    Each rank verifies the files, then reads only the element ranges its own shards need.
    """
    path = Path(path)
    index = verify(path)
    saved = _SavedShards(path, index)
    # the fp32 master where one was saved (else the parameter), into the master or, when it aliases it, the shard
    engine.load_shards_from(lambda name, a, b, out: saved.read("master", name, a, b, out))

    saved_groups = index["optimizer"]["param_groups"]
    saved_owner = index["optimizer"].get("group_optimizer", [0] * len(saved_groups))
    if saved_owner != engine.optim.group_optimizer:
        raise ValueError(
            f"sharded checkpoint {path}: its optimizers own param groups {saved_owner} (optimizer index per group), "
            f"this run's own {engine.optim.group_optimizer}: build the same optimizers and param groups as the run "
            "that saved it"
        )
    for group, saved_group in zip(engine.optim.param_groups, saved_groups):
        for k, v in saved_group.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v  # JSON turned tuples (betas) into lists
    for optimizer in engine.optimizers:
        optimizer.state.clear()
    scalar_state = index["optimizer"]["scalar_state"]
    for fp in engine.flat_params:
        first = fp.names[0]
        i, _ = saved.where.get(first, (None, 0))
        if i is None:
            continue
        keys = [k.split(".optim.", 1)[1] for k in saved._file(0).keys() if k.startswith(f"flat.{i}.optim.")]
        state: dict[str, Any] = {}
        for key in keys:
            t = torch.zeros(fp.layout.shard_numel, dtype=torch.float32, device=fp.master.device)
            for pi, p_off, s_off, n in fp.layout.shard_slices(fp.rank):
                saved.read(f"optim.{key}", fp.names[pi], p_off, p_off + n, t[s_off : s_off + n])
            state[key] = t
        for key, value in scalar_state.get(str(i), {}).items():
            state[key] = torch.tensor(value, dtype=torch.float32) if key == "step" else value
        if state:
            engine.optim.optimizer_of(fp).state[fp.master] = state
    for name, b in persistent_buffers(engine.module):
        b.copy_(saved.read_whole(f"buffer.{name}"))
    for name, p in engine.unsharded_parameters():
        p.data.copy_(saved.read_whole(f"param.{name}"))
    same_layout = index["world_size"] == engine.world_size and index.get("replicate_size", 1) == engine.replicate_size
    if same_layout and engine.replicate_rank == 0:  # same ranks: each continues its own random stream
        own = safe_open(str(path / _rank_file(engine.rank)), framework="pt")
        torch.set_rng_state(own.get_tensor("rng.torch"))
        if "rng.cuda" in own.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(own.get_tensor("rng.cuda"))
    return read_trainer_state(path)


def read_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's non-model state saved with the checkpoint (loops, schedulers, ``hyper_parameters``, the
    ``pytorch-lightning_version`` key, ...); ``{}`` for a checkpoint saved without one."""
    return torch.load(Path(path) / TRAINER_STATE, weights_only=False)

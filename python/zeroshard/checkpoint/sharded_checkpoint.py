"""Sharded checkpoints: each rank writes its own flat shards; any world size and stage loads them.

Layout of a checkpoint directory (the commit protocol: :mod:`zeroshard.checkpoint.checkpoint_dir`)::

    LATEST                     {"version": "v00007", "manifest_sha256": ...}: the committed version, replaced
                               atomically (tmp + fsync + os.replace + directory fsync) as a save's last step
    v00006/                    the previous version, kept until the next save commits
    v00007/
      index.json               layouts of every flat parameter (names, shapes, offsets, shard size), optimizer param
                               groups and scalar state, the size and SHA-256 of every rank file, and the Hugging Face
                               models inside the module (prefix, class, config; for ``consolidate --hf``)
      rank00000.safetensors .. one per saving rank (with hybrid sharding only replica group 0 writes; the index
                               says so): its parameter shard, fp32 master shard and per-element optimizer
                               state shards for every flat parameter (``flat.{i}.param``, ``flat.{i}.master``,
                               ``flat.{i}.optim.{key}``) and its torch (and CUDA) RNG state (``rng.*``); rank 0 adds
                               persistent buffers and unsharded parameters
      trainer.json, trainer.safetensors (, trainer.pickle)
                               Lightning's non-model state (loops, schedulers, callbacks, precision, RNG), without
                               pickle (:mod:`zeroshard.checkpoint.trainer_state`; ``trainer.pickle`` holds only objects
                               JSON cannot, and loads only with ``weights_only=False``)
      manifest.json            size and SHA-256 of every file above; its own hash is in ``LATEST``

No rank gathers anything to save. Every file is fsynced before the commit, so a crash at any point of a save leaves
``LATEST`` naming a complete version: the old one before the commit, the new one after. Loading verifies every file
and the layout against the safetensors headers and the model before changing any state
(:mod:`zeroshard.checkpoint.checkpoint_verify`) and logs which version it loaded. A directory without a manifest (the
older single-version layout, ``index.json`` directly in the directory and ``trainer.pt``, or a version whose manifest
was lost) is refused until adopted by hand: ``python -m zeroshard.checkpoint.adopt DIR``. Every file of a save is
created inside the version directory the save has just made (``mkdir`` fails on any existing entry, a planted link
included), and the pointer exclusively, so no planted name redirects a write. On load each rank works out, from the
saved layouts and its own new ones (``FlatParamLayout.shard_slices``), which element ranges of which saved shards it
needs and reads only those (safetensors slices are memory-mapped), so N ranks can save and M ranks load (DeepSpeed
needs an offline conversion for that; FSDP2 does it through DCP).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from safetensors import safe_open
from safetensors.torch import save_file

from zeroshard.checkpoint import checkpoint_dir
from zeroshard.checkpoint import trainer_state as trainer_state_module
from zeroshard.checkpoint.checkpoint_dir import POINTER, Resolved, fsync_dir, fsync_file, kill_point
from zeroshard.checkpoint.checkpoint_verify import (
    INDEX,
    MANIFEST,
    CheckpointError,
    check_model,
    file_entry,
    open_safetensors,
    verify_files,
    write_manifest,
)
from zeroshard.checkpoint.checkpoint_verify import rank_file as _rank_file
from zeroshard.checkpoint.hf_export import describe_hf_models
from zeroshard.checkpoint.safe_paths import create_exclusive

__all__ = ["CheckpointError", "is_sharded_checkpoint", "load_sharded", "read_trainer_state", "save_sharded", "verify"]
FORMAT_VERSION = 2
# optimizer state keys of the fused Adam's moments and their int8 block scales (zeroshard.optim.state_format; this
# layer imports no other)
_MOMENTS = ("exp_avg", "exp_avg_sq")
ABSMAX_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")
_ST_DTYPES = {"U8": torch.uint8, "BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
# the single-version layout's files (its manifest.json, if adopted: zeroshard.checkpoint.adopt), deleted once replaced
_LEGACY_FILES = [INDEX, trainer_state_module.LEGACY, "rank*.safetensors", MANIFEST]


def _rank_tensors(engine) -> tuple[dict[str, torch.Tensor], list[dict], dict]:
    """This rank's shards (and, on rank 0, buffers and unsharded parameters), the flat layouts and scalar state."""
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
                per_element = torch.is_tensor(value) and value.dim() == 1 and value.numel() == fp.layout.shard_numel
                if per_element or (key in ABSMAX_KEYS and torch.is_tensor(value)):  # as kept: no fp32 blow-up
                    tensors[f"flat.{i}.optim.{key}"] = value.detach().cpu()
                else:
                    scalar_state.setdefault(str(i), {})[key] = value.item() if torch.is_tensor(value) else value
            entry["group"] = engine.optim.group_index_of(fp)  # numbered across optimizers (OptimizerSet)
        layouts.append(entry)
    for key, dynamic_map in engine.optim.quant_maps().items():  # int8 moments are codes of these (readable alone)
        tensors[f"quant.map.{key}"] = dynamic_map
    # this rank's random-number generators, restored when the same rank count loads the checkpoint
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    if engine.rank == 0:
        for name, b in persistent_buffers(engine.module):
            tensors[f"buffer.{name}"] = b.detach().cpu()
        for name, p in engine.unsharded_parameters():
            tensors[f"param.{name}"] = p.detach().cpu()
    return {k: v.contiguous() for k, v in tensors.items()}, layouts, scalar_state


def _agree(value: Any, group) -> list[Any]:
    """``value`` of every rank of ``group`` (an all-gather); raises on every rank if any rank sent an error."""
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    errors = [v["error"] for v in values if isinstance(v, dict) and "error" in v]
    if errors:
        raise OSError("; ".join(errors))
    return values


def _error(path: Path, rank: int, step: str, e: BaseException) -> dict[str, str]:
    after = {
        "cleaning up": "the new checkpoint is committed",
        "committing": "the checkpoint is the previous or the new version, whole (a load logs which)",
    }.get(step)
    if after is None:  # before the commit: say what a load finds now (there may have been no previous checkpoint)
        previous = checkpoint_dir.committed_version(path)
        after = (
            f"the previous checkpoint ({previous}) is untouched"
            if previous
            else "no checkpoint was committed there before this save, and none is now"
        )
    return {"error": f"sharded checkpoint {path}: rank {rank} failed {step} ({type(e).__name__}: {e}); {after}"}


def save_sharded(engine, path: str | os.PathLike, trainer_state: dict[str, Any] | None = None) -> None:
    """Writes a new version of the sharded checkpoint at ``path`` and commits it; collective (every rank calls it
    with the same ``path``).

    ``trainer_state`` (rank 0's) is stored without pickle where it can be (:mod:`zeroshard.checkpoint.trainer_state`).

    Raises:
        OSError: on every rank, naming the rank and the step, when any rank fails; before the commit the previous
            checkpoint at ``path`` is untouched.
    """
    path = Path(path)
    group = engine.groups.world  # every data-parallel rank takes part
    me = dist.get_rank()
    writes = engine.replicate_rank == 0  # hybrid sharding: replica group 0 holds the same shards and writes them
    coordinator = writes and engine.rank == 0
    kill_point("before_write", me)
    plan: Any = None
    if coordinator:
        try:
            plan = checkpoint_dir.begin(path)
        except Exception as e:
            plan = _error(path, me, "creating the version directory", e)
    [pending] = [p for p in _agree(plan, group) if p is not None]

    info: Any = None
    if writes:
        try:
            tensors, layouts, scalar_state = _rank_tensors(engine)
            file = pending.dir / _rank_file(engine.rank)
            save_file(tensors, str(file))
            kill_point("rank_file_written", me)
            fsync_file(file)
            info = {"file": file.name, **file_entry(file)}
        except Exception as e:
            info = _error(path, me, "writing its rank file", e)
    try:
        infos = [i for i in _agree(info, group) if i is not None]
    except OSError:
        if coordinator:
            _discard(pending)
        raise

    status: Any = None
    if coordinator:
        step = "writing the index"
        try:
            kill_point("after_rank_files", me)
            groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optim.param_groups]
            index = {
                "format_version": FORMAT_VERSION,
                "world_size": engine.world_size,
                "replicate_size": engine.replicate_size,  # shard groups in the saving run; the files are group 0's
                "written_by_replica": 0,
                "stage": engine.config.stage,
                "flat_params": layouts,
                "optimizer": {
                    "param_groups": groups,
                    "scalar_state": scalar_state,
                    "group_optimizer": engine.optim.group_optimizer,  # which optimizer owns each group
                    "classes": engine.optim.kinds(),  # checked on load (zeroshard.optim.restore_checks)
                    "quant_block": engine.optim.QUANT_BLOCK,  # elements per absmax of int8 moments
                },
                "files": {i["file"]: {"bytes": i["bytes"], "sha256": i["sha256"]} for i in infos},
                "aliases": _aliases(engine.module),
                "hf_models": describe_hf_models(engine.module),  # what `consolidate --hf` needs: prefix, config
            }
            create_exclusive(pending.dir / INDEX, json.dumps(index, indent=1, default=str).encode())
            written = [INDEX, *trainer_state_module.save(pending.dir, trainer_state or {})]
            for name in written:
                fsync_file(pending.dir / name)
            entries = {name: file_entry(pending.dir / name) for name in written}
            entries.update(index["files"])
            manifest_sha = write_manifest(pending.dir, entries)
            fsync_file(pending.dir / MANIFEST)
            fsync_dir(pending.dir)
            kill_point("before_pointer", me)
            step = "committing"
            checkpoint_dir.commit(pending, manifest_sha, me)  # the commit point
            kill_point("after_pointer", me)
            step = "cleaning up"
            checkpoint_dir.cleanup(pending, _LEGACY_FILES)
            kill_point("after_cleanup", me)
        except Exception as e:
            if step == "writing the index":  # a failed commit may have moved the pointer: leave it to the next save
                _discard(pending)
            status = _error(path, me, step, e)
    _agree(status, group)


def _discard(pending) -> None:
    """Removes an uncommitted version directory (best effort; the next save would remove it anyway)."""
    shutil.rmtree(pending.dir, ignore_errors=True)


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
    """Whether ``path`` is for the sharded loader: any directory (one that is no checkpoint gets :func:`verify`'s
    error saying what it lacks, not ``IsADirectoryError`` from ``torch.load``), or a missing path whose
    ``<path>.partial`` holds a committed checkpoint (:mod:`zeroshard.checkpoint.checkpoint_dir`)."""
    p = Path(path)
    if p.is_dir():
        return True
    return not p.exists() and not p.is_symlink() and (p.with_name(p.name + ".partial") / POINTER).is_file()


class _SavedShards:
    """Element ranges of the saved flat shards, read lazily per rank file. ``path`` is the version directory."""

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
            self._files[rank] = open_safetensors(self.path, _rank_file(rank))  # errors name the file
        return self._files[rank]

    def read(self, kind: str, name: str, start: int, end: int, out: torch.Tensor) -> bool:
        """Copies elements [start, end) of parameter ``name``'s ``kind`` (param, master, optim.KEY) into ``out``."""
        if name not in self.where:
            if kind in ("param", "master") and f"param.{name}" in self._file(0).keys():  # saved whole (frozen, 1-2)
                out.copy_(self._file(0).get_tensor(f"param.{name}").reshape(-1)[start:end])
                return True
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

    def read_values(self, kind: str, name: str, start: int, end: int, out: torch.Tensor) -> bool:
        """As :meth:`read` into an fp32 ``out``, with int8 moments (uint8 codes of ``optim.KEY`` and their
        ``optim.KEY_absmax``, blocks of ``quant_block`` elements of each saved shard) turned into their exact fp32
        values, ``map[code] * absmax`` with the dynamic map saved beside them (``quant.map.KEY``), as the kernel
        reads them.

        Raises:
            CheckpointError: uint8 moments without their absmax or map.
        """
        if name not in self.where:
            return False
        i, off = self.where[name]
        key = f"flat.{i}.{kind}"
        if key not in self._file(0).keys():
            return False
        if self._file(0).get_slice(key).get_dtype() != "U8":
            return self.read(kind, name, start, end, out)
        moment = kind.removeprefix("optim.")
        block = int(self.index["optimizer"].get("quant_block", 0))
        if f"quant.map.{moment}" not in self._file(0).keys() or block < 1:
            raise CheckpointError(f"sharded checkpoint {self.path}: {key} holds int8 codes but no quant.map.{moment}")
        table = self._file(0).get_tensor(f"quant.map.{moment}")
        shard = self.index["flat_params"][i]["shard_numel"]
        pos, end, done = off + start, off + end, 0
        while pos < end:
            rank, local = divmod(pos, shard)
            n = min(end - pos, shard - local)
            f = self._file(rank)
            if f"{key}_absmax" not in f.keys():
                raise CheckpointError(f"sharded checkpoint {self.path}: {key} holds int8 codes but no {key}_absmax")
            codes = f.get_slice(key)[local : local + n]
            b0 = local // block
            absmax = f.get_slice(f"{key}_absmax")[b0 : (local + n - 1) // block + 1]
            scale = absmax.repeat_interleave(block)[local - b0 * block : local - b0 * block + n]
            out[done : done + n].copy_(table[codes.long()] * scale)
            pos, done = pos + n, done + n
        return True

    def read_whole(self, key: str) -> torch.Tensor:
        return self._file(0).get_tensor(key)

    def read_parameter(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A whole parameter: saved whole (``param.NAME``) or assembled from flat shards (saved at stage 3)."""
        if f"param.{name}" in self._file(0).keys():
            return self.read_whole(f"param.{name}")
        out = torch.empty(like.numel(), dtype=torch.float32)
        self.read("master", name, 0, like.numel(), out)
        return out.view(like.shape)


def open_checkpoint(path: str | os.PathLike) -> tuple[Resolved, dict]:
    """Resolves the committed version at ``path`` and verifies its files and layout; returns it and its index.

    Raises:
        FileNotFoundError / CheckpointError (a ``ValueError``): naming what is missing, corrupt or inconsistent.
    """
    where = checkpoint_dir.resolve(path, INDEX)
    return where, verify_files(where)


def verify(path: str | os.PathLike) -> dict:
    """Checks every file of the checkpoint at ``path`` (sizes, SHA-256, the index against the safetensors headers);
    returns the index.

    Raises:
        FileNotFoundError / CheckpointError (a ``ValueError``): naming the missing, truncated or corrupt file.
    """
    return open_checkpoint(path)[1]


@torch.no_grad()
def load_sharded(engine, path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """Loads a sharded checkpoint saved at any world size and stage into ``engine``; returns the trainer state.

    Every rank verifies every file, the layout and the fit to the model, and reads the trainer state, before any
    state changes; then it reads only the element ranges its own shards need. ``weights_only=False`` allows the
    trainer state's pickled objects (:mod:`zeroshard.checkpoint.trainer_state`), as in Lightning.

    Raises:
        FileNotFoundError / CheckpointError: a missing, corrupt or inconsistent checkpoint, or one that does not fit
            the model (naming the file or parameter). UnsafeCheckpointError: pickled trainer state without
            ``weights_only=False``. ValueError (``OptimizerRestoreError``): optimizer state that does not fit this
            run's optimizers (class, param group keys, types and ranges, parameters per group:
            :mod:`zeroshard.optim.restore_checks`); with ``optimizer_state="reset"`` it is dropped instead.
    """
    where, index = open_checkpoint(path)
    check_model(where.dir, index, engine, persistent_buffers(engine.module))
    # the optimizer state is checked before any state changes (zeroshard.optim.restore_checks), unless the run
    # asked to start its optimizer fresh (optimizer_state="reset": then it is dropped, and the drop is logged)
    with safe_open(str(where.dir / _rank_file(0)), framework="pt") as f:
        saved_tensors = list(f.keys())
    restore_optimizer = engine.config.optimizer_state != "reset"
    if restore_optimizer:
        group_values = engine.optim.check_restore(
            f"sharded checkpoint {where.dir / INDEX}", index.get("optimizer"), index["flat_params"],
            engine.all_flat_params, saved_tensors
        )  # fmt: skip
    state = trainer_state_module.load(where.dir, weights_only)

    saved = _SavedShards(where.dir, index)
    # the fp32 master where one was saved (else the parameter), into the master or, when it aliases it, the shard
    engine.load_shards_from(lambda name, a, b, out: saved.read("master", name, a, b, out))
    if not restore_optimizer:
        engine.optim.drop_restore(f"sharded checkpoint {where.dir / INDEX}", index.get("optimizer"), saved_tensors)
    else:
        for group, values in zip(engine.optim.param_groups, group_values):
            group.update(values)  # checked, in the live types (JSON turned tuples such as betas into lists)
        for optimizer in engine.optimizers:
            optimizer.state.clear()
    scalar_state = index["optimizer"].get("scalar_state", {}) if restore_optimizer else {}
    for fp in engine.flat_params if restore_optimizer else []:
        i, _ = saved.where.get(fp.names[0], (None, 0))
        if i is None:
            continue
        opt_state = _shard_state(engine, saved, fp, i)
        for key, value in scalar_state.get(str(i), {}).items():
            opt_state[key] = torch.tensor(value, dtype=torch.float32) if key == "step" else value
        if opt_state:
            engine.optim.optimizer_of(fp).state[fp.master] = opt_state
    for name, b in persistent_buffers(engine.module):
        b.copy_(saved.read_whole(f"buffer.{name}"))
    for name, p in engine.unsharded_parameters():
        p.data.copy_(saved.read_parameter(name, p))
    same_layout = index["world_size"] == engine.world_size and index.get("replicate_size", 1) == engine.replicate_size
    if same_layout and engine.replicate_rank == 0:  # same ranks: each continues its own random stream
        own = saved._file(engine.rank)
        torch.set_rng_state(own.get_tensor("rng.torch"))
        if "rng.cuda" in own.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(own.get_tensor("rng.cuda"))
    rank_zero_info(
        f"zeroshard: loaded sharded checkpoint {where.root}, version {where.version} ({len(index['files'])} rank "
        f"files, saved by {index['world_size']} ranks at stage {index.get('stage')}; every file verified)"
    )
    return state


def _shard_state(engine, saved: _SavedShards, fp, i: int) -> dict[str, torch.Tensor]:
    """The per-element optimizer state of flat parameter ``fp`` (saved as flat parameter ``i``) for this rank's shard.

    Moments (``exp_avg``, ``exp_avg_sq``) saved in the format ``fp``'s optimizer keeps, by ranks that held the very
    same shard (same world size, names, offsets and shard size), are copied as they are: bit for bit, int8 codes and
    absmax included. Otherwise they are read as exact fp32 values (:meth:`_SavedShards.read_values`) and converted by
    the optimizer (``engine.optim.convert_shard_moments``): int8 blocks of a reshard (N -> M ranks, another stage or
    bucket size) are requantised, deterministically, over the new shard's blocks. Other per-element state (momentum
    ...) is read into fp32, as before."""
    shard = fp.layout.shard_numel
    device = fp.master.device
    f0 = saved._file(0)
    prefix = f"flat.{i}.optim."
    keys = [k.removeprefix(prefix) for k in f0.keys() if k.startswith(prefix)]
    saved_dtype = {k: f0.get_slice(prefix + k).get_dtype() for k in keys}
    entry = saved.index["flat_params"][i]
    same_shard = (
        saved.index["world_size"] == engine.world_size
        and entry["names"] == list(fp.names)
        and entry["offsets"] == list(fp.layout.offsets)
        and entry["shard_numel"] == shard
    )
    live = engine.optim.state_format_of(fp)
    moments = [k for k in _MOMENTS if k in keys]
    saved_fmt = {"U8": "int8", "BF16": torch.bfloat16, "F32": torch.float32}.get(saved_dtype.get("exp_avg"))
    as_is = same_shard and len(moments) == 2 and saved_fmt == live
    state: dict[str, torch.Tensor] = {}
    for key in keys:
        if key in ABSMAX_KEYS or (key in moments and not as_is):
            continue
        dtype = _ST_DTYPES[saved_dtype[key]] if key in moments else torch.float32
        t = torch.zeros(shard, dtype=dtype, device=device)
        for pi, p_off, s_off, n in fp.layout.shard_slices(fp.rank):
            saved.read(f"optim.{key}", fp.names[pi], p_off, p_off + n, t[s_off : s_off + n])
        state[key] = t
    if as_is and live == "int8":
        own = saved._file(fp.rank)
        for key in ABSMAX_KEYS:
            state[key] = own.get_tensor(prefix + key).to(device)
    elif moments and not as_is:
        values = {}
        for key in moments:
            t = torch.zeros(shard, dtype=torch.float32)
            for pi, p_off, s_off, n in fp.layout.shard_slices(fp.rank):
                saved.read_values(f"optim.{key}", fp.names[pi], p_off, p_off + n, t[s_off : s_off + n])
            values[key] = t
        state.update(engine.optim.convert_shard_moments(fp, values) if len(values) == 2 else values)
    return state


def read_trainer_state(path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's non-model state saved with the checkpoint (loops, schedulers, ``hyper_parameters``, the
    ``pytorch-lightning_version`` key, ...), after verifying the checkpoint; ``{}`` for one saved without it.

    Raises:
        UnsafeCheckpointError: pickled objects and ``weights_only`` is not False; as :func:`verify` otherwise.
    """
    where, _ = open_checkpoint(path)
    return trainer_state_module.load(where.dir, weights_only)

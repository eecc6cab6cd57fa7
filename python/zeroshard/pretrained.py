"""Pretrained weights from safetensors checkpoints, each rank reading only the slices its shards hold.

Source: the seed ``001_c1417cadf1450ecb.txt`` ("loading only rank-relevant weights": with a model built on the meta
device, each process loads only its own part of the checkpoint, so K ranks never hold K copies of the model) and
DeepSpeed's meta-tensor checkpoint loading (``deepspeed.OnDevice(device="meta")`` + a checkpoint JSON listing the
files), which does the same for tensor-parallel slices. Here the slices are ZeRO flat shards: a rank's shard of a
flat parameter covers a contiguous range of each parameter's flattened elements, so it reads, through safetensors'
memory-mapped slicing, only the rows of each tensor that overlap that range.

Flow::

    with zeroshard.meta_init.init_meta_context():
        model = MyModel(cfg)                                        # nothing allocated
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, wrap_policy=Block))   # shards, random init
    report = zeroshard.load_pretrained(model, "ckpt_dir/")          # every rank; each reads ~1/N of the checkpoint

or, before the engine exists, ``load_pretrained(meta_model, path)`` records the checkpoint on the model and the engine
applies it right after sharding (:func:`apply_recorded_pretrained`).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from zeroshard.meta_init import replacement
from zeroshard.sharding.managed import engine_of
from zeroshard.sharding.sharded_param import real_parameter

__all__ = ["LoadReport", "SafetensorsSource", "apply_recorded_pretrained", "load_pretrained"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_RECORD_ATTR = "_zeroshard_pretrained"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


class SafetensorsSource:
    """A safetensors checkpoint read by flat element ranges: a single file, or a sharded one with an index JSON.

    Args:
        path: a ``.safetensors`` file; an index JSON (Hugging Face's ``model.safetensors.index.json`` layout:
            ``{"weight_map": {tensor name: file name relative to the index}}``); or a directory holding
            ``model.safetensors.index.json``, ``model.safetensors``, or exactly one index / one ``.safetensors`` file.
        strip_prefix: removed from checkpoint names that start with it (e.g. ``"bert."``).
        add_prefix: then put in front of every name (e.g. ``"model."`` for a model held as ``self.model``).
        key_map: then applied to each name: ``key_map(name) -> module name``, or None to ignore the tensor.

    Names seen by :meth:`keys`, :meth:`shape`, :meth:`dtype` and :meth:`read` are the mapped ones (module names).
    Files are opened with ``safe_open(..., framework="pt")`` (memory-mapped), lazily, and stay open.

    Attributes:
        bytes_read: bytes of the tensor rows :meth:`read` has read so far (what this process touched).
        bytes_total: bytes of all tensors in the checkpoint (ignored ones included).

    Raises:
        FileNotFoundError: the path, the index's files, or a directory's checkpoint does not exist.
        ValueError: an index without ``weight_map``, a directory with several candidates, or two checkpoint names
            mapped onto one module name.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        strip_prefix: str = "",
        add_prefix: str = "",
        key_map: Callable[[str], str | None] | None = None,
    ) -> None:
        self.path = Path(path)
        files = _checkpoint_files(self.path)  # checkpoint name -> file
        self._handles: dict[Path, object] = {}
        self._where: dict[str, tuple[Path, str]] = {}  # module name -> (file, checkpoint name)
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, torch.dtype] = {}
        self.ignored: list[str] = []
        self.bytes_total = 0
        self.bytes_read = 0
        by_file: dict[Path, list[str]] = {}
        for key, file in files.items():
            by_file.setdefault(file, []).append(key)
        for file, keys in by_file.items():
            handle = self._open(file)
            present = set(handle.keys())
            for key in keys:
                if key not in present:
                    raise ValueError(f"{file}: the index maps '{key}' to this file, which does not hold it")
                sl = handle.get_slice(key)
                shape, dtype = tuple(sl.get_shape()), _torch_dtype(sl.get_dtype(), key, file)
                self.bytes_total += math.prod(shape) * dtype.itemsize
                name = key[len(strip_prefix) :] if strip_prefix and key.startswith(strip_prefix) else key
                name = add_prefix + name
                if key_map is not None:
                    name = key_map(name)
                if name is None:
                    self.ignored.append(key)
                    continue
                if name in self._where:
                    raise ValueError(
                        f"checkpoint tensors '{self._where[name][1]}' and '{key}' both map onto '{name}'; "
                        "fix strip_prefix / add_prefix / key_map"
                    )
                self._where[name] = (file, key)
                self._shape[name] = shape
                self._dtype[name] = dtype

    def _open(self, file: Path):
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def keys(self) -> list[str]:
        """Module names of the tensors (after the prefix options and ``key_map``), in checkpoint order."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def dtype(self, name: str) -> torch.dtype:
        return self._dtype[name]

    def checkpoint_name(self, name: str) -> str:
        """The name ``name`` has in the checkpoint file."""
        return self._where[name][1]

    def read(self, name: str, start: int, end: int, out: torch.Tensor) -> bool:
        """Copies elements ``[start, end)`` of tensor ``name``, flattened (row-major), into ``out``.

        Only the rows that overlap the range are read: for shape ``(d0, *rest)`` with ``row = prod(rest)`` elements,
        rows ``start // row`` to ``ceil(end / row)`` through ``get_slice(name)[a:b]`` (1-D tensors: exactly the range),
        which touches those bytes of the memory map only. :attr:`bytes_read` grows by the bytes of those rows.

        Args:
            name: module name (see :meth:`keys`).
            start, end: element range, ``0 <= start <= end <= numel``.
            out: a 1-D tensor of ``end - start`` elements, any dtype (values are cast) and device.

        Returns:
            False (and nothing copied) if the checkpoint has no tensor ``name``; True otherwise.

        Raises:
            ValueError: a range outside the tensor or an ``out`` of the wrong size.
        """
        where = self._where.get(name)
        if where is None:
            return False
        file, key = where
        shape = self._shape[name]
        numel = math.prod(shape)
        if not 0 <= start <= end <= numel or out.dim() != 1 or out.numel() != end - start:
            raise ValueError(
                f"read('{name}', {start}, {end}): the tensor has {numel} elements (shape {list(shape)}) and out has "
                f"shape {list(out.shape)}; need 0 <= start <= end <= numel and out of end - start elements"
            )
        if start == end:
            return True
        handle = self._open(file)
        if len(shape) == 0:
            piece = handle.get_tensor(key).reshape(1)
            first = 0
        else:
            row = math.prod(shape[1:])
            if row == 0:  # a (d0, 0, ...) tensor has no elements; unreachable since start < end <= numel
                return True
            a, b = start // row, -(-end // row)
            piece = handle.get_slice(key)[a:b].reshape(-1)
            first = a * row
        self.bytes_read += piece.numel() * piece.element_size()
        with torch.no_grad():
            out.copy_(piece[start - first : end - first])
        return True

    def read_full(self, name: str, out: torch.Tensor) -> bool:
        """The whole tensor ``name`` into ``out`` (same number of elements, any shape, dtype, device)."""
        if name not in self._where:
            return False
        if out.is_contiguous():
            return self.read(name, 0, out.numel(), out.view(-1))
        tmp = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        self.read(name, 0, out.numel(), tmp)
        with torch.no_grad():
            out.copy_(tmp.view(out.shape))
        return True

    def __repr__(self) -> str:
        return f"SafetensorsSource('{self.path}', {len(self._where)} tensors, {self.bytes_total} bytes)"


def _torch_dtype(code: str, key: str, file: Path) -> torch.dtype:
    if code not in _DTYPES:
        raise ValueError(f"{file}: tensor '{key}' has dtype {code}, which this torch cannot hold")
    return _DTYPES[code]


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> file, for a file, an index JSON or a directory."""
    if path.is_dir():
        candidates = [path / INDEX_NAME, path / SINGLE_NAME]
        found = [c for c in candidates if c.is_file()]
        if not found:
            found = sorted(path.glob("*.safetensors.index.json")) or sorted(path.glob("*.safetensors"))
            if len(found) != 1:
                what = ", ".join(p.name for p in found) or "none"
                raise (ValueError if found else FileNotFoundError)(
                    f"{path}: expected {INDEX_NAME}, {SINGLE_NAME}, or exactly one index / .safetensors file "
                    f"(found: {what})"
                )
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    if path.name.endswith(".json"):
        index = json.loads(path.read_text())
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{path}: a safetensors index needs a 'weight_map' object (tensor name -> file name)")
        files = {k: path.parent / v for k, v in index["weight_map"].items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise FileNotFoundError(f"{path}: the index names {f.name}, which does not exist in {path.parent}")
        return files
    with safe_open(str(path), framework="pt") as handle:
        return {k: path for k in handle.keys()}


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did on this rank.

    Attributes:
        mode: ``"sharded"`` (engine-managed: shard ranges only), ``"plain"`` (whole tensors) or ``"recorded"``
            (meta model: nothing read yet; the engine loads when it shards the model).
        loaded: state-dict keys of the model filled from the checkpoint (all aliases of tied tensors).
        missing: model keys the checkpoint lacks (kept as they were).
        unexpected: checkpoint tensors (module names, after the name mapping) the model lacks (not read).
        mismatched: ``(key, checkpoint shape, model shape)`` of tensors skipped for a shape mismatch.
        casts: ``(key, checkpoint dtype, model dtype)`` of tensors loaded with a dtype cast.
        bytes_read: bytes this rank read from the checkpoint (rows touched; see :meth:`SafetensorsSource.read`).
        bytes_total: bytes of all tensors in the checkpoint.
    """

    mode: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    casts: list[tuple[str, torch.dtype, torch.dtype]] = field(default_factory=list)
    bytes_read: int = 0
    bytes_total: int = 0

    @property
    def skipped(self) -> list[str]:
        """Keys not loaded: missing, shape-mismatched, and unexpected ones."""
        return sorted(self.missing + [k for k, _, _ in self.mismatched] + self.unexpected)


@dataclass
class _Plan:
    """Model key -> checkpoint (module) name to read, plus the report's lists; computed before anything is written."""

    read_from: dict[str, str]
    report: LoadReport


def _plan(model: nn.Module, source: SafetensorsSource, strict: bool, refs: dict | None = None) -> _Plan:
    """Checks names and shapes of ``model.state_dict(keep_vars=True)`` (or ``refs``) against ``source``; writes nothing.

    A tensor registered under several names (tied weights) is satisfied by any one of them in the checkpoint.

    Raises:
        ValueError: (``strict``) listing missing keys, unexpected keys and shape mismatches.
    """
    refs = model.state_dict(keep_vars=True) if refs is None else refs
    aliases: dict[int, list[str]] = {}
    for k, v in refs.items():
        aliases.setdefault(id(v), []).append(k)
    report = LoadReport(mode="", bytes_total=source.bytes_total)
    read_from: dict[str, str] = {}
    for keys in aliases.values():
        present = [k for k in keys if k in source]
        if not present:
            report.missing.extend(keys)
            continue
        v = refs[keys[0]]
        ok = [k for k in present if tuple(source.shape(k)) == tuple(v.shape)]
        if not ok:
            report.mismatched.extend((k, tuple(source.shape(k)), tuple(v.shape)) for k in present)
            continue
        src = ok[0]
        for k in keys:
            read_from[k] = src
        report.loaded.extend(keys)
        if source.dtype(src) != v.dtype:
            report.casts.append((src, source.dtype(src), v.dtype))
    report.unexpected = [k for k in source.keys() if k not in refs]
    report.missing.sort()
    report.loaded.sort()
    problems = []
    if report.missing:
        problems.append(f"{len(report.missing)} missing keys (in the model, not in the checkpoint): {report.missing}")
    if report.unexpected:
        problems.append(
            f"{len(report.unexpected)} unexpected keys (in the checkpoint, not in the model): {report.unexpected}"
        )
    if report.mismatched:
        listed = [f"{k}: checkpoint {list(a)} vs model {list(b)}" for k, a, b in report.mismatched]
        problems.append(f"{len(listed)} shape mismatches: {listed}")
    if problems:
        message = f"checkpoint {source.path} does not match the model: " + "; ".join(problems)
        if strict:
            raise ValueError(message + ". Fix the names with strip_prefix / add_prefix / key_map, or pass strict=False")
        warnings.warn(message + "; these are skipped (strict=False)", stacklevel=3)
    return _Plan(read_from, report)


@torch.no_grad()
def _load_plain(model: nn.Module, source: SafetensorsSource, plan: _Plan) -> None:
    refs = model.state_dict(keep_vars=True)
    done: set[int] = set()
    for k, src in plan.read_from.items():
        t = refs[k]
        if id(t) not in done:
            done.add(id(t))
            source.read_full(src, t.data)


@torch.no_grad()
def _load_managed(engine, module: nn.Module, prefix: str, source: SafetensorsSource, plan: _Plan) -> None:
    """Shard ranges of the engine's flat parameters, whole unsharded parameters and buffers of ``module`` (the
    engine's module or one of its submodules, at qualified name ``prefix``)."""

    def read(name: str, start: int, end: int, out: torch.Tensor) -> bool:
        if not name.startswith(prefix):
            return False
        src = plan.read_from.get(name[len(prefix) :])
        return src is not None and source.read(src, start, end, out)

    engine.load_shards_from(read)
    refs = module.state_dict(keep_vars=True)
    whole = [t for n, t in engine.unsharded_parameters() if n.startswith(prefix)]
    whole += [t for _, t in module.named_buffers()]
    ids = {id(t) for t in whole}
    done: set[int] = set()
    for k, src in plan.read_from.items():
        t = refs[k]
        if id(t) in ids and id(t) not in done:
            done.add(id(t))
            source.read_full(src, t.data)


def _source(path, key_map) -> SafetensorsSource:
    if isinstance(path, SafetensorsSource):
        if key_map is not None:
            raise ValueError("pass key_map to SafetensorsSource(...) when giving a SafetensorsSource")
        return path
    return SafetensorsSource(path, key_map=key_map)


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike | SafetensorsSource,
    *,
    strict: bool = True,
    key_map: Callable[[str], str | None] | None = None,
) -> LoadReport:
    """Loads a safetensors checkpoint into ``model``; under zeroshard each rank reads only its shards' slices.

    Three cases, by the state of ``model``:

    - **Managed by a** :class:`~zeroshard.ZeroEngine` (``zeroshard.engine_of(model)``, the module the engine was
      built on): a collective, every rank must call it. Each rank reads, for every flat parameter, only the rows of each
      tensor that overlap its own shard (``ZeroEngine.load_shards_from``), so it reads about ``1/N`` of the
      checkpoint plus up to one row per tensor at each shard boundary; master shards are refreshed, stages 1-2 then
      all-gather. Parameters outside flat parameters (``ZeroEngine.unsharded_parameters()``) and buffers are read
      whole by every rank.
    - **On the meta device** (built under :func:`zeroshard.meta_init.init_meta_context`, no engine yet): names and
      shapes are checked now, nothing is read; the checkpoint is recorded as ``model._zeroshard_pretrained = (source,
      key_map, strict, state-dict references)`` and :func:`apply_recorded_pretrained` loads it once the engine has
      sharded the model (into the same tensors, followed by identity if a wrapper such as ``peft`` renamed them).
    - **Materialised, no engine**: every tensor is read whole (plain load).

    Checks come first, before anything is written: every key of ``model.state_dict(keep_vars=True)`` (a tensor
    registered under several names is satisfied by any of them) against the checkpoint's names (after
    ``key_map``). A dtype difference is allowed: values are cast to the model's dtype (listed in ``casts``).
    Tensors keep their device; reads go through host memory maps.

    Args:
        model: an ``nn.Module`` (or LightningModule): engine-managed, on meta, or materialised.
        path: a ``.safetensors`` file, an index JSON, a directory holding either, or a :class:`SafetensorsSource`
            (for ``strip_prefix`` / ``add_prefix``).
        strict: raise on missing or unexpected keys and shape mismatches; with False, warn listing them and skip them.
        key_map: ``checkpoint name -> module name`` (None drops the tensor); only with a path.

    Returns:
        :class:`LoadReport` for this rank (``bytes_read`` is this rank's; nothing is logged or printed).

    Raises:
        ValueError: (``strict``) missing / unexpected keys or shape mismatches, all listed, nothing written; a
            ``key_map`` together with a :class:`SafetensorsSource`.
        FileNotFoundError: no checkpoint at ``path``.
    """
    source = _source(path, key_map)
    engine = engine_of(model)
    if engine is not None:
        if engine.module is not model:
            raise ValueError("load_pretrained: pass the module the ZeroEngine was built on")
        plan = _plan(model, source, strict)
        start = source.bytes_read
        _load_managed(engine, model, "", source, plan)
        plan.report.mode = "sharded"
        plan.report.bytes_read = source.bytes_read - start
        return plan.report
    plan = _plan(model, source, strict)
    if _is_meta(model):
        setattr(model, _RECORD_ATTR, (source, key_map, strict, model.state_dict(keep_vars=True)))
        plan.report.mode = "recorded"
        return plan.report
    start = source.bytes_read
    _load_plain(model, source, plan)
    plan.report.mode = "plain"
    plan.report.bytes_read = source.bytes_read - start
    return plan.report


def apply_recorded_pretrained(engine) -> list[LoadReport]:
    """Loads the checkpoints :func:`load_pretrained` recorded on a meta model, right after ``engine`` sharded it.

    Meant to be called by :class:`~zeroshard.ZeroEngine` at the end of its construction (every rank: a collective);
    it looks for ``_zeroshard_pretrained`` on ``engine.module`` and on each of its submodules (a checkpoint recorded on
    ``self.model`` inside a LightningModule covers the names under ``model.``), loads each as in the engine-managed
    case of :func:`load_pretrained` (names and shapes re-checked, shard slices only), and removes the record.

    Args:
        engine: a constructed :class:`~zeroshard.ZeroEngine`.

    Returns:
        One :class:`LoadReport` per recorded checkpoint, in ``named_modules()`` order (empty if none was recorded).

    Raises:
        ValueError: as :func:`load_pretrained` (``strict`` as recorded).
    """
    reports = []
    for name, module in engine.module.named_modules():
        record = module.__dict__.get(_RECORD_ATTR)
        if record is None:
            continue
        source, plan = _recorded_plan(module, record)
        start = source.bytes_read
        _load_managed(engine, module, f"{name}." if name else "", source, plan)
        plan.report.mode = "sharded"
        plan.report.bytes_read = source.bytes_read - start
        del module.__dict__[_RECORD_ATTR]
        reports.append(plan.report)
    return reports


def apply_recorded_whole(root: nn.Module) -> list[LoadReport]:
    """Loads the checkpoints :func:`load_pretrained` recorded on a meta model that was then materialised whole, with no
    engine (``trainer.validate/test/predict`` with no fit): every tensor is read whole, on every rank.

    Returns:
        One :class:`LoadReport` (``mode="plain"``) per recorded checkpoint, in ``named_modules()`` order.

    Raises:
        ValueError: as :func:`load_pretrained` (``strict`` as recorded).
    """
    reports = []
    for module in root.modules():
        record = module.__dict__.pop(_RECORD_ATTR, None)
        if record is not None:
            source, plan = _recorded_plan(module, record)
            start = source.bytes_read
            _load_plain(module, source, plan)
            plan.report.mode = "plain"
            plan.report.bytes_read = source.bytes_read - start
            reports.append(plan.report)
    return reports


def _recorded_plan(module: nn.Module, record: tuple) -> tuple[SafetensorsSource, _Plan]:
    """The plan of a recorded load, checked against the names ``module`` had when :func:`load_pretrained` was called,
    then keyed by the names its tensors have now: a wrapper applied after the call (``peft``'s LoRA moves
    ``c_attn.weight`` to ``c_attn.base_layer.weight``) still gets its weights, followed by tensor identity through
    materialisation; tensors it added (the adapters) keep their own init."""
    source, _key_map, strict, recorded = record
    live = {k: replacement(t) for k, t in recorded.items()}
    plan = _plan(module, source, strict, refs=live)
    now: dict[int, list[str]] = {}
    for k, v in module.state_dict(keep_vars=True).items():
        now.setdefault(id(real_parameter(v)), []).append(k)  # a stage-3 module holds placeholders while sharded
    plan.read_from = {current: src for k, src in plan.read_from.items() for current in now.get(id(live[k]), [])}
    return source, plan

"""Lightning's non-model checkpoint state (loops, schedulers, callbacks, precision, ``hyper_parameters``, RNG) stored
without pickle: its structure as JSON, its tensors in safetensors.

Files (in a checkpoint's version directory)::

    trainer.json          the structure: JSON values as themselves, everything else as a one-key tagged object
                          (``{"$dict": {...}}``, ``{"$dict_items": [[key, value], ...]}`` for non-string keys,
                          ``{"$list"}``, ``{"$tuple"}``, ``{"$tensor": "t3"}``, ``{"$float": "nan"}``, ``{"$ndarray"}``,
                          ``{"$pickle"}``, ...)
    trainer.safetensors   the tensors the structure names (``t0``, ``t1``, ...; CPU, loaded on CPU as Lightning does)
    trainer.pickle        only when something has no JSON form (a dataclass or ``argparse.Namespace`` in
                          ``hyper_parameters``, a user callback's custom object): those objects alone, ``torch.save``-d

Loading never unpickles by default. ``trainer.pickle`` is read with ``torch.load(weights_only=True)`` (which accepts
what ``torch.serialization.add_safe_globals`` allows) unless the caller passes ``weights_only=False``: exactly how
Lightning loads its own checkpoints (``Trainer.fit(ckpt_path=..., weights_only=False)``). A refused pickle raises
:class:`UnsafeCheckpointError` naming the file, the objects and how to opt in.

The older layout's ``trainer.pt`` (the whole state ``torch.save``-d) loads under the same rule.

Schema, checked on load before anything is returned (so before a strategy loads any weights): ``trainer.json`` is
bounded in size and depth (:mod:`zeroshard.checkpoint.bounded_json`; a save refuses a state nested deeper), every node
is a JSON scalar or one of the tagged objects above with the right keys and value types (a ``$device`` that names
a device, a ``$size`` of non-negative ints, an ``$ndarray`` whose bytes fit its shape, a ``$tensor`` that
``trainer.safetensors`` holds, ...), the whole state is a dict, and a Lightning trainer state (one with a
``pytorch-lightning_version``) has Lightning's types: ``epoch`` and ``global_step`` non-negative ints, ``loops`` a dict
of dicts whose progress counters are non-negative ints, ``callbacks`` a dict, ``lr_schedulers`` a list of dicts,
``hyper_parameters`` a mapping. Every error is a :class:`~zeroshard.checkpoint.safe_paths.CheckpointError` naming the
file and the key (``trainer_state.loops.fit_loop``); safetensors errors name ``trainer.safetensors``.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from zeroshard.checkpoint import bounded_json
from zeroshard.checkpoint.safe_paths import CheckpointError, create_exclusive, kind, read_bounded, regular_file

STRUCTURE = "trainer.json"
TENSORS = "trainer.safetensors"
PICKLED = "trainer.pickle"
LEGACY = "trainer.pt"  # the single-version layout: everything torch.save-d
_ST_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
}  # fmt: skip


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file needs pickle to load and the caller did not pass ``weights_only=False``."""


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.pickled: dict[str, Any] = {}
        self.pickled_what: list[str] = []

    def tensor(self, t: torch.Tensor) -> str:
        key = f"t{len(self.tensors)}"
        self.tensors[key] = t.detach().cpu().contiguous().clone()
        return key

    def __call__(self, obj: Any, at: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)) or type(obj) is int:
            return obj
        if type(obj) is float:
            return obj if math.isfinite(obj) else {"$float": repr(obj)}
        if type(obj) is dict or type(obj) is OrderedDict:
            tag = "$odict" if type(obj) is OrderedDict else "$dict"
            if all(type(k) is str for k in obj):
                return {tag: {k: self(v, f"{at}.{k}") for k, v in obj.items()}}
            return {tag + "_items": [[self(k, f"{at}.<key>"), self(v, f"{at}[{k!r}]")] for k, v in obj.items()]}
        if type(obj) in (list, tuple):
            return {f"${type(obj).__name__}": [self(v, f"{at}[{i}]") for i, v in enumerate(obj)]}
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided and obj.dtype in _ST_DTYPES:
            return {"$tensor": self.tensor(obj)}
        if isinstance(obj, torch.dtype):
            return {"$dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"$device": str(obj)}
        if type(obj) is torch.Size:
            return {"$size": list(obj)}
        if type(obj) is np.ndarray and obj.dtype.kind in "biuf" and not obj.dtype.hasobject:
            raw = torch.from_numpy(np.ascontiguousarray(obj).reshape(-1).view(np.uint8).copy())
            return {"$ndarray": self.tensor(raw), "dtype": obj.dtype.str, "shape": list(obj.shape)}
        if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
            return {"$npscalar": obj.dtype.str, "value": self(obj.item(), at)}
        key = f"p{len(self.pickled)}"
        self.pickled[key] = obj
        what = f"{at} ({type(obj).__module__}.{type(obj).__qualname__})"
        self.pickled_what.append(what)
        return {"$pickle": key, "at": what}


def save(directory: Path, state: dict[str, Any]) -> list[str]:
    """Writes ``state`` as :data:`STRUCTURE` + :data:`TENSORS` (+ :data:`PICKLED` when needed) into ``directory``;
    returns the file names written (not yet fsynced)."""
    enc = _Encoder()
    structure = enc(state, "trainer_state")
    files = [STRUCTURE, TENSORS]
    doc = {"format_version": 1, "state": structure}
    found, at = bounded_json.depth(doc)
    if found > bounded_json.MAX_DEPTH:  # refused now rather than at load
        raise ValueError(
            f"the trainer state nests {found} levels deep as JSON ({STRUCTURE}, at {at[:200]}), more than the "
            f"{bounded_json.MAX_DEPTH} a load accepts (each dict or list is two levels); keep nested containers in "
            "hyper_parameters and callback state shallower"
        )
    create_exclusive(directory / STRUCTURE, json.dumps(doc, indent=1).encode())
    save_file(enc.tensors, str(directory / TENSORS))
    if enc.pickled:
        torch.save(enc.pickled, directory / PICKLED)
        files.append(PICKLED)
    return files


def _opt_in_hint(file: Path, what: str, error: Exception) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"{file} needs pickle to load ({what}), and unpickling can run code from the file, so it is refused by "
        "default. If you trust this checkpoint, pass weights_only=False: trainer.fit(model, ckpt_path=..., "
        "weights_only=False) (also validate/test/predict), fabric.load(..., weights_only=False), "
        "load_sharded(..., weights_only=False) or `python -m zeroshard.consolidate ... --allow-pickle`; or allow "
        f"the classes with torch.serialization.add_safe_globals. (torch: {reason})"
    )


def _unpickle(file: Path, weights_only: bool | None, what: str) -> Any:
    """``torch.load`` of a pickle under Lightning's rule: ``weights_only=False`` unpickles anything; ``None`` and
    ``True`` only what torch's weights-only unpickler (plus its safe globals) accepts."""
    if weights_only is False:
        return torch.load(file, map_location="cpu", weights_only=False)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(_opt_in_hint(file, what, e)) from None


_PICKLED_VALUE = object()  # what a pickled object decodes to when only the structure is checked (check())
_SCALARS = (type(None), bool, int, float, str)
_EXTRA_KEYS = {"$ndarray": {"dtype", "shape"}, "$npscalar": {"value"}, "$pickle": {"at"}}
_MAX_DIMS = 64


class _Decoder:
    """Builds the state from ``trainer.json``'s structure, checking every node; errors name the file and the key.

    With ``unpickle=False`` (:func:`check`) a ``$pickle`` node decodes to a placeholder and ``trainer.pickle`` is never
    read."""

    def __init__(self, directory: Path, weights_only: bool | None, pickled_what: list[str], unpickle: bool) -> None:
        self.directory = directory
        self.file = directory / STRUCTURE
        self.weights_only = weights_only
        self.pickled_what = pickled_what
        self.unpickle = unpickle
        self._tensors: dict[str, torch.Tensor] | None = None
        self._pickled: Any = None

    def fail(self, at: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: key {at}: {problem}")

    def tensor(self, key: Any, at: str) -> torch.Tensor:
        if not isinstance(key, str):
            raise self.fail(at, f"tensor name {str(key)[:60]!r} is not a string")
        if self._tensors is None:
            try:
                regular_file(self.directory, TENSORS, STRUCTURE)
                self._tensors = load_file(str(self.directory / TENSORS))
            except FileNotFoundError:
                raise self.fail(at, f"names tensor {key!r}, but {TENSORS} is missing") from None
            except CheckpointError:
                raise
            except Exception as e:  # safetensors' own SafetensorError
                raise CheckpointError(
                    f"{self.directory / TENSORS} is not a valid safetensors file ({type(e).__name__}: {str(e)[:200]})"
                ) from None
        if key not in self._tensors:
            raise self.fail(at, f"names tensor {key!r}, which {TENSORS} lacks")
        return self._tensors[key]

    def pickled(self, key: Any, at: str) -> Any:
        if not isinstance(key, str):
            raise self.fail(at, f"pickled object name {str(key)[:60]!r} is not a string")
        if not self.unpickle:
            return _PICKLED_VALUE
        if self._pickled is None:
            try:
                regular_file(self.directory, PICKLED, STRUCTURE)
            except FileNotFoundError:
                raise self.fail(at, f"names pickled object {key!r}, but {PICKLED} is missing") from None
            self._pickled = _unpickle(self.directory / PICKLED, self.weights_only, "; ".join(self.pickled_what))
        if not isinstance(self._pickled, dict) or key not in self._pickled:
            raise self.fail(at, f"names pickled object {key!r}, which {PICKLED} lacks")
        return self._pickled[key]

    def numeric(self, text: Any, at: str) -> np.dtype:
        """A numeric numpy dtype from its ``dtype.str`` (never an object dtype)."""
        try:
            dtype = np.dtype(str(text)) if isinstance(text, str) else None
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in "biuf":
            raise self.fail(at, f"{str(text)[:40]!r} is not a numeric numpy dtype")
        return dtype

    def shape(self, value: Any, at: str) -> list[int]:
        if not (isinstance(value, list) and len(value) <= _MAX_DIMS and all(_is_count(v) for v in value)):
            raise self.fail(at, f"shape {str(value)[:80]} is not a list of at most {_MAX_DIMS} non-negative ints")
        return value

    def __call__(self, obj: Any, at: str) -> Any:
        if isinstance(obj, _SCALARS):
            return obj
        if isinstance(obj, list):
            raise self.fail(at, "a bare JSON list where a tagged object belongs")
        tags = [k for k in obj if k.startswith("$")]
        if len(tags) != 1 or set(obj) != {tags[0], *_EXTRA_KEYS.get(tags[0], ())}:
            raise self.fail(at, f"not a tagged object: {str(obj)[:80]}")
        tag = tags[0]
        value = obj[tag]
        if tag in ("$dict", "$odict"):
            if not isinstance(value, dict):
                raise self.fail(at, f"{tag} holds {type(value).__name__}, not an object")
            out = {k: self(v, f"{at}.{k}") for k, v in value.items()}
            return OrderedDict(out) if tag == "$odict" else out
        if tag in ("$dict_items", "$odict_items"):
            if not (isinstance(value, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in value)):
                raise self.fail(at, f"{tag} holds {str(value)[:60]}, not a list of [key, value] pairs")
            items = []
            for i, (k, v) in enumerate(value):
                key = self(k, f"{at}.<key {i}>")
                try:
                    hash(key)
                except TypeError:
                    raise self.fail(f"{at}.<key {i}>", f"a {type(key).__name__} cannot be a dict key") from None
                items.append((key, self(v, f"{at}[{key!r}]")))
            return OrderedDict(items) if tag == "$odict_items" else dict(items)
        if tag in ("$list", "$tuple"):
            if not isinstance(value, list):
                raise self.fail(at, f"{tag} holds {type(value).__name__}, not a list")
            items = [self(v, f"{at}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if tag == "$tuple" else items
        if tag == "$float":
            try:
                return float(value) if isinstance(value, str) else float("x")
            except ValueError:
                raise self.fail(at, f"$float {str(value)[:40]!r} is not 'nan', 'inf' or '-inf'") from None
        if tag == "$tensor":
            return self.tensor(value, at)
        if tag == "$dtype":
            dtype = getattr(torch, value, None) if isinstance(value, str) else None
            if not isinstance(dtype, torch.dtype):
                raise self.fail(at, f"{str(value)[:40]!r} is not a torch dtype")
            return dtype
        if tag == "$device":
            try:
                if not isinstance(value, str):
                    raise TypeError
                return torch.device(value)
            except (RuntimeError, TypeError, ValueError):
                raise self.fail(
                    at, f"$device {repr(value)[:40]} is not a torch device ('cpu', 'cuda:0', ...)"
                ) from None
        if tag == "$size":
            return torch.Size(self.shape(value, at))
        if tag == "$ndarray":
            dtype, shape = self.numeric(obj["dtype"], at), self.shape(obj["shape"], at)
            raw = self.tensor(value, at)
            if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != math.prod(shape) * dtype.itemsize:
                raise self.fail(
                    at, f"$ndarray {value!r} does not hold the bytes of a {dtype.str} array of shape {shape}"
                )
            return np.frombuffer(raw.numpy().tobytes(), dtype=dtype).reshape(shape).copy()
        if tag == "$npscalar":
            dtype, scalar = self.numeric(value, at), obj["value"]
            if not isinstance(scalar, (bool, int, float)):
                raise self.fail(at, f"$npscalar value {str(scalar)[:40]!r} is not a number")
            try:
                return dtype.type(scalar)
            except (OverflowError, ValueError, TypeError) as e:
                raise self.fail(at, f"$npscalar {scalar!r} is not a {dtype.str} ({e})") from None
        if tag == "$pickle":
            return self.pickled(value, at)
        raise self.fail(at, f"unknown tag {tag[:40]!r}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# Lightning's own top-level keys, when the state is a Lightning trainer state (it has pytorch-lightning_version)
_LIGHTNING_TYPES: dict[str, tuple[type, str]] = {
    "pytorch-lightning_version": (str, "a string"),
    "epoch": (int, "a non-negative int"),
    "global_step": (int, "a non-negative int"),
    "loops": (dict, "a dict"),
    "callbacks": (dict, "a dict"),
    "lr_schedulers": (list, "a list of dicts"),
    "hyper_parameters": (Mapping, "a mapping"),
    "datamodule_hyper_parameters": (Mapping, "a mapping"),
    "hparams_name": (str, "a string"),
    "datamodule_hparams_name": (str, "a string"),
}
_COUNTERS = {"ready", "started", "processed", "completed", "_batches_that_stepped"}


def _check_lightning(state: dict[str, Any], fail) -> None:
    """The types Lightning's checkpoint connector and loops rely on, checked before it restores anything."""

    def typed(value: Any, want: type) -> bool:
        if value is _PICKLED_VALUE:  # not unpickled (check()): its type is not known here
            return True
        if want is int:
            return _is_count(value)
        return isinstance(value, want)

    for key, (want, what) in _LIGHTNING_TYPES.items():
        if key in state and not typed(state[key], want):
            raise fail(
                f"trainer_state.{key}", f"is {type(state[key]).__name__} {str(state[key])[:40]}; expected {what}"
            )
    for i, scheduler in enumerate(state.get("lr_schedulers") or []):
        if not typed(scheduler, dict):
            raise fail(f"trainer_state.lr_schedulers[{i}]", f"is {type(scheduler).__name__}; expected a dict")
    todo = [(f"trainer_state.loops.{k}", v, True) for k, v in (state.get("loops") or {}).items()]
    while todo:  # every loop's state is a dict; its progress counters are non-negative ints
        at, value, must_be_dict = todo.pop()
        if must_be_dict and not typed(value, dict):
            raise fail(at, f"is {type(value).__name__} {str(value)[:40]}; expected a dict (a loop's state)")
        if isinstance(value, dict):
            for k, v in value.items():
                if k in _COUNTERS and not typed(v, int):
                    raise fail(f"{at}.{k}", f"is {type(v).__name__} {str(v)[:40]}; expected a non-negative int")
                todo.append((f"{at}.{k}", v, k in ("total", "current")))


def _pickled_entries(structure: Any, out: list[str]) -> list[str]:
    if isinstance(structure, dict):
        if "$pickle" in structure:
            out.append(str(structure.get("at", structure["$pickle"])))
        for v in structure.values():
            _pickled_entries(v, out)
    elif isinstance(structure, list):
        for v in structure:
            _pickled_entries(v, out)
    return out


def lightning_weights_only(weights_only: bool | None) -> bool | None:
    """``weights_only`` as the user passed it to ``Trainer.fit/validate/test/predict``.

    Lightning 2.6 drops it for strategies that restore after setup, as ZeroStrategy must (the engine has to exist):
    ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it (lightning/pytorch/trainer/
    trainer.py, the ``restore_checkpoint_after_setup`` branch; the other branch passes it). So when the strategy got
    ``None``, this reads the value from the ``Trainer._run`` frame that called it; ``None`` if there is none.
    """
    if weights_only is not None:
        return weights_only
    trainer_cls = getattr(sys.modules.get("lightning.pytorch.trainer.trainer"), "Trainer", None)
    run = getattr(getattr(trainer_cls, "_run", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and run is not None:
        if frame.f_code is run:
            return frame.f_locals.get("weights_only")
        frame = frame.f_back
    return None


def _decode(directory: Path, weights_only: bool | None, unpickle: bool) -> dict[str, Any]:
    file = directory / STRUCTURE
    data = read_bounded(directory, STRUCTURE, bounded_json.MAX_BYTES, "the checkpoint")  # a regular file, bounded
    doc = bounded_json.loads(data, str(file))  # depth bounded: errors name the file (and the key)
    if not isinstance(doc, dict) or "state" not in doc:
        raise CheckpointError(
            f'{file}: key state: missing; a zeroshard trainer state is {{"format_version": 1, "state": ...}}'
        )
    if doc.get("format_version") != 1:
        raise CheckpointError(
            f"{file}: key format_version: {str(doc.get('format_version'))[:20]}; this zeroshard reads 1"
        )
    structure = doc["state"]
    decoder = _Decoder(directory, weights_only, _pickled_entries(structure, []), unpickle)
    state = decoder(structure, "trainer_state")
    if not isinstance(state, dict):
        raise decoder.fail("trainer_state", f"is {type(state).__name__}; the trainer state must be a dict ($dict)")
    if "pytorch-lightning_version" in state:
        _check_lightning(state, decoder.fail)
    return state


def check(directory: str | os.PathLike) -> str:
    """Checks the trainer state in ``directory`` as :func:`load` does, without unpickling anything (for
    :mod:`zeroshard.checkpoint.adopt`); returns what was checked.

    Raises:
        CheckpointError: naming the file and the key.
    """
    directory = Path(directory)
    if kind(directory, STRUCTURE) != "missing":
        _decode(directory, None, unpickle=False)
        return f"{STRUCTURE} (every key; pickled objects not opened)"
    if kind(directory, LEGACY) != "missing":
        regular_file(directory, LEGACY, "the checkpoint")
        return f"{LEGACY} not opened (a pickle: it loads only under the weights_only rule)"
    return "no trainer state"


def load(directory: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """The trainer state saved in ``directory`` (this format, or the older ``trainer.pt``); ``{}`` if none. Every key
    is checked against the schema (module docstring) before it is returned.

    Raises:
        UnsafeCheckpointError: some of it was pickled and ``weights_only`` is not False (names the file and the fix).
        CheckpointError (a ``ValueError``): ``trainer.json`` is not valid JSON, too large or deep, or breaks the
            schema; ``trainer.safetensors`` is not valid (each names the file, and the key).
    """
    directory = Path(directory)
    if kind(directory, STRUCTURE) != "missing":
        return _decode(directory, weights_only, unpickle=True)
    if kind(directory, LEGACY) != "missing":
        regular_file(directory, LEGACY, "the checkpoint")
        return _unpickle(directory / LEGACY, weights_only, "the whole trainer state, in the older single-file layout")
    return {}

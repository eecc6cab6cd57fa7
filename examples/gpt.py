"""A minGPT-style decoder-only transformer (after Karpathy's minGPT/nanoGPT), written to be meta-init friendly.

Initialisation contract (what zeroshard's meta-device init relies on):

* Every parameter is initialised by the ``reset_parameters()`` of the module that owns it *directly*; no module walks
  its children, and no init happens in ``GPT.__init__`` besides the children's own constructors.
* Modules that own parameters are leaves, and each is constructed right where it is registered, so construction order
  equals ``model.modules()`` order. Each ``reset_parameters()`` draws from the global RNG exactly once per owned tensor.
  Hence: seed, build on ``torch.device("meta")``, ``to_empty(device=...)``, ``tie_weights()``, then call
  ``reset_parameters()`` on every module in ``model.modules()`` order with the same seed -> bit-identical parameters to
  an eager build.
* The LM head shares the token embedding's weight and initialises nothing (``TiedLMHead.reset_parameters`` is a no-op);
  otherwise a late head init would overwrite the tied tensor. ``to_empty`` breaks tying (it re-creates each module's
  parameters), so call ``GPT.tie_weights()`` after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

INIT_STD = 0.02  # GPT-2's init scale for linear and embedding weights


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 128
    vocab_size: int = 256  # bytes
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class Linear(nn.Linear):
    """``nn.Linear`` with GPT-2 init: weight ~ N(0, std), bias = 0. ``std`` is per instance (residual projections
    use a smaller one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = INIT_STD) -> None:
        self.std = std  # set before nn.Linear.__init__, which calls reset_parameters()
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` with GPT-2 init N(0, 0.02) instead of torch's N(0, 1)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class TiedLMHead(nn.Module):
    """Output projection whose weight *is* the token embedding's weight (``lm_head.weight = wte.weight``).

    It registers the shared ``nn.Parameter`` (so sharding engines see the tie) but never initialises it.
    """

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def reset_parameters(self) -> None:
        pass  # the embedding owns the init of the shared weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> logits (B, T, vocab_size)."""
        return F.linear(x, self.weight)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        # residual projections are scaled by 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with
        # depth (two residual adds per block)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=INIT_STD / math.sqrt(2 * cfg.n_layer))
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=INIT_STD / math.sqrt(2 * cfg.n_layer))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)). The natural ZeRO-3 wrap unit."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + learned position embeddings -> n_layer Blocks -> LayerNorm -> tied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = TiedLMHead(self.wte)

    def tie_weights(self) -> None:
        """Re-point the head at the embedding's weight; needed after ``to_empty``/``load_state_dict(assign=True)``."""
        self.lm_head.weight = self.wte.weight

    def num_params(self) -> int:
        """Number of distinct parameter elements (the tied embedding/head weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) int64 token ids, T <= block_size -> logits (B, T, vocab_size) in the compute dtype."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Autoregressively extend idx (B, T) int64 by max_new_tokens -> (B, T + max_new_tokens).

        temperature <= 0 means greedy decoding; top_k keeps only the k most likely tokens before sampling.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits = self(context)[:, -1, :].float()
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
            idx = torch.cat([idx, next_id], dim=1)
        return idx

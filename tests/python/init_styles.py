"""Models that initialise themselves the ways models no one here wrote do, for the meta-init tests (issue 16).

Each has a ``forward`` and an ``example(batch, generator)`` input, so the multi-rank runs can train it against DDP:

* :class:`VisionNet`: torchvision's style, a constructor loop over ``self.modules()`` with ``nn.init``, then in-place
  edits (a scale, one row zeroed);
* :class:`TimmStyle`: timm's style, ``named_apply(init_weights)`` from the constructor, ``trunc_normal_`` on a
  position embedding, a layer scale made by a factory;
* :class:`Rope`: a rotary cache assigned (not written in place) in ``reset_parameters``, as LitGPT's ``GPT`` does.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn


class VisionNet(nn.Module):
    """As torchvision's ResNet / VGG constructors do: build, then loop over ``self.modules()`` with ``nn.init``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.GroupNorm(2, 8)
        )
        self.fc = nn.Linear(8, 10)
        self.embed = nn.Embedding(12, 8, padding_idx=0)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0.5)
        with torch.no_grad():
            self.embed.weight.mul_(0.5)  # an in-place edit after the init, replayed too
            self.embed.weight[0].zero_()  # a write into part of a tensor

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = self.features(x).mean(dim=(2, 3)) + self.embed(idx).mean(dim=1)
        return self.fc(h)

    @staticmethod
    def example(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
        x = torch.randn(batch, 3, 6, 6, generator=gen)
        idx = torch.randint(0, 12, (batch, 3), generator=gen)
        return (x, idx), torch.randint(0, 10, (batch,), generator=gen)


def named_apply(fn, module: nn.Module, name: str = "", depth_first: bool = True) -> nn.Module:
    """timm.models._manipulate.named_apply, written again here (timm needs torchvision)."""
    if not depth_first:
        fn(module=module, name=name)
    for child_name, child in module.named_children():
        named_apply(fn, child, ".".join((name, child_name)) if name else child_name, depth_first)
    if depth_first:
        fn(module=module, name=name)
    return module


def init_weights_vit(module: nn.Module, name: str = "", head_bias: float = 0.0) -> None:
    """timm's ``init_weights_vit_jax``-like rule: trunc-normal Linear, zero head, a learned token."""
    if isinstance(module, nn.Linear):
        if name.startswith("head"):
            nn.init.zeros_(module.weight)
            nn.init.constant_(module.bias, head_bias)
        else:
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.normal_(module.bias, std=1e-6)
    elif hasattr(module, "init_weights"):
        module.init_weights()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gamma = nn.Parameter(1e-5 * torch.ones(d))  # layer scale: a value computed from a factory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.mlp(self.norm(x))


class TimmStyleComputed(nn.Module):
    """Position embedding and layer scale computed from factories (``randn * 0.02``, ``1e-5 * ones``): the meta
    device cannot replay these, so materialisation must name them."""

    def __init__(self, d: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, d) * 0.02)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(depth)])
        self.head = nn.Linear(d, 4)
        nn.init.normal_(self.cls_token, std=1e-6)
        named_apply(partial(init_weights_vit, head_bias=-math.log(4)), self)


class TimmStyle(nn.Module):
    """The same with the computed tensors initialised in place (how timm itself writes them: ``trunc_normal_``)."""

    def __init__(self, d: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, d))
        self.blocks = nn.Sequential(*[Block(d) for _ in range(depth)])
        for b in self.blocks:
            b.gamma = nn.Parameter(torch.full((d,), 1e-5))
        self.head = nn.Linear(d, 4)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        named_apply(partial(init_weights_vit, head_bias=-math.log(4)), self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.blocks(x)[:, 0])

    @staticmethod
    def example(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
        return (torch.randn(batch, 4, 16, generator=gen),), torch.randint(0, 4, (batch,), generator=gen)


class Rope(nn.Module):
    """A rotary cache assigned in ``reset_parameters`` (``self.cos, self.sin = ...``), as LitGPT's ``GPT`` does."""

    def __init__(self, n: int = 8, d: int = 4) -> None:
        super().__init__()
        self.n, self.d = n, d
        self.proj = nn.Linear(d, d)
        self.out = nn.Linear(d, 3)
        cos, sin = self.cache()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cache(self, device=None):
        theta = 1.0 / (10000 ** (torch.arange(0, self.d, 2, device=device).float() / self.d))
        idx = torch.outer(torch.arange(self.n, device=device).float(), theta)
        return torch.cos(idx), torch.sin(idx)

    def reset_parameters(self) -> None:
        self.cos, self.sin = self.cache(device=self.cos.device)  # assigned, not written in place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)  # (B, n, d)
        a, b = q[..., : self.d // 2], q[..., self.d // 2 :]
        rotated = torch.cat([a * self.cos - b * self.sin, a * self.sin + b * self.cos], dim=-1)
        return self.out(rotated.mean(dim=1))

    @staticmethod
    def example(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
        return (torch.randn(batch, 8, 4, generator=gen),), torch.randint(0, 3, (batch,), generator=gen)

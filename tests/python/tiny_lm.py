"""A small language model for the engine tests: tied embedding/head, a frozen parameter, several param groups."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard

VOCAB, DIM, SEQ = 64, 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(L.LightningModule):
    """Embedding -> 2 residual MLP blocks -> LayerNorm -> head tied to the embedding.

    ``frozen_scale`` is a frozen parameter (no gradient, no optimizer state). ``optimizer`` picks the torch optimizer.
    ``unused=True`` adds a layer used only in every other training step. ``odd=True`` adds a 3-element gain, so the
    parameter count (18,979, of which 18,947 trainable) divides by neither 3 nor 4.
    """

    def __init__(
        self,
        optimizer: str = "adamw",
        lr: float = 1e-2,
        record: list | None = None,
        unused: bool = False,
        odd: bool = False,
        gathered_in_step: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.frozen_scale = nn.Parameter(torch.full((DIM,), 0.5), requires_grad=False)
        # with unused=True, a layer that only every other training step uses (ranks must still agree on collectives)
        self.sometimes = nn.Linear(DIM, DIM) if unused else None
        self.odd_gain = nn.Parameter(torch.ones(3)) if odd else None
        self._calls = 0
        self.gathered_in_step = gathered_in_step
        self.optimizer_name = optimizer
        self.lr = lr
        self.losses: list[float] = [] if record is None else record

    def reset_parameters(self) -> None:
        """Initialises this module's own tensors only (the meta-device contract); children have their own."""
        with torch.no_grad():
            self.frozen_scale.fill_(0.5)
            if self.odd_gain is not None:
                self.odd_gain.fill_(1.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) * (1 + self.frozen_scale)
        if self.odd_gain is not None:
            x = x * self.odd_gain.mean()
        if self.sometimes is not None and self.training:
            self._calls += 1
            if self._calls % 2 == 0:
                x = x + self.sometimes(x)
        return self.head(self.norm(self.blocks(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        if self.gathered_in_step:  # every parameter whole between forward and backward, then back as it was
            with zeroshard.gathered_parameters(self):
                assert all(p.numel() > 0 for p in self.parameters())
                self.weight_sum = float(sum(p.detach().double().sum() for p in self.parameters()))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)), sync_dist=True)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(groups, lr=self.lr)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(groups, lr=self.lr)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        if self.optimizer_name == "plain_sgd":  # no state, no decay: a zero gradient is exactly a skipped update
            return torch.optim.SGD([{**g, "weight_decay": 0.0} for g in groups], lr=10 * self.lr)
        raise ValueError(self.optimizer_name)


def token_dataset(n: int = 256, seed: int = 1234) -> torch.utils.data.TensorDataset:
    """Sequences from a fixed random bigram table, so there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    data = torch.empty(n, SEQ + 1, dtype=torch.long)
    data[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        choice = torch.randint(0, 4, (n,), generator=g)
        data[:, t + 1] = nxt[data[:, t], choice]
    return torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])

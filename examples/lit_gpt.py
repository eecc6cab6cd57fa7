"""The LightningModule: GPT + next-byte cross-entropy + AdamW with warmup/cosine LR."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F

from gpt import GPT, GPTConfig


class WarmupCosine:
    """LR multiplier for LambdaLR: linear warmup over warmup_steps, then cosine decay to min_ratio at total_steps.

    A class rather than a lambda so the scheduler stays picklable.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.1, cosine: bool = True) -> None:
        self.warmup_steps, self.total_steps, self.min_ratio, self.cosine = warmup_steps, total_steps, min_ratio, cosine

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if not self.cosine:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LitGPT(L.LightningModule):
    """Trains ``GPT`` on (x, y) byte batches of shape (B, T) int64.

    The GPT itself is built in ``configure_model`` (not ``__init__``) so a sharding strategy can build it inside its
    own init context (meta device, local shards); Lightning calls that hook under ``strategy.model_sharded_context()``.
    """

    def __init__(
        self,
        config: GPTConfig,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        lr_schedule: str = "cosine",
        min_lr_ratio: float = 0.1,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = config
        self.model: GPT | None = None
        self.tokens_seen = 0  # on this rank

    def configure_model(self) -> None:
        if self.model is None:  # the hook runs again for every fit/validate call
            self.model = GPT(self.config)
            if self.hparams.init_from:
                self._load_pretrained(self.hparams.init_from)

    def _load_pretrained(self, path: str) -> None:
        """Weights from a safetensors file (e.g. ``python -m zeroshard.consolidate`` output of an earlier run).

        Under ZeRO stage 3 the GPT is still on the meta device here: the load is recorded and each rank reads only
        its shards' slices when the strategy shards the model; otherwise every rank loads it whole.
        """
        from zeroshard import load_pretrained
        from zeroshard.pretrained import SafetensorsSource

        load_pretrained(self.model, SafetensorsSource(path, strip_prefix="model."))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        # fp32 softmax/log-sum-exp even when the compute dtype is half
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        loss = self._loss(batch)
        self.tokens_seen += batch[0].numel()
        self.log("train_loss", loss, prog_bar=True)
        self.log("tokens", float(self.tokens_seen * self.trainer.world_size))  # all ranks, same batch size each
        # Lightning divides "loss" by accumulate_grad_batches before callbacks see it; "raw_loss" is passed untouched
        return {"loss": loss, "raw_loss": loss.detach()}

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        # weight decay on matmul/embedding weights only; biases and LayerNorm gains are left undecayed
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=hp.betas,
        )
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches
        schedule = WarmupCosine(hp.warmup_steps, int(total), hp.min_lr_ratio, cosine=hp.lr_schedule == "cosine")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

"""Rank worker for the multi-optimizer tests: a small GAN trained by Lightning's manual optimization, two optimizers.

Usage (one process per rank, started by ``launch.run_ranks``):
    gan_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``strategy`` ("ddp" or "zeroshard"), ``loop`` and optional ``stage``, ``offload``,
``max_steps`` (optimizer steps, both optimizers counted; default 40 = 20 batches = 2 epochs), ``save_ckpt`` (path
written after fit), ``resume_from``, ``sharded`` (sharded checkpoints, else full), ``precision``, ``validate``
(``trainer.validate`` after fit: the discriminator's loss on real and generated points, float inputs). Loops:

* ``docs``: Lightning's GAN example: discriminator step on ``errD`` (generator output detached), then generator step
  on ``errG``, whose backward also reaches the discriminator's parameters; each optimizer zeroes its gradients
  before its backward.
* ``toggle``: ``toggle_optimizer``/``untoggle_optimizer`` around each optimizer's step, ``zero_grad`` after ``step``.
* ``shared``: one backward of ``errD + errG`` per batch; the generator zeroes and steps every batch, the
  discriminator only every second batch, so its gradients accumulate over two backward passes.
* ``automatic``: two optimizers with automatic optimization, which Lightning refuses; the error is recorded.

Writes ``{name}_rank{r}.json`` (losses ``[err_d, err_g, global_step]`` per batch, the error, the validation loss, the
parameter dtypes after fit) and, on rank 0, ``{name}.pt`` (final parameters).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import zeroshard

NOISE = 8


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(NOISE, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2))
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.net(x))


class GAN(L.LightningModule):
    def __init__(self, loop: str) -> None:
        super().__init__()
        self.G = Generator()
        self.D = Discriminator()
        self.loop = loop
        self.automatic_optimization = loop == "automatic"
        self.losses: list[list[float]] = []

    def _fake(self, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.global_rank + self.global_step)  # per rank and step (resumes)
        return self.G(torch.randn(n, NOISE, generator=g))

    def _err_d(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(real.shape[0], 1)
        real_loss = F.binary_cross_entropy_with_logits(self.D(real), ones)
        return real_loss + F.binary_cross_entropy_with_logits(self.D(fake), torch.zeros_like(ones))

    def _err_g(self, fake: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.D(fake), torch.ones(fake.shape[0], 1))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        fake = self._fake(real.shape[0])
        if self.loop == "automatic":
            return self._err_d(real, fake.detach()) + self._err_g(fake)
        g_opt, d_opt = self.optimizers()
        if self.loop == "docs":
            err_d = self._err_d(real, fake.detach())
            d_opt.zero_grad()
            self.manual_backward(err_d)
            d_opt.step()
            err_g = self._err_g(fake)  # after the discriminator's step, as in Lightning's example
            g_opt.zero_grad()
            self.manual_backward(err_g)
            g_opt.step()
        elif self.loop == "toggle":
            self.toggle_optimizer(g_opt)
            err_g = self._err_g(fake)
            self.manual_backward(err_g)
            g_opt.step()
            g_opt.zero_grad()
            self.untoggle_optimizer(g_opt)
            self.toggle_optimizer(d_opt)
            err_d = self._err_d(real, fake.detach())
            self.manual_backward(err_d)
            d_opt.step()
            d_opt.zero_grad()
            self.untoggle_optimizer(d_opt)
        else:  # shared: one backward reaches both; only the generator zeroes its gradients every batch
            err_d, err_g = self._err_d(real, fake), self._err_g(fake)
            g_opt.zero_grad()
            self.manual_backward(err_d + err_g)
            g_opt.step()
            if batch_idx % 2 == 1:
                d_opt.step()
                d_opt.zero_grad()
        self.losses.append([err_d.item(), err_g.item(), float(self.global_step)])

    def validation_step(self, batch, batch_idx):
        (real,) = batch
        self.log("val_err_d", self._err_d(real, self._fake(real.shape[0])), sync_dist=True)

    def configure_optimizers(self):
        d_weights = [p for p in self.D.parameters() if p.dim() == 2]
        d_biases = [p for p in self.D.parameters() if p.dim() == 1]
        g_opt = torch.optim.Adam(self.G.parameters(), lr=2e-3, betas=(0.5, 0.999))
        d_opt = torch.optim.AdamW(
            [{"params": d_weights, "weight_decay": 0.1}, {"params": d_biases, "weight_decay": 0.0}], lr=1e-3
        )
        return g_opt, d_opt


def dataset(n: int = 160) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    angle = torch.rand(n, generator=g) * 6.2832
    return torch.utils.data.TensorDataset(torch.stack([angle.cos(), angle.sin()], 1) * 2 + 0.1 * torch.randn(n, 2))


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    for run in runs:
        L.seed_everything(3, verbose=False)
        if run["strategy"] == "ddp":
            strategy = DDPStrategy(process_group_backend="gloo", find_unused_parameters=True)
        else:
            stage = run.get("stage", 2)
            strategy = zeroshard.ZeroStrategy(
                stage=stage,
                offload_optimizer=run.get("offload", False),
                wrap_policy=(Generator, Discriminator) if stage == 3 else None,
                reduce_bucket_size=1000,
                state_dict_type="sharded" if run.get("sharded") else "full",
            )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=run.get("max_steps", 40),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
            precision=run.get("precision", "32-true"),
        )
        model = GAN(run["loop"])
        loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
        result = {}
        try:
            trainer.fit(model, loader, ckpt_path=run.get("resume_from"))
        except RuntimeError as e:
            if run["loop"] != "automatic":
                raise
            result["error"] = str(e)
        result["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        if run.get("validate"):
            result["val_err_d"] = trainer.validate(model, loader, verbose=False)[0]["val_err_d"]
        if run.get("save_ckpt"):
            trainer.save_checkpoint(run["save_ckpt"])
        rank = trainer.global_rank
        (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps({"losses": model.losses, **result}))
        with zeroshard.gathered_parameters(model):
            if rank == 0:
                torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{run['name']}.pt")
        trainer.strategy.barrier()


if __name__ == "__main__":
    main()

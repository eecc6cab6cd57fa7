"""Rank worker: ZeRO stage 3 outside a training step, and Lightning loops that use the model between steps.

Usage: stage3_runtime.py OUT_DIR PART   (2 ranks; PART is "direct" or "loops")

direct: ZeroEngine(stage=3, optimizer offload, so the fp32 masters are separate from the parameter shards) over a
    TinyLM, against an unsharded copy with the same values. Forwards outside a step (no_grad and grad), reads and
    writes of freed parameters, load_state_dict, gathered_parameters with and without writeback, ``.numpy()`` inside
    it, and one optimizer step after the writes, with a block's output halved in place by a forward hook and the next
    block's input doubled in place by a pre-hook (both models see the same batch, so plain AdamW is the reference).
loops: Lightning runs, each under ``ddp`` and ZeroStrategy(stage=3): fit then test on the best checkpoint; EMA with
    Lightning's WeightAveraging (swaps around validation, copy at the end) and its resume after a crash;
    StochasticWeightAveraging on a BatchNorm model (including the batch-norm update epoch without backward).
Writes ``{PART}_rank{r}.json``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.strategies import DDPStrategy
from tiny_lm import Block, TinyLM, token_dataset
from torch import nn

import zeroshard


def _same(a: nn.Module, b: nn.Module) -> list[str]:
    """Names of parameters/buffers that differ (b read whole)."""
    with zeroshard.gathered_parameters(b):
        sb = {k: v.detach().clone() for k, v in b.state_dict().items()}
    return [k for k, v in a.state_dict().items() if not torch.allclose(v, sb[k], rtol=1e-6, atol=1e-7)]


def direct() -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    engine = zeroshard.ZeroEngine(
        model, model.configure_optimizers(), zeroshard.ZeroConfig(stage=3, wrap_policy=Block, offload_optimizer=True)
    )
    units = engine.sharded.units
    x = token_dataset(n=4, seed=5)[:][0]
    r: dict = {}
    with torch.no_grad():
        r["no_grad_forward"] = torch.equal(model(x), ref(x))
    r["freed_after_forward"] = not any(fp.is_gathered for u in units for fp in u.flat_params)
    r["placeholder"] = type(model.blocks[0].up.weight).__name__
    r["is_parameter"] = isinstance(model.blocks[0].up.weight, nn.Parameter)
    r["names"] = [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    y = model(x)  # grad enabled, no backward follows
    r["grad_forward"] = torch.equal(y.detach(), ref(x).detach()) and y.requires_grad
    del y

    # reads: collective gathers on every rank; with autograd, an error
    with torch.no_grad():
        r["read"] = torch.equal(model.blocks[1].down.weight.clone(), ref.blocks[1].down.weight)
        r["read_norm"] = float(model.head.weight.norm()) == float(ref.head.weight.norm())
    try:
        model.blocks[0].up.weight.sum()
        r["grad_read_error"] = None
    except RuntimeError as e:
        r["grad_read_error"] = str(e)
    if dist.get_rank() == 0:  # on one rank only: must not gather (it would wait for the other rank forever)
        r["repr"] = repr(model.blocks[1].down.weight)

    # writes: into this rank's shard (and fp32 master)
    with torch.no_grad():
        new = torch.randn(ref.blocks[0].up.weight.shape, generator=torch.Generator().manual_seed(1))
        model.blocks[0].up.weight.data.copy_(new)
        ref.blocks[0].up.weight.data.copy_(new)
        model.blocks[1].norm.bias.detach().copy_(torch.full_like(ref.blocks[1].norm.bias, 0.25))
        ref.blocks[1].norm.bias.detach().copy_(torch.full_like(ref.blocks[1].norm.bias, 0.25))
        model.blocks[1].down.bias.data = torch.full_like(ref.blocks[1].down.bias, -0.5)
        ref.blocks[1].down.bias.data = torch.full_like(ref.blocks[1].down.bias, -0.5)
    r["after_writes"] = _same(ref, model)
    state = {k: v + 0.5 for k, v in ref.state_dict().items()}
    model.load_state_dict(state)
    ref.load_state_dict(state)
    r["after_load_state_dict"] = _same(ref, model)

    # gathered_parameters: writes kept by default, discarded with writeback=False
    with zeroshard.gathered_parameters(model), torch.no_grad():
        model.blocks[0].down.bias.mul_(3.0)
    ref.blocks[0].down.bias.data.mul_(3.0)
    with zeroshard.gathered_parameters(model, writeback=False), torch.no_grad():
        model.blocks[0].down.bias.zero_()
    r["after_gathered"] = _same(ref, model)

    # .numpy() inside gathered_parameters: leaving works, the array keeps its values
    with zeroshard.gathered_parameters(model):
        arr = model.blocks[1].up.weight.detach().numpy()
        kept = arr.copy()
    r["numpy_kept"] = bool((arr == kept).all())
    with torch.no_grad():
        r["forward_after_numpy"] = torch.equal(model(x), ref(x))

    # one step: the masters saw every write (offload keeps them apart from the parameter shards); a unit's output is
    # modified in place by its caller (a forward hook after the runtime's, on both models), and the next unit's input
    # by that unit (a forward pre-hook after the runtime's): legal, same gradients
    def double_input(module, args) -> None:
        args[0].mul_(2.0)

    halve = [m.blocks[0].register_forward_hook(lambda mod, args, out: out.mul_(0.5)) for m in (model, ref)]
    halve += [m.blocks[1].register_forward_pre_hook(double_input) for m in (model, ref)]
    ref_opt = ref.configure_optimizers()
    engine.begin_step()
    F.cross_entropy(model(x).reshape(-1, 64), x.reshape(-1)).backward()
    engine.finish_backward()
    engine.optimizer.step()
    engine.after_step()
    F.cross_entropy(ref(x).reshape(-1, 64), x.reshape(-1)).backward()
    ref_opt.step()
    r["after_step"] = _same(ref, model)
    for h in halve:
        h.remove()
    return r


# -- Lightning loops ------------------------------------------------------------------------------------------------


class BNModel(L.LightningModule):
    """Lightning's BoringModel with a BatchNorm layer, as in its weight-averaging tests."""

    def __init__(self, crash_on_epoch: int | None = None, scheduler: bool = False) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
        self.crash_on_epoch, self.scheduler = crash_on_epoch, scheduler

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        if self.crash_on_epoch is not None and self.trainer.current_epoch >= self.crash_on_epoch:
            raise RuntimeError("CRASH")
        return F.mse_loss(self(batch), torch.ones(batch.shape[0], 2))

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch), torch.ones(batch.shape[0], 2)), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.scheduler:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1)}


class EMA(WeightAveraging):
    def __init__(self) -> None:
        super().__init__(avg_fn=lambda avg, cur, n: 0.9 * avg + 0.1 * cur)
        self.swaps = self.copies = 0

    def _swap_models(self, *args, **kwargs):
        self.swaps += 1
        return super()._swap_models(*args, **kwargs)

    def _copy_average_to_current(self, *args, **kwargs):
        self.copies += 1
        return super()._copy_average_to_current(*args, **kwargs)


def _strategy(kind: str, **kwargs):
    if kind == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    return zeroshard.ZeroStrategy(stage=3, **kwargs)


def _trainer(root: Path, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=str(root),
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def _final(model: nn.Module) -> dict[str, list]:
    with zeroshard.gathered_parameters(model):
        return {k: v.detach().flatten().tolist() for k, v in model.state_dict().items()}


def fit_then_test_best(kind: str, root: Path) -> dict:
    L.seed_everything(7, verbose=False)
    ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), monitor="val_loss", mode="min", save_top_k=1)
    strategy = _strategy(kind, wrap_policy=Block)
    trainer = _trainer(
        root, max_epochs=3, limit_train_batches=6, callbacks=[ckpt], enable_checkpointing=True, strategy=strategy
    )
    model = TinyLM()
    loader = torch.utils.data.DataLoader(token_dataset(), batch_size=4)
    val = torch.utils.data.DataLoader(token_dataset(n=32, seed=99), batch_size=8)
    trainer.fit(model, loader, val)
    best = Path(ckpt.best_model_path)
    result = trainer.test(ckpt_path="best", dataloaders=val, verbose=False)[0]
    # a fresh Trainer validating the same (stage 3: still sharded) model, now holding the best weights
    fresh = _trainer(root, strategy=_strategy(kind, wrap_policy=Block))
    again = fresh.validate(model, val, verbose=False)[0]
    return {
        "test_loss": result["test_loss"],
        "val_loss_fresh_trainer": again["val_loss"],
        "best": best.name,
        "best_exists": best.exists(),
    }


def _bn_data(n: int = 64) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(11)
    return torch.utils.data.DataLoader(torch.randn(n, 32, generator=g), batch_size=4)


def ema(kind: str, root: Path, crash_on_epoch: int | None = None, resume: str | None = None) -> dict:
    L.seed_everything(3, verbose=False)
    model = BNModel(crash_on_epoch=crash_on_epoch)
    cb = EMA()
    strategy = _strategy(kind, wrap_policy=nn.Linear, state_dict_type="full")
    trainer = _trainer(
        root, max_epochs=4, limit_train_batches=4, limit_val_batches=2, callbacks=[cb],
        enable_checkpointing=crash_on_epoch is not None or resume is not None, strategy=strategy,
    )  # fmt: skip
    try:
        trainer.fit(model, _bn_data(), _bn_data(16), ckpt_path=resume)
    except RuntimeError as e:
        if "CRASH" not in str(e):
            raise
        ckpts = sorted((root / "checkpoints").glob("*.ckpt"))
        return {"crashed": True, "ckpt": str(ckpts[-1]) if ckpts else None}
    return {
        "params": _final(model),
        "swaps": cb.swaps,
        "copies": cb.copies,
        "n_averaged": int(cb._average_model.n_averaged),
    }


def swa(kind: str, root: Path) -> dict:
    L.seed_everything(5, verbose=False)
    model = BNModel(scheduler=True)
    cb = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)
    strategy = _strategy(kind, wrap_policy=nn.Linear)
    trainer = _trainer(
        root, max_epochs=5, limit_train_batches=5, limit_val_batches=0, accumulate_grad_batches=2,
        callbacks=[cb], enable_checkpointing=False, strategy=strategy,
    )  # fmt: skip
    trainer.fit(model, _bn_data(80))
    return {"params": _final(model), "n_averaged": int(cb.n_averaged), "epochs": trainer.current_epoch}


def loops(out: Path) -> dict:
    r: dict = {}
    for kind in ("ddp", "zero"):
        base = out / kind
        r[f"{kind}_fit_test"] = fit_then_test_best(kind, base / "fit_test")
        r[f"{kind}_ema"] = ema(kind, base / "ema")
        r[f"{kind}_swa"] = swa(kind, base / "swa")
    crashed = ema("zero", out / "zero" / "ema_resume", crash_on_epoch=2)
    r["zero_ema_crash"] = crashed
    r["zero_ema_resumed"] = ema("zero", out / "zero" / "ema_resume", resume=crashed["ckpt"])
    return r


def main() -> None:
    out, part = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    if part == "direct":
        dist.init_process_group("gloo")
        result = direct()
    else:
        result = loops(out)
    (out / f"{part}_rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # torch asks for it; a gloo group alive at exit can abort it (pytorch/pytorch#190489)
        dist.destroy_process_group()

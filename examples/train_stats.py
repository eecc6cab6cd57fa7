"""A Callback that records what the run summary reports: per-step train loss, val loss, tokens/s, peak memory and the
model-state bytes each rank holds, beside what DDP would hold for the same model."""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

MODEL_STATE = ("params", "grads", "master", "optimizer_state")


def engine_of(module: L.LightningModule):
    """The zeroshard engine built on ``module``; ``None`` under ddp (or where zeroshard is not installed)."""
    try:
        from zeroshard import engine_of as lookup
    except ImportError:
        return None
    return lookup(module)


def model_state_bytes(pl_module: L.LightningModule, optimizer) -> dict[str, dict[str, int]]:
    """Bytes of model state this rank keeps between steps, by kind (``params``, ``grads``, ``master``,
    ``optimizer_state``): ``{"held": ..., "ddp": ...}``.

    ``held`` under zeroshard is what the engine allocated (``ZeroEngine.memory_summary()``: parameters whole at stages
    1-2 and one shard at 3, fp32 master shards where they are not the parameter shards themselves, fp32 gradient
    shards (stage 1: the whole gradient), optimizer-state shards; shard padding included), plus parameters it does not
    shard. ``ddp`` is what DDP keeps for the same model and optimizer, in the accounting of Rajbhandari et al. 2020
    ("ZeRO", section 3.1): every parameter and gradient whole in fp32 (Lightning's mixed precision keeps fp32
    parameters) and the whole optimizer state, at the bytes per element this run's optimizer keeps (AdamW: 8). DDP's
    gradient buckets (another gradient-sized buffer unless ``gradient_as_bucket_view=True``) are not counted. Under
    ``--strategy ddp``, ``held`` is ``ddp``.
    """
    params = list(pl_module.parameters())  # tied parameters once
    n_all = sum(p.numel() for p in params)
    n_trainable = sum(p.numel() for p in params if p.requires_grad)
    engine = engine_of(pl_module)
    if engine is not None:
        held = engine.memory_summary()
        held["params"] += sum(p.numel() * p.element_size() for _, p in engine.unsharded_parameters())
        shard_elems = sum(fp.layout.shard_numel for fp in engine.flat_params)
        per_element = held["optimizer_state"] / max(1, shard_elems)
    else:
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        per_element = sum(v.numel() * v.element_size() for v in state) / max(1, n_trainable)
    ddp = {
        "params": 4 * n_all,
        "grads": 4 * n_trainable,
        "master": 0,
        "optimizer_state": round(per_element * n_trainable),
    }
    return {"held": held if engine is not None else dict(ddp), "ddp": ddp}


def host_peak_mib() -> float:
    """Peak resident set size of this process in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class TrainStats(L.Callback):
    """Records, on every rank, the loss of every training batch (from ``outputs``), the wall time spent training
    (validation excluded), the CPU time of the whole fit (``fit_cpu_s``: with one core per rank, about the fit's wall
    time on an otherwise idle machine), the tokens this rank processed and its model-state bytes. At ``on_train_end``
    all ranks exchange their stats, so every rank holds ``self.ranks`` (one dict per rank) and ``self.loss_curve``
    (step -> loss averaged over ranks).

    Every ``tokens_window`` optimizer steps the ranks also exchange their training throughput over that window
    (validation excluded) and log it as ``tokens_per_s/rank{i}`` through the trainer's loggers (one all-gather of one
    number per rank per window).
    """

    def __init__(self, tokens_window: int = 10) -> None:
        self.tokens_window = max(1, tokens_window)
        self._win_tokens = 0
        self._win_t0 = self._win_val_s = 0.0
        self.step_losses: list[tuple[int, torch.Tensor]] = []  # (optimizer step at batch start, detached loss)
        self.val_losses: list[tuple[int, float]] = []
        self.tokens = 0
        self.wall_s = self.val_s = 0.0
        self.ranks: list[dict[str, Any]] = []
        self.loss_curve: list[tuple[int, float]] = []
        self._t0 = self._v0 = self._cpu0 = 0.0
        self._step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = self._win_t0 = time.perf_counter()
        self._cpu0 = time.process_time()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step  # 0 for the first batch; on_train_batch_end sees it already incremented

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # keep the tensor: float() here would force a device sync every step on CUDA
        self.step_losses.append((self._step, outputs["raw_loss"]))
        self.tokens += batch[0].numel()
        self._win_tokens += batch[0].numel()
        step = trainer.global_step
        if step != self._step and step % self.tokens_window == 0 and trainer.logger is not None:
            self._log_tokens_per_s(trainer, pl_module)

    def _log_tokens_per_s(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """This window's tokens/s of every rank, logged as ``tokens_per_s/rank{i}`` (a collective: all ranks call)."""
        now = time.perf_counter()
        rate = self._win_tokens / max(now - self._win_t0 - self._win_val_s, 1e-9)
        self._win_tokens, self._win_t0, self._win_val_s = 0, now, 0.0
        mine = torch.tensor([rate], dtype=torch.float64, device=pl_module.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rates = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rates, mine)
        else:
            rates = [mine]
        # straight to the loggers (they write on rank 0 only), at the step Lightning logs this batch's train_loss at;
        # pl_module.log from a callback would repeat the value on every later step's row
        metrics = {f"tokens_per_s/rank{i}": float(r) for i, r in enumerate(rates)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._v0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self.val_s += time.perf_counter() - self._v0
        self._win_val_s += time.perf_counter() - self._v0
        if "val_loss" in trainer.callback_metrics:
            self.val_losses.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.wall_s = time.perf_counter() - self._t0
        cpu_s = time.process_time() - self._cpu0  # all threads of this rank; what it costs on a machine of its own
        train_s = max(self.wall_s - self.val_s, 1e-9)
        # mean over micro-batches of the same optimizer step (gradient accumulation)
        per_step: dict[int, list[float]] = defaultdict(list)
        for step, loss in self.step_losses:
            per_step[step].append(float(loss))
        curve = {s: sum(v) / len(v) for s, v in per_step.items()}
        device = pl_module.device
        gpu_peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
        mine = {
            "rank": trainer.global_rank,
            "host_peak_mib": round(host_peak_mib(), 1),
            "gpu_peak_mib": round(gpu_peak, 1) if gpu_peak is not None else None,
            "tokens": self.tokens,
            "train_s": round(train_s, 3),
            "fit_cpu_s": round(cpu_s, 1),
            "tokens_per_s": round(self.tokens / train_s, 1),
            "final_train_loss": curve[max(curve)] if curve else None,
            "model_state": model_state_bytes(pl_module, trainer.optimizers[0]) if trainer.optimizers else None,
            "loss_curve": curve,
        }
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        self.ranks = [{k: v for k, v in r.items() if k != "loss_curve"} for r in gathered]
        steps = sorted(set.intersection(*(set(r["loss_curve"]) for r in gathered)))
        self.loss_curve = [(s, sum(r["loss_curve"][s] for r in gathered) / len(gathered)) for s in steps]

    def table(self) -> str:
        """One line per rank plus the total throughput."""
        lines = [
            f"{'rank':>4} {'host peak MiB':>13} {'GPU peak MiB':>12} {'tokens':>10} {'train s':>8} "
            f"{'tokens/s':>10} {'final loss':>10}"
        ]
        for r in self.ranks:
            gpu = f"{r['gpu_peak_mib']:.1f}" if r["gpu_peak_mib"] is not None else "-"
            lines.append(
                f"{r['rank']:>4} {r['host_peak_mib']:>13.1f} {gpu:>12} {r['tokens']:>10} {r['train_s']:>8.1f} "
                f"{r['tokens_per_s']:>10.1f} {r['final_train_loss']:>10.4f}"
            )
        lines.append(f"all ranks: {sum(r['tokens_per_s'] for r in self.ranks):.1f} tokens/s")
        if all(r.get("model_state") for r in self.ranks):
            lines += ["", self.model_state_table()]
        return "\n".join(lines)

    def model_state_table(self) -> str:
        """Per rank: model-state MiB held between steps, by kind, beside DDP's total for the same model, and their
        ratio."""
        mib = 2**20
        lines = [
            "model state per rank, MiB held between steps (DDP: whole fp32 parameters, gradients, optimizer state)",
            f"{'rank':>4} {'params':>8} {'grads':>8} {'master':>8} {'optimizer':>9} {'total':>8} {'DDP total':>10} "
            f"{'ratio':>6}",
        ]
        for r in self.ranks:
            held, ddp = r["model_state"]["held"], r["model_state"]["ddp"]
            total, ddp_total = sum(held[k] for k in MODEL_STATE), sum(ddp[k] for k in MODEL_STATE)
            cells = " ".join(f"{held[k] / mib:>{w}.2f}" for k, w in zip(MODEL_STATE, (8, 8, 8, 9)))
            lines.append(
                f"{r['rank']:>4} {cells} {total / mib:>8.2f} {ddp_total / mib:>10.2f} {total / max(1, ddp_total):>6.2f}"
            )
        return "\n".join(lines)

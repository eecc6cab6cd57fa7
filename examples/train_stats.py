"""A Callback that records what the run summary reports: per-step train loss, val loss, tokens/s and peak memory."""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from typing import Any

import lightning as L
import torch
import torch.distributed as dist


def host_peak_mib() -> float:
    """Peak resident set size of this process in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class TrainStats(L.Callback):
    """Records, on every rank, the loss of every training batch (from ``outputs``), the wall time spent training
    (validation excluded) and the tokens this rank processed. At ``on_train_end`` all ranks exchange their stats, so
    every rank holds ``self.ranks`` (one dict per rank) and ``self.loss_curve`` (step -> loss averaged over ranks).
    """

    def __init__(self) -> None:
        self.step_losses: list[tuple[int, torch.Tensor]] = []  # (optimizer step at batch start, detached loss)
        self.val_losses: list[tuple[int, float]] = []
        self.tokens = 0
        self.wall_s = self.val_s = 0.0
        self.ranks: list[dict[str, Any]] = []
        self.loss_curve: list[tuple[int, float]] = []
        self._t0 = self._v0 = 0.0
        self._step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step  # 0 for the first batch; on_train_batch_end sees it already incremented

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # keep the tensor: float() here would force a device sync every step on CUDA
        self.step_losses.append((self._step, outputs["raw_loss"]))
        self.tokens += batch[0].numel()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._v0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self.val_s += time.perf_counter() - self._v0
        if "val_loss" in trainer.callback_metrics:
            self.val_losses.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.wall_s = time.perf_counter() - self._t0
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
            "tokens_per_s": round(self.tokens / train_s, 1),
            "final_train_loss": curve[max(curve)] if curve else None,
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
        return "\n".join(lines)

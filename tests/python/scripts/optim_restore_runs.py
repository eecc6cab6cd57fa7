"""Rank worker for tests/python/test_faults_optimizer_restore.py: resuming an AdamW checkpoint with SGD, 2 ranks.

Usage:
    optim_restore_runs.py OUT    for each of the sharded and the full format: fit TinyLM with AdamW for 2 steps and
                                 save OUT/<format>; resume it with SGD (``REFUSED <format> <message>`` on each rank, and
                                 ``UNCHANGED <format> True`` if the SGD model kept its weights), then
                                 with ``optimizer_state="reset"`` (``RESET <format> <json>``: the SGD groups, the state
                                 keys after 2 more steps and whether the first weights equal the saved ones)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from tiny_lm import TinyLM, token_dataset

import zeroshard


class Probe(L.Callback):
    """Records the weights and optimizer groups as training starts (right after the checkpoint loaded)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.first = {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizers[0].param_groups]


def trainer(fmt: str, max_steps: int, probe: Probe | None = None, **settings) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=zeroshard.ZeroStrategy(stage=2, state_dict_type=fmt, **settings),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe] if probe else [],
    )


def loader():
    return torch.utils.data.DataLoader(token_dataset(n=32), batch_size=4)


def run(out: Path, fmt: str) -> None:
    L.seed_everything(3, verbose=False)
    ck = out / fmt
    t = trainer(fmt, 2)
    t.fit(TinyLM(), loader())
    t.save_checkpoint(ck)
    saved = t.strategy.lightning_module_state_dict()
    torch.manual_seed(11)
    sgd = TinyLM(optimizer="sgd")
    init = {k: v.clone() for k, v in sgd.state_dict().items()}
    try:
        trainer(fmt, 4).fit(sgd, loader(), ckpt_path=ck)
        print(f"LOADED {fmt} without optimizer_state='reset'", flush=True)
    except ValueError as e:
        print(f"REFUSED {fmt} {e}", flush=True)
    unchanged = all(torch.equal(v, init[k]) for k, v in sgd.state_dict().items())
    print(f"UNCHANGED {fmt} {unchanged}", flush=True)  # the refusal came before the weights loaded
    probe = Probe()
    t = trainer(fmt, 4, probe, optimizer_state="reset")
    model = TinyLM(optimizer="sgd")
    t.fit(model, loader(), ckpt_path=ck)
    state = t.strategy._engine.optimizer_state_dict()  # collective
    if dist.get_rank() == 0:
        same = all(torch.equal(probe.first[k], v) for k, v in saved.items())
        keys = sorted({k for s in state["state"].values() for k in s})
        print(f"RESET {fmt} " + json.dumps({"groups": probe.groups, "state_keys": keys, "same": same}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for fmt in ("sharded", "full"):
        run(Path(sys.argv[1]), fmt)
    if dist.is_initialized():  # a gloo group alive at exit can abort it (pytorch/pytorch#190489)
        dist.destroy_process_group()

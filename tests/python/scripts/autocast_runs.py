"""Rank worker for the autocast tests: Trainer fits and Fabric loops of TinyLM in one process group, recording the
autocast state seen inside the step.

Usage (one process per rank, started by ``launch.run_ranks``):
    autocast_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``api`` ("trainer" or "fabric"), ``strategy`` ("ddp" or "zeroshard"), and optional
``stage`` (default 2; stage 3 units are Blocks), ``precision`` (default "bf16-mixed"; "16-mixed" passes
``ZeroPrecision("16-mixed", device="cpu")``, since Lightning turns that flag into bf16-mixed on CPU), ``steps``
(default 20), ``bf16_params`` (DDP only: forward on bf16 copies of the parameters through
``torch.func.functional_call``, gradients flowing back to the fp32 parameters: FSDP's ``MixedPrecision(param_dtype=
torch.bfloat16, reduce_dtype=torch.float32)`` under autocast, emulated in Lightning's DDP), ``validate`` (Trainer:
``trainer.validate`` after fit). Every run starts from seed 7 and the same data.
Writes ``{name}_rank{r}.json``: ``losses`` (fp32 values of the training losses), ``seen`` (one record per training
step: ``autocast`` = ``torch.is_autocast_enabled("cpu")``, ``dtype`` = ``str(torch.get_autocast_dtype("cpu"))``,
``logits``, ``loss`` and ``param`` = the dtypes of the logits, the loss and a block's weight in forward), and
``val_seen`` (the same in ``validation_step``). Fabric runs record ``seen`` as forward saw it, with ``logits`` the
dtype of the model's output after Fabric's ``convert_output``, and ``fabric_autocast`` (the state under
``fabric.autocast()``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.strategies import DDPStrategy
from tiny_lm import VOCAB, Block, TinyLM, token_dataset

import zeroshard
from zeroshard import ZeroPrecision


def state(logits=None, loss=None, param=None) -> dict:
    return {
        "autocast": torch.is_autocast_enabled("cpu"),
        "dtype": str(torch.get_autocast_dtype("cpu")),
        "logits": str(logits.dtype) if logits is not None else None,
        "loss": str(loss.dtype) if loss is not None else None,
        "param": str(param.dtype) if param is not None else None,
    }


class Recording(TinyLM):
    """TinyLM recording the autocast state and dtypes inside ``training_step`` and ``validation_step``."""

    def __init__(self, bf16_params: bool = False) -> None:
        super().__init__()
        self.bf16_params = bf16_params
        self.seen: list[dict] = []
        self.val_seen: list[dict] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.in_forward = state(param=self.blocks[0].up.weight)  # as forward sees it (stage 3: gathered)
        return super().forward(idx)

    def _step(self, batch) -> tuple[torch.Tensor, dict]:
        x, y = batch
        if self.bf16_params:  # FSDP's param_dtype under DDP: forward on bf16 copies, gradients flow to fp32
            copies = {n: p.to(torch.bfloat16) for n, p in self.named_parameters()}
            logits = torch.func.functional_call(self, copies, (x,))
        else:
            logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        return loss, {**state(logits, loss), "param": self.in_forward["param"]}

    def training_step(self, batch, batch_idx):
        loss, seen = self._step(batch)
        self.seen.append(seen)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_seen.append(self._step(batch)[1])


def trainer_run(run: dict, world: int) -> dict:
    stage = run.get("stage", 2)
    precision = run.get("precision", "bf16-mixed")
    if run["strategy"] == "ddp":
        strategy = DDPStrategy(process_group_backend="gloo")
    else:
        plugin = ZeroPrecision("16-mixed", device="cpu") if precision == "16-mixed" else None
        strategy = zeroshard.ZeroStrategy(
            stage=stage, wrap_policy=Block if stage == 3 else None, state_dict_type="full", precision_plugin=plugin
        )
    flag = {} if precision == "16-mixed" else {"precision": precision}  # the plugin's own precision
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=run.get("steps", 20),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        **flag,
    )
    model = Recording(bf16_params=run.get("bf16_params", False))
    trainer.fit(model, torch.utils.data.DataLoader(token_dataset(), batch_size=4))
    if run.get("validate"):
        trainer.validate(model, torch.utils.data.DataLoader(token_dataset(n=32, seed=99), batch_size=8), verbose=False)
    return {"losses": model.losses, "seen": model.seen, "val_seen": model.val_seen}


def fabric_run(run: dict) -> dict:
    stage = run.get("stage", 2)
    if run["strategy"] == "ddp":
        strategy = FabricDDP(process_group_backend="gloo")
    else:
        strategy = zeroshard.ZeroFabricStrategy(stage=stage, wrap_policy=Block if stage == 3 else None)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=run.get("precision", "bf16-mixed"))
    fabric.launch()
    model = Recording()
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(token_dataset(), batch_size=4))
    result: dict = {"losses": [], "seen": []}
    for _, (x, y) in zip(range(run.get("steps", 20)), loader):
        logits = model(x)  # runs under the plugin's forward_context; the output goes through convert_output
        with fabric.autocast():
            result["fabric_autocast"] = state()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        result["seen"].append({**model.module.in_forward, "logits": str(logits.dtype), "loss": str(loss.dtype)})
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(loss.item())
    return result


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "2"))  # read once: Lightning's teardown removes it from the environment
    rank = int(os.environ.get("RANK", "0"))
    for run in runs:
        L.seed_everything(7, verbose=False)
        result = trainer_run(run, world) if run.get("api", "trainer") == "trainer" else fabric_run(run)
        (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps(result))
        torch.distributed.barrier()


if __name__ == "__main__":
    main()

"""Rank worker for the parity and resume tests: runs several Trainer.fit calls over one process group.

Usage (one process per rank, started by ``launch.run_ranks``):
    fit_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``strategy`` ("ddp" or "zeroshard"), and optional ``stage``, ``offload``, ``optimizer``,
``accumulate``, ``clip``, ``max_steps``, ``max_epochs``, ``save_ckpt`` (path to write after fit), ``resume_from``
(ckpt path), ``reduce_bucket_size``, ``allgather_bucket_size``,
``validate`` (validation every 5 steps, then ``trainer.test``), ``unused`` (a layer used every other step),
``check_gather_order``, ``meta`` (build under ``trainer.init_module(empty_init=True)``),
``checkpointing`` (recompute Blocks in backward), ``precision``, ``reduce_bf16``, ``offload_params``,
``offload_chunk`` (elements per chunk of the offload pipeline), ``overlap`` (``overlap_step``),
``persist`` (stage 3 units below 1e5 elements stay gathered),
``sharded`` (sharded checkpoints), ``shard_group_size`` (hybrid sharding), ``mesh`` ([replicate, shard]: hybrid
sharding through a DeviceMesh built here, after an earlier run initialised the process group), ``odd`` (a 3-element
parameter, so the parameter count divides by neither 3 nor 4), ``samples`` (dataset size, default 256),
``plan_options`` (with ``stage: "auto"``), ``gathered`` (``zeroshard.gathered_parameters`` inside
``training_step``, after the forward). Stage 3 units are Blocks. The world size is the launcher's
(``WORLD_SIZE``, default 2).
Writes ``{name}_rank{r}.json`` (losses, and ``comm`` = ``engine.comm_stats()`` for zeroshard runs) and, on rank 0,
``{name}.pt`` (final parameters).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from tiny_lm import Block, TinyLM, token_dataset
from torch.distributed.device_mesh import init_device_mesh

import zeroshard


def make_strategy(run: dict):
    if run["strategy"] == "ddp":
        return DDPStrategy(process_group_backend="gloo", find_unused_parameters=run.get("unused", False))
    stage = run.get("stage", 2)
    return zeroshard.ZeroStrategy(
        stage=stage,
        wrap_policy=Block if stage in (3, "auto") else None,
        plan_options=run.get("plan_options"),
        check_gather_order=run.get("check_gather_order", False),
        activation_checkpointing=Block if run.get("checkpointing") else None,
        reduce_dtype=torch.bfloat16 if run.get("reduce_bf16") else None,
        param_persistence_threshold=10**5 if run.get("persist") else 0,
        state_dict_type="sharded" if run.get("sharded") else "full",
        offload_optimizer=run.get("offload", False),
        offload_params=run.get("offload_params", False),
        offload_chunk_size=run.get("offload_chunk", 4 * 1024 * 1024),
        overlap_step=run.get("overlap", False),
        reduce_bucket_size=run.get("reduce_bucket_size", 3000),
        shard_group_size=run.get("shard_group_size"),
        device_mesh=init_device_mesh("cpu", tuple(run["mesh"]), mesh_dim_names=("replicate", "shard"))
        if run.get("mesh")
        else None,
        allgather_bucket_size=run.get("allgather_bucket_size", 7000),
    )


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "2"))  # read once: Lightning's teardown removes it from the environment
    for run in runs:
        L.seed_everything(run.get("seed", 7), verbose=False)
        loader = torch.utils.data.DataLoader(token_dataset(n=run.get("samples", 256)), batch_size=4)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=make_strategy(run),
            max_steps=run.get("max_steps", -1 if "max_epochs" in run else 20),
            max_epochs=run.get("max_epochs", -1),
            accumulate_grad_batches=run.get("accumulate", 1),
            gradient_clip_val=run.get("clip"),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
            precision=run.get("precision", "32-true"),
            val_check_interval=5 if run.get("validate") else None,
        )
        # meta: built on the meta device through Lightning's own hook; the strategy materialises it (same seed)
        with trainer.init_module(empty_init=run.get("meta", False)):
            model = TinyLM(
                optimizer=run.get("optimizer", "adamw"),
                unused=run.get("unused", False),
                odd=run.get("odd", False),
                gathered_in_step=run.get("gathered", False),
            )
        assert all(p.is_meta for p in model.parameters()) == bool(run.get("meta")), "init_module did not build on meta"
        val_loader = (
            torch.utils.data.DataLoader(token_dataset(n=64, seed=99), batch_size=8) if run.get("validate") else None
        )
        trainer.fit(model, loader, val_loader, ckpt_path=run.get("resume_from"))
        metrics = {}
        if run.get("validate"):
            metrics["val_loss"] = float(trainer.callback_metrics["val_loss"])
            metrics["test_loss"] = trainer.test(model, val_loader, verbose=False)[0]["test_loss"]
        if run.get("save_ckpt"):
            trainer.save_checkpoint(run["save_ckpt"])
        rank = trainer.global_rank
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            metrics["comm"] = engine.comm_stats()
        if getattr(trainer.strategy, "auto_plan", None):
            choice = trainer.strategy.auto_plan["choice"]
            metrics["auto"] = {k: choice[k] for k in ("config", "stage", "offload_optimizer", "shard_group_size")}
            metrics["auto"]["engine_stage"] = engine.config.stage
            metrics["auto"]["engine_offload"] = engine.config.offload_optimizer
            metrics["auto"]["engine_shard_group"] = engine.world_size
        (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps({"losses": model.losses, **metrics}))
        with zeroshard.gathered_parameters(model):
            if rank == 0:
                torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{run['name']}.pt")
        trainer.strategy.barrier()


if __name__ == "__main__":
    main()

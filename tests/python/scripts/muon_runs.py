"""Rank worker for the Muon tests: ``torch.optim.Muon`` + ``torch.optim.AdamW`` (:mod:`muon_model`) passed to
``fabric.setup`` with ``ZeroFabricStrategy``.

Usage (one process per rank, started by ``launch.run_ranks``):
    muon_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``stage``, and optional ``model`` ("net", or "llama": a Hugging Face Llama from a
config), ``accumulate`` (micro-batches per step under ``no_backward_sync``), ``clip`` (max norm, each optimizer clipped
by its own norm, as ``fabric.clip_gradients`` per optimizer does), ``steps`` (default 10), ``save_at`` (a sharded
``fabric.save`` after that many steps, to OUT_DIR/NAME.ckpt), ``resume_from`` (load such a checkpoint, then train to
``steps``), ``shard_group_size`` (hybrid sharding), ``trainer`` (a Lightning ``Trainer`` with ``ZeroStrategy``
instead: Muon + AdamW from ``configure_optimizers`` under manual optimization; writes only ``{name}.pt``).

Rank 0 writes ``{name}.pt`` (final parameters, fp32) and ``{name}.json``: every rank's counted Muon all-to-all bytes
per step (``sent``) and the plan needed to recompute them (each matrix's owner and flat placement), the Newton-Schulz
FLOPs per rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from muon_model import GLOBAL, global_batch, loss_of, make_model, make_optimizers, wrap_block

import zeroshard


def traffic_plan(engine) -> dict:
    """What the traffic theory needs: each Muon matrix's owner and flat placement, from the engine's flat parameters."""
    from zeroshard.optim.sharded_muon import ShardedMuon

    muon = next(o for o in engine.optimizers if isinstance(o, ShardedMuon))
    flat_of = {id(fp.master): fp for fp in engine.flat_params}
    rows = []
    for m in muon.matrices:
        fp = flat_of[id(m.master)]
        pi = fp.names.index(m.name)
        rows.append({"name": m.name, "owner": m.owner, "shape": list(m.shape), "offset": fp.layout.offsets[pi],
                     "numel": fp.layout.numels[pi], "shard_numel": fp.layout.shard_numel})  # fmt: skip
    return {"matrices": rows, "flops": muon.owned_flops()}


class StepBatches(torch.utils.data.Dataset):
    """Item ``i``: this rank's slice of step ``i``'s global batch (the Trainer runs without a distributed sampler)."""

    def __init__(self, steps: int, rank: int, world: int) -> None:
        self.steps, self.rank, self.per = steps, rank, GLOBAL // world

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int):
        x, y = global_batch(i, 0)
        lo, hi = self.rank * self.per, (self.rank + 1) * self.per
        return x[lo:hi], y[lo:hi]


class MuonModule(L.LightningModule):
    """Muon + AdamW returned from ``configure_optimizers``, stepped under manual optimization (Lightning 2 refuses
    two optimizers with automatic optimization)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.net = make_model(kind)
        self.automatic_optimization = False

    def configure_optimizers(self):
        return make_optimizers(self.net)

    def training_step(self, batch, batch_idx):
        muon, adamw = self.optimizers()
        x, y = batch
        self.manual_backward(loss_of(self.net, x, y))
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()


def run_trainer(out: Path, run: dict, world: int) -> None:
    kind = run.get("model", "net")
    strategy = zeroshard.ZeroStrategy(stage=run["stage"], wrap_policy=wrap_block(kind) if run["stage"] == 3 else None,
                                      reduce_bucket_size=900)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)  # fmt: skip
    module = MuonModule(kind)
    data = torch.utils.data.DataLoader(StepBatches(run.get("steps", 10), dist.get_rank(), world), batch_size=None)
    trainer.fit(module, data)
    with zeroshard.gathered_parameters(module.net):
        params = {k: v.detach().float().clone() for k, v in module.net.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(params, out / f"{run['name']}.pt")
    dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])  # read once: a Trainer's teardown takes it out of the environment
    for run in runs:
        if run.get("trainer"):
            run_trainer(out, run, world)
            continue
        stage = run["stage"]
        strategy = zeroshard.ZeroFabricStrategy(
            stage=stage,
            wrap_policy=wrap_block(run.get("model", "net")) if stage == 3 else None,
            shard_group_size=run.get("shard_group_size"),
            reduce_bucket_size=900,
            allgather_bucket_size=2000,
        )
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        rank = fabric.global_rank
        torch.manual_seed(7)
        model = make_model(run.get("model", "net"))
        model, *opts = fabric.setup(model, *make_optimizers(model))
        engine = fabric.strategy.engine
        start = 0
        if run.get("resume_from"):
            state = {"model": model, "step": 0, "opt0": opts[0], "opt1": opts[1]}
            assert fabric.load(out / f"{run['resume_from']}.ckpt", state) == {}
            start = state["step"]
        accumulate = run.get("accumulate", 1)
        sent = []
        for step in range(start, run.get("steps", 10)):
            for micro in range(accumulate):
                x, y = global_batch(step, micro)
                per = GLOBAL // world
                x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
                with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                    fabric.backward(loss_of(model, x, y) / accumulate)
            if run.get("clip"):
                for opt in opts:
                    fabric.clip_gradients(model, opt, max_norm=run["clip"])
            before = engine.comm_stats()["groups"]["matrix"]["total"]["all_to_all"]["bytes"]
            for opt in opts:
                opt.step()
                opt.zero_grad()
            sent.append(engine.comm_stats()["groups"]["matrix"]["total"]["all_to_all"]["bytes"] - before)
            if run.get("save_at") == step + 1:
                fabric.save(out / f"{run['name']}.ckpt", {"model": model, "step": step + 1, "opt0": opts[0],
                                                           "opt1": opts[1]})  # fmt: skip
        gathered = [None] * world
        dist.all_gather_object(gathered, sent)
        plan = traffic_plan(engine)
        with zeroshard.gathered_parameters(model.module):
            params = {k: v.detach().float().clone() for k, v in model.module.state_dict().items()}
        if rank == 0:
            torch.save(params, out / f"{run['name']}.pt")
            result = {"sent": gathered, "plan": plan, "world": world}
            (out / f"{run['name']}.json").write_text(json.dumps(result))
        fabric.barrier()


if __name__ == "__main__":
    main()

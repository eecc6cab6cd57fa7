"""Rank worker for the non-finite gradient tests: a NaN/inf loss on rank 1 only, at one step.

Usage (one process per rank, started by ``launch.run_ranks``):
    nonfinite_runs.py OUT_DIR RUNS_JSON

Each run is a dict: ``name``, ``strategy`` ("ddp": torch's DistributedDataParallel on the batches the ZeRO run
really steps; "zeroshard": the engine; "trainer": Lightning's Trainer with ZeroStrategy), ``stage``, ``offload``,
``mode`` (``nonfinite=``), ``bf16`` (compute dtype), ``clip`` (max norm), ``bad`` ("nan" or "inf"), ``batches`` (DDP:
the batch indices to step). Engine runs take 5 steps; at step ``BAD_STEP`` rank 1's loss is multiplied by NaN (or inf).
Every rank records whether the step raised (and the message), whether its master shards, parameter shards and
optimizer state were bit-for-bit those from before that step, and the first parameter name of bucket 0 (the first
bucket in the flags). Rank 0 writes ``{name}.pt``, the full state dict at the end.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_lm import VOCAB, Block, TinyLM, token_dataset
from torch.nn.parallel import DistributedDataParallel

import zeroshard
from zeroshard import ZeroConfig, ZeroEngine
from zeroshard.engine.step_flags import NonFiniteGradientError

STEPS, BAD_STEP = 5, 2


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = token_dataset(n=2 * 4 * STEPS)
    return [data[(2 * i + rank) * 4 : (2 * i + rank + 1) * 4] for i in range(STEPS)]


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def ddp_run(run: dict, rank: int) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    opt = _optimizer(model)
    ddp = DistributedDataParallel(model)
    data = batches(rank)
    for i in run["batches"]:
        x, y = data[i]
        F.cross_entropy(ddp(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        if run.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), run["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _snapshot(engine) -> list[torch.Tensor]:
    out = []
    for fp in engine.flat_params:
        out += [fp.master.detach().clone(), fp.shard.detach().clone()]
        for v in engine.optim.optimizer_of(fp).state.get(fp.master, {}).values():
            out.append(v.clone() if torch.is_tensor(v) else torch.tensor(float(v)))
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def engine_run(run: dict, rank: int) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = TinyLM()
    opt = _optimizer(model)
    stage = run["stage"]
    config = ZeroConfig(
        stage=stage,
        offload_optimizer=run.get("offload", False),
        wrap_policy=Block if stage == 3 else None,
        reduce_bucket_size=3000,
        offload_chunk_size=1000,
        nonfinite=run["mode"],
    )
    engine = ZeroEngine(model, opt, config, compute_dtype=torch.bfloat16 if run.get("bf16") else None)
    if engine.offload is not None and run.get("clip"):
        engine.offload.global_scale_expected = True
    record = {"raised": None, "unchanged": None, "warned": [], "first_name": engine.flat_params[0].names[0]}
    bad = float(run.get("bad", "nan"))
    for i, (x, y) in enumerate(batches(rank)):
        before = _snapshot(engine) if i == BAD_STEP else None
        engine.begin_step()
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))
        if i == BAD_STEP and rank == 1:
            loss = loss * bad
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss.backward()
                engine.finish_backward()
                if run.get("clip"):
                    engine.clip_grad_norm_(run["clip"])
                engine.optimizer.step()
                engine.after_step()
            record["warned"] += [str(w.message) for w in caught if "NaN" in str(w.message)]
        except NonFiniteGradientError as e:
            record["raised"] = f"{i}: {e}"
            record["unchanged"] = _same(before, _snapshot(engine))
            break
        if i == BAD_STEP:
            record["unchanged"] = _same(before, _snapshot(engine))
    record["skipped_steps"] = engine.skipped_steps
    record["finite"] = all(bool(torch.isfinite(fp.master).all()) for fp in engine.flat_params)
    state = engine.full_state_dict()
    engine.remove_hooks()
    return state, record


class NanAt(TinyLM):
    """Rank 1's loss is NaN at batch ``BAD_STEP``."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == BAD_STEP and self.global_rank == 1:
            loss = loss * float("nan")
        return loss


def trainer_run(run: dict, rank: int) -> dict:
    import lightning as L

    L.seed_everything(7, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=zeroshard.ZeroStrategy(stage=run["stage"], nonfinite=run["mode"], reduce_bucket_size=3000),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = NanAt()
    record = {"raised": None}
    try:
        trainer.fit(model, torch.utils.data.DataLoader(token_dataset(n=64), batch_size=4))
    except NonFiniteGradientError as e:
        record["raised"] = str(e)
    record["global_step"] = trainer.global_step
    record["losses"] = len(model.losses)
    record["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return record


def main() -> None:
    out = Path(sys.argv[1])
    runs = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for run in runs:
        record, state = {}, None
        if run["strategy"] == "ddp":
            state = ddp_run(run, rank)
        elif run["strategy"] == "zeroshard":
            state, record = engine_run(run, rank)
        else:
            record = trainer_run(run, rank)
        if rank == 0 and state is not None:
            torch.save(state, out / f"{run['name']}.pt")
        (out / f"{run['name']}_rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Rank worker for sharded checkpoints of bf16 / int8 optimizer state (``optimizer_state_dtype``).

Usage (FMTS: formats separated by commas, each run in turn with OUT/FMT as its OUT):
    state_format_ckpt.py save OUT FMTS         2 ranks, stage 2: train 3 steps, save OUT/ckpt; write each rank's shard
                                               state (OUT/state_r{rank}.pt), the consolidated optimizer state
                                               (OUT/consolidated.pt, rank 0), then train 2 more steps and write the
                                               parameters (OUT/continued.pt)
    state_format_ckpt.py load OUT FMTS STAGE   any world size: a fresh engine loads OUT/ckpt. Same world size and
                                               stage: each rank's state must equal what it saved bit for bit, and 2
                                               more steps must give OUT/continued.pt bit for bit (OUT/resumed.pt).
                                               Otherwise (a reshard): each rank's moments must equal the saved exact
                                               values (consolidated.pt) laid out on its new shard and converted by
                                               the kernel's rule (int8: requantised over the new blocks), bit for bit.
                                               Rank 0 writes OUT/loaded_{world}_{stage}.json with what it checked.

FMT: ``bf16`` (CPUAdam without offload), ``int8`` (AdamW converted under offload_optimizer=True), ``bf16_dev`` /
``int8_dev`` (DeviceAdam, the torch-ops step, without offload), ``int8_cpu`` (CPUAdam without offload). Under int8
the flat parameters of TinyLM's parameters under 4096 elements keep fp32 moments (``min_8bit_size``), so the state is
mixed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_lm import SEQ, VOCAB, Block, TinyLM

import zeroshard
from zeroshard import CPUAdam
from zeroshard.checkpoint.sharded_checkpoint import load_sharded, save_sharded
from zeroshard.optim.device_adam import DeviceAdam
from zeroshard.optim.state_format import convert_moments

FORMATS = {"bf16": torch.bfloat16, "int8": "int8", "bf16_dev": torch.bfloat16, "int8_dev": "int8", "int8_cpu": "int8"}
MIN_8BIT_SIZE = 4096  # bitsandbytes' default, CPUAdam's


def flat_format(fp, fmt: str):
    """The format ``fp``'s moments are kept in, from its parameters' sizes (not asked of the engine)."""
    if FORMATS[fmt] == "int8" and all(math.prod(s) < MIN_8BIT_SIZE for s in fp.shapes):
        return torch.float32
    return FORMATS[fmt]


def make_engine(fmt: str, stage: int, seed: int) -> zeroshard.ZeroEngine:
    torch.manual_seed(seed)
    model = TinyLM()
    params = [p for p in model.parameters() if p.requires_grad]
    offload = fmt == "int8"
    cls = DeviceAdam if fmt.endswith("_dev") else CPUAdam
    opt = torch.optim.AdamW(params, lr=1e-2) if offload else cls(params, lr=1e-2)
    config = zeroshard.ZeroConfig(
        stage=stage,
        offload_optimizer=offload,
        optimizer_state_dtype=FORMATS[fmt],
        reduce_bucket_size=5000,
        wrap_policy=Block if stage == 3 else None,
    )
    return zeroshard.ZeroEngine(model, opt, config)


def train(engine, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(100 * s + dist.get_rank())
        batch = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
        engine.begin_step()
        logits = engine.module(batch[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
        engine.finish_backward()
        engine.optimizer.step()
        engine.after_step()


def shard_states(engine) -> list[dict]:
    """Each trainable flat parameter's optimizer state on this rank (tensors cloned)."""
    return [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in engine.optim.optimizer_of(fp).state[fp.master].items()}
        for fp in engine.flat_params
    ]


def save(out: Path, fmt: str) -> None:
    engine = make_engine(fmt, 2, seed=0)
    train(engine, range(3))
    save_sharded(engine, out / "ckpt")
    torch.save(shard_states(engine), out / f"state_r{dist.get_rank()}.pt")
    consolidated = engine.optimizer_state_dict()
    if dist.get_rank() == 0:
        torch.save(consolidated, out / "consolidated.pt")
    train(engine, range(3, 5))
    params = engine.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(params, out / "continued.pt")


def expected_moments(engine, fp, consolidated: dict, fmt) -> dict[str, torch.Tensor]:
    """The saved exact moment values on this rank's new shard of ``fp`` (zeros in padding), in ``fmt``."""
    index_of = {id(p): i for i, p in enumerate(p for g in engine.original_groups for p in g)}
    values = {}
    for key in ("exp_avg", "exp_avg_sq"):
        t = torch.zeros(fp.layout.shard_numel, dtype=torch.float32)
        for pi, p_off, s_off, n in fp.layout.shard_slices(fp.rank):
            saved = consolidated["state"][index_of[id(fp.params[pi])]][key]
            t[s_off : s_off + n] = saved.reshape(-1)[p_off : p_off + n].float()
        values[key] = t
    return convert_moments(values, fmt, torch.Size([-1]))


def load(out: Path, fmt: str, stage: int) -> None:
    engine = make_engine(fmt, stage, seed=123)  # other initial values: everything must come from the checkpoint
    load_sharded(engine, out / "ckpt")
    world, rank = dist.get_world_size(), dist.get_rank()
    report = {"same_shards": world == 2 and stage == 2, "checked": 0}
    got = shard_states(engine)
    if report["same_shards"]:
        ref = torch.load(out / f"state_r{rank}.pt")
        assert len(got) == len(ref)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a.keys() == b.keys(), (i, a.keys(), b.keys())
            for k in b:
                if torch.is_tensor(b[k]):
                    assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"flat {i} {k}"
                    report["checked"] += 1
        train(engine, range(3, 5))
        params = engine.full_state_dict()
        if rank == 0:
            torch.save(params, out / "resumed.pt")
    else:
        consolidated = torch.load(out / "consolidated.pt")
        for i, fp in enumerate(engine.flat_params):
            want = expected_moments(engine, fp, consolidated, flat_format(fp, fmt))
            for k, t in want.items():
                assert got[i][k].dtype == t.dtype and torch.equal(got[i][k], t), f"rank {rank} flat {i} {k}"
                report["checked"] += 1
        train(engine, range(3, 4))  # the resharded state steps
    done = [None] * world
    dist.all_gather_object(done, report["checked"])
    if rank == 0:
        (out / f"loaded_{world}_{stage}.json").write_text(json.dumps({**report, "checked": sum(done)}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out, fmts = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    dist.init_process_group("gloo")
    for fmt in fmts:
        if mode == "save":
            if dist.get_rank() == 0:
                (out / fmt).mkdir(exist_ok=True)
            dist.barrier()
            save(out / fmt, fmt)
        else:
            load(out / fmt, fmt, int(sys.argv[4]))
    dist.barrier()
    dist.destroy_process_group()

"""Rank worker for checkpoint fault tests (tests/python/test_faults_checkpoint.py).

Usage:
    ckpt_faults.py killsave OUT SPEC [link]   save checkpoint A to OUT/ck (with ``link``: to OUT/real, OUT/ck a symbolic
                                             link to it), take a step, then save B to OUT/ck with
                                             ZEROSHARD_TEST_KILL_AT=SPEC; A.pt / B.pt hold the reference states
    ckpt_faults.py load OUT [OUT ...]        for each OUT in turn (one process group for all: a launch costs more
                                             than a load), print ``CASE <OUT>``, then load OUT/ck into a fresh engine:
                                             print ``LOADED <tag>`` after checking the parameters and optimizer state
                                             equal <tag>.pt exactly (else ``NOT EQUAL <tag>: <difference>``); then
                                             save C over it and print ``AFTER <entries of OUT/ck>``
    ckpt_faults.py mismatch DIR              load DIR (a tampered checkpoint): print ``ERROR <message>`` and
                                             ``UNCHANGED`` if the engine's state is as before
    ckpt_faults.py fit_save OUT              Trainer: fit 4 steps, save OUT/ck (A); resume it, fit to 8 steps and
                                             save over it with a kill after the rank files (B never commits)
    ckpt_faults.py fit_resume OUT            Trainer: fit(ckpt_path=OUT/evil) and fit(ckpt_path=OUT/ck) by default
                                             (both refused: ``REFUSED <message>``), then with weights_only=False
                                             (``RESUMED_AT <global step>``, ``HPARAMS <saved cfg>``)
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from tiny_lm import TinyLM, token_dataset

import zeroshard
from zeroshard.checkpoint.checkpoint_dir import KILL_ENV
from zeroshard.checkpoint.sharded_checkpoint import load_sharded, save_sharded
from zeroshard.checkpoint.trainer_state import UnsafeCheckpointError


def make_engine(seed: int) -> zeroshard.ZeroEngine:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(seed)
    model = TinyLM()
    return zeroshard.ZeroEngine(model, model.configure_optimizers(), zeroshard.ZeroConfig(stage=2))


def train_step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randint(0, 64, (4, 16), generator=g)
    engine.begin_step()
    loss = torch.nn.functional.cross_entropy(engine.module(x).flatten(0, 1), x.flatten())
    loss.backward()
    engine.finish_backward()
    engine.optimizer.step()
    engine.after_step()


def snapshot(engine) -> dict:
    return {"params": engine.full_state_dict(), "optim": engine.optimizer_state_dict()}


def assert_equal(got, ref, where: str) -> None:
    if isinstance(ref, dict):
        assert got.keys() == ref.keys(), (where, got.keys(), ref.keys())
        for k in ref:
            assert_equal(got[k], ref[k], f"{where}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), where
        for i, (a, b) in enumerate(zip(got, ref)):
            assert_equal(a, b, f"{where}[{i}]")
    elif torch.is_tensor(ref):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=where)
    else:
        assert got == ref, (where, got, ref)


def killsave(out: Path, spec: str, link: bool) -> None:
    engine = make_engine(0)
    train_step(engine, 1)
    ck = out / "ck"
    save_sharded(engine, out / "real" if link else ck, {"tag": "A"})
    if link and dist.get_rank() == 0:
        ck.symlink_to(out / "real", target_is_directory=True)
    a = snapshot(engine)
    train_step(engine, 2)
    b = snapshot(engine)
    if dist.get_rank() == 0:
        torch.save(a, out / "A.pt")
        torch.save(b, out / "B.pt")
    dist.barrier()
    os.environ[KILL_ENV] = spec
    save_sharded(engine, ck, {"tag": "B"})
    del os.environ[KILL_ENV]


def load(out: Path) -> None:
    engine = make_engine(123)  # another init: everything must come from the checkpoint
    if dist.get_rank() == 0:
        print(f"CASE {out}", flush=True)
    state = load_sharded(engine, out / "ck")
    got = snapshot(engine)
    if dist.get_rank() == 0:
        try:  # a difference fails this case only: rank 0 goes on to the collectives rank 1 is in
            assert_equal(got, torch.load(out / f"{state['tag']}.pt"), state["tag"])
            print(f"LOADED {state['tag']}", flush=True)
        except AssertionError as e:
            print(f"NOT EQUAL {state['tag']}: {e}", flush=True)
    save_sharded(engine, out / "ck", {"tag": "C"})  # a later save works over whatever the crash left
    if dist.get_rank() == 0:
        print(f"AFTER {sorted(p.name for p in (out / 'ck').iterdir())}", flush=True)
        print(f"AFTER_PARENT {sorted(p.name for p in out.iterdir())}", flush=True)
    assert load_sharded(make_engine(5), out / "ck")["tag"] == "C"


def mismatch(path: Path) -> None:
    engine = make_engine(0)
    before = snapshot(engine)
    try:
        load_sharded(engine, path)
    except ValueError as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
    if dist.get_rank() == 0:
        assert_equal(snapshot(engine), before, "engine")
        print("UNCHANGED", flush=True)
    else:
        snapshot(engine)


@dataclasses.dataclass
class Cfg:
    width: int = 32
    note: str = "a dataclass in hyper_parameters"


class HPModel(TinyLM):
    def __init__(self, cfg: Cfg | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.loaded_cfg = None

    def on_load_checkpoint(self, checkpoint) -> None:
        self.loaded_cfg = checkpoint["hyper_parameters"]["cfg"]


class StepAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def trainer(max_steps: int, step_at: StepAtStart | None = None) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=zeroshard.ZeroStrategy(stage=2, state_dict_type="sharded"),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[step_at] if step_at else [],
    )


def loader():
    return torch.utils.data.DataLoader(token_dataset(n=64), batch_size=4)


def fit_save(out: Path) -> None:
    L.seed_everything(3, verbose=False)
    t = trainer(4)
    t.fit(HPModel(Cfg(width=7)), loader())
    t.save_checkpoint(out / "ck")
    t = trainer(8)
    t.fit(HPModel(), loader(), ckpt_path=out / "ck", weights_only=False)
    os.environ[KILL_ENV] = "after_rank_files:0"
    t.save_checkpoint(out / "ck")


def fit_resume(out: Path) -> None:
    for name in ("evil", "ck"):
        try:
            trainer(10).fit(HPModel(), loader(), ckpt_path=out / name)
            print(f"LOADED {name} without weights_only=False", flush=True)
        except UnsafeCheckpointError as e:
            print(f"REFUSED {name}: {e}", flush=True)
    step_at = StepAtStart()
    model = HPModel()
    trainer(6, step_at).fit(model, loader(), ckpt_path=out / "ck", weights_only=False)
    print(f"RESUMED_AT {step_at.step}", flush=True)
    print(f"HPARAMS {model.loaded_cfg!r}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, target = sys.argv[1], Path(sys.argv[2])
    if mode == "killsave":
        killsave(target, sys.argv[3], len(sys.argv) > 4)
    elif mode == "load":
        for out in sys.argv[2:]:
            load(Path(out))
    else:
        {"mismatch": mismatch, "fit_save": fit_save, "fit_resume": fit_resume}[mode](target)
    if dist.is_initialized():  # torch asks for it; a gloo group alive at exit can abort it (pytorch/pytorch#190489)
        dist.destroy_process_group()

"""Rank worker for tests/python/test_faults_collectives.py: a frozen rank, diverged ranks, NumPy views of gathered
parameters. Every run uses a 10 s process-group timeout.

Usage: faults_collectives.py MODE STAGE OUT_DIR

- ``stop``: at step 2 rank 1 freezes itself with SIGSTOP (before its forward). Rank 0 must end with an error naming the
  collective, the bucket or unit, the step and the rank, then kills rank 1 (whose pid it reads from OUT_DIR).
- ``swap``: at step 3 rank 1 runs the two (same-size) blocks in the opposite order.
- ``skip``: at step 3 rank 1 skips the second block; ``skip_first``: the first one; ``skip_all``: both.
- ``read_one``: after fit (stage 3) only rank 0 reads a parameter (rank 1 waits, then exits): rank 0's gather must
  time out naming the read and the parameter.
- ``grad_one``: at step 2 only rank 0 reads a ``.grad`` in ``on_before_optimizer_step`` (rank 1 waits there): rank
  0's gradient all-gather must time out naming the read and the parameter.

  In both, rank 1 waits until rank 0 has ended (its ``rank0_done`` file), at most 30 s: far past the 10 s timeout,
  but the run ends as soon as rank 0 has its error instead of after a fixed sleep.
- ``numpy``: trains 2 steps, takes ``.numpy()`` views of parameters inside ``gathered_parameters()``, leaves the block,
  trains 2 more steps; writes ``numpy_rank{r}.json`` with what it saw.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from tiny_lm import Block, TinyLM, token_dataset

import zeroshard

MODE, STAGE, OUT = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
RANK0_DONE = OUT / "rank0_done"


def wait_for_rank0(limit: float = 30.0) -> None:
    """Rank 1 stays out of the collective until rank 0 has ended (or ``limit`` seconds passed)."""
    deadline = time.monotonic() + limit
    while not RANK0_DONE.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


class Faulty(TinyLM):
    def forward(self, idx):
        x = self.embed(idx) * (1 + self.frozen_scale)
        odd = self.global_rank == 1 and self.global_step == 3 and self.training
        if MODE == "swap" and odd:
            x = self.blocks[0](self.blocks[1](x))
        elif MODE == "skip" and odd:
            x = self.blocks[0](x)
        elif MODE == "skip_first" and odd:
            x = self.blocks[1](x)
        elif MODE == "skip_all" and odd:
            pass
        else:
            x = self.blocks[1](self.blocks[0](x))
        return self.head(self.norm(x))

    def on_before_optimizer_step(self, optimizer):
        if MODE == "grad_one" and self.global_step == 2:
            if self.global_rank == 0:
                print(float(self.blocks[0].up.weight.grad.sum()), flush=True)  # rank 0 alone: a collective read
            else:
                wait_for_rank0()

    def on_train_batch_start(self, batch, batch_idx):
        if MODE == "stop" and self.global_rank == 1 and self.global_step == 2:
            print("rank 1: stopping itself (SIGSTOP)", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


def trainer(max_steps: int) -> L.Trainer:
    strategy = zeroshard.ZeroStrategy(
        stage=STAGE, wrap_policy=Block if STAGE == 3 else None, timeout=timedelta(seconds=10)
    )
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def numpy_views(model: Faulty, rank: int) -> None:
    trainer(2).fit(model, torch.utils.data.DataLoader(token_dataset(), batch_size=4))
    x = token_dataset(8)[:][0]
    with torch.no_grad(), zeroshard.gathered_parameters(model):
        array = model.blocks[0].up.weight.detach().numpy()  # NumPy views of the gathered buffers
        data_view = model.blocks[1].down.weight.data.numpy()
        expected, expected_down = array.copy(), data_view.copy()
        inside = model(x)
    # leaving the block went through; the arrays keep the values of the moment
    same_after_exit = bool((array == expected).all()) and bool((data_view == expected_down).all())
    with torch.no_grad():
        outside = model(x)  # gathers unit by unit again, into fresh buffers
        with zeroshard.gathered_parameters(model):
            regathered = torch.equal(model.blocks[0].up.weight.detach(), torch.from_numpy(expected))
    array[:] = 0  # writing the old view touches nothing of the model any more
    with torch.no_grad():
        after_write = model(x)
    (OUT / f"numpy_rank{rank}.json").write_text(
        json.dumps(
            {
                "same_after_exit": same_after_exit,
                "regathered_equal": bool(regathered),
                "forward_equal": bool(torch.equal(inside, outside)),
                "forward_after_write_equal": bool(torch.equal(inside, after_write)),
            }
        )
    )


def main() -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    rank = int(os.environ["RANK"])
    (OUT / f"pid{rank}").write_text(str(os.getpid()))
    model = Faulty()
    if MODE == "numpy":
        numpy_views(model, rank)
        return
    try:
        trainer(6).fit(model, torch.utils.data.DataLoader(token_dataset(), batch_size=4))
        if MODE == "read_one":
            if rank == 0:
                print(float(model.blocks[0].up.weight.detach().sum()), flush=True)  # rank 0 alone: gathers the unit
            else:
                wait_for_rank0()
    except BaseException:
        if MODE == "stop" and rank == 0:  # the stopped rank never ends by itself
            os.kill(int((OUT / "pid1").read_text()), signal.SIGKILL)
        raise
    finally:
        if rank == 0:
            RANK0_DONE.touch()


if __name__ == "__main__":
    main()

"""Shared by the two-rank GPT step benchmarks (bench_module_grads, bench_nonfinite, bench_gather_check): one ZeRO
engine over the examples' GPT, stepped on a fixed batch and timed per step (wall and CPU time of this rank)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gpt import GPT, GPTConfig
from zeroshard import ZeroEngine


class GptStepRun:
    """``make_engine(model, optimizer)`` builds the engine under test (seeded identically for every run, so runs
    compared side by side train the same model on the same batch)."""

    def __init__(self, name: str, args: argparse.Namespace, make_engine: Callable[..., ZeroEngine]) -> None:
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
        self.model = GPT(cfg)
        self.engine = make_engine(self.model, torch.optim.AdamW(self.model.parameters(), lr=1e-4))
        self.name = name
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        self.x = torch.randint(0, cfg.vocab_size, (args.batch, args.block_size), generator=g)
        self.step_s: list[float] = []  # wall clock, this rank
        self.cpu_s: list[float] = []  # CPU time of this process (all its threads, gloo's included)

    def step(self, record: bool, after_backward: Callable[[], None] | None = None) -> float:
        """One training step (``record``: keep its times); ``after_backward`` runs between backward and the optimizer
        step, and its seconds are returned (0.0 without it)."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        self.engine.begin_step()
        logits = self.model(self.x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), self.x[:, 1:].reshape(-1))
        loss.backward()
        self.engine.finish_backward()
        extra_s = 0.0
        if after_backward is not None:
            r0 = time.perf_counter()
            after_backward()
            extra_s = time.perf_counter() - r0
        self.engine.optimizer.step()
        self.engine.after_step()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if record:
            self.step_s.append(dt)
            self.cpu_s.append(cpu)
        return extra_s

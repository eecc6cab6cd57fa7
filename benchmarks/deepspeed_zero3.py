"""DeepSpeed's ZeRO-3 with CPU offload, the seed's system, built as its users build it, for the offload benchmarks.

``bench_offload.py`` and ``max_model_size.py`` time it beside zeroshard on the same GPT, seed, data and precision:
``deepspeed.initialize`` with a config dict (bf16, ZeRO stage 3, ``offload_optimizer`` to the CPU, optionally
``offload_param`` too, DeepSpeed's ``AdamW`` type, which becomes ``DeepSpeedCPUAdam`` when the optimizer is offloaded),
and everything else at DeepSpeed's defaults (bucket sizes, prefetch, persistence threshold). Gradients are reduced in
``--reduce_dtype`` (``communication_data_type``), as zeroshard's are. DeepSpeed is never a dependency of zeroshard: it
lives in the benchmark's own venv (``benchmarks/README.md``) and builds its CPU Adam op at first use
(``DS_BUILD_OPS=0``). On a machine without a GPU it runs on DeepSpeed's CPU accelerator over gloo (``--smoke``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def unavailable() -> str | None:
    """Why the DeepSpeed rows cannot run here (``None`` when ``deepspeed`` is importable)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not importable: run in the benchmark venv (benchmarks/README.md, DeepSpeed 0.19.8)"
    return None


def config(args: argparse.Namespace, *, offload_params: bool, pin: bool) -> dict:
    """The ``deepspeed.initialize`` config: bf16, ZeRO-3, optimizer (and parameter) offload to pinned host memory."""
    zero: dict = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "communication_data_type": "bf16" if args.reduce_dtype == "bf16" else "fp32",
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8},
        },  # fmt: skip
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def setup(
    args: argparse.Namespace,
    device: torch.device,
    *,
    offload_params: bool,
    build_model: Callable[[], torch.nn.Module],
    loss_of: Callable,
    meta: bool = False,
) -> tuple[int, object, Callable, Callable]:
    """``(params, engine, forward_backward, optimizer_step)`` for DeepSpeed ZeRO-3 + offload, as
    ``bench_offload.setup_zeroshard`` returns them.

    Args:
        build_model: builds the seeded fp32 GPT (on ``device`` unless ``meta``).
        meta: build the model inside ``deepspeed.zero.Init`` (each parameter partitioned, and with parameter offload
            put on the host, as it is created: DeepSpeed's way to build a model larger than the GPU; the analogue of
            zeroshard's ``init_meta_context``).
    """
    import deepspeed
    import torch.distributed as dist

    # DeepSpeed reads its rank from the launcher's variables; the benchmarks' one-rank group is already initialised.
    for var, value in (("LOCAL_RANK", 0), ("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size())):
        os.environ.setdefault(var, str(value))
    cfg = config(args, offload_params=offload_params, pin=device.type == "cuda")
    if meta:
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="cpu" if offload_params else None,
                                 pin_memory=device.type == "cuda"):  # fmt: skip
            model = build_model()
        num_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    else:
        model = build_model()
        num_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def forward_backward(x, y):
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        return loss

    def optimizer_step():
        engine.step()  # also zeroes the gradients

    return num_params, engine, forward_backward, optimizer_step

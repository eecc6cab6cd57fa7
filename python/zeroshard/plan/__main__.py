"""python -m zeroshard.plan: will it fit, and how fast? Every configuration of a model on a cluster, before the run.

Examples::

    python -m zeroshard.plan --gpt 24,2048,16 --gpus 8 --preset h100 --batch 4 --seq-len 1024
    python -m zeroshard.plan --hf-config path/to/config.json --gpus 8 --nodes 4 --gpu-mem 80 --host-mem 1800
    python -m zeroshard.plan --model mypkg.models:build --wrap Block --gpus 8 --json plan.json

Memory sizes are GiB, rates GB/s (10^9 bytes/s) and TFLOP/s. Everything not given comes from ``--preset`` (whose
sources and assumptions ``--show-assumptions`` prints).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from zeroshard.plan.cluster import GB, GIB, PRESETS
from zeroshard.plan.memory import Training
from zeroshard.plan.model_spec import callable_spec, gpt_spec, hf_config_spec
from zeroshard.plan.planner import DEFAULT_MARGIN, choose, format_table, plan, rows_for_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zeroshard.plan", description=__doc__.split("\n")[0])
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--gpt", help="GPT dimensions: N_LAYER,N_EMBD[,N_HEAD[,VOCAB[,BLOCK_SIZE]]] (minGPT layout)")
    m.add_argument("--hf-config", help="a Hugging Face config.json (file or directory)")
    m.add_argument("--model", help="package.module:callable returning an nn.Module or a LightningModule")
    p.add_argument("--wrap", help="with --model: the class name of the stage-3 units (default: detected)")
    p.add_argument("--untied-head", action="store_true", help="with --gpt: a separate LM head (minGPT's original)")
    c = p.add_argument_group("cluster")
    c.add_argument("--preset", choices=sorted(PRESETS), default="h100")
    c.add_argument("--gpus", type=int, help="GPUs per node")
    c.add_argument("--nodes", type=int)
    c.add_argument("--gpu-mem", type=float, help="GiB per GPU")
    c.add_argument("--host-mem", type=float, help="GiB per node")
    c.add_argument("--tflops", type=float, help="achieved TFLOP/s per GPU")
    c.add_argument("--intra-busbw", type=float, help="GB/s, nccl-tests bus bandwidth inside a node")
    c.add_argument("--inter-busbw", type=float, help="GB/s, across nodes")
    c.add_argument("--pcie", type=float, help="GB/s host-device")
    c.add_argument("--cpu-adam", type=float, help="GB/s of fused CPU Adam per host (benchmarks/bench_cpu_adam.py)")
    t = p.add_argument_group("training")
    t.add_argument("--batch", type=int, default=1, help="micro-batch per GPU")
    t.add_argument("--seq-len", type=int, help="default: the model's context length")
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--precision", choices=sorted(DTYPES), default="bf16", help="compute dtype")
    t.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32")
    t.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32", help="Adam moments' format")
    t.add_argument("--activation-checkpointing", action="store_true")
    o = p.add_argument_group("output")
    o.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="fraction of memory kept free")
    o.add_argument("--stages", default="1,2,3")
    o.add_argument("--no-hybrid", action="store_true", help="only shard over every rank")
    o.add_argument("--ddp", action="store_true", help="add torch DDP (autocast, fp32 parameters) for reference")
    o.add_argument("--json", help="write every row here")
    o.add_argument("--show-assumptions", action="store_true")
    return p.parse_args(argv)


def build_spec(args: argparse.Namespace):
    if args.gpt:
        dims = [int(x) for x in args.gpt.split(",")]
        if len(dims) < 2:
            raise SystemExit(f"--gpt {args.gpt!r}: give at least N_LAYER,N_EMBD")
        n_layer, n_embd, *rest = dims
        names = ("n_head", "vocab_size", "block_size")
        return gpt_spec(n_layer, n_embd, **dict(zip(names, rest)), tied_head=not args.untied_head)
    if args.hf_config:
        return hf_config_spec(args.hf_config, seq_len=args.seq_len)
    wrap = None
    if args.wrap:
        wrap = lambda name, m: type(m).__name__ == args.wrap  # noqa: E731
    return callable_spec(args.model, wrap)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cluster = PRESETS[args.preset].with_(
        gpus_per_node=args.gpus,
        nodes=args.nodes,
        gpu_mem=args.gpu_mem * GIB if args.gpu_mem else None,
        host_mem=args.host_mem * GIB if args.host_mem else None,
        flops=args.tflops * 1e12 if args.tflops else None,
        intra_busbw=args.intra_busbw * GB if args.intra_busbw else None,
        inter_busbw=args.inter_busbw * GB if args.inter_busbw else None,
        pcie_bw=args.pcie * GB if args.pcie else None,
        cpu_adam_bw=args.cpu_adam * GB if args.cpu_adam else None,
    )
    spec = build_spec(args)
    train = Training(
        micro_batch=args.batch,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        compute_dtype=DTYPES[args.precision],
        reduce_dtype=DTYPES[args.reduce_dtype],
        activation_checkpointing=args.activation_checkpointing,
        optimizer_state_dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "int8": "int8"}[args.state_dtype],
    )
    stages = tuple(int(s) for s in args.stages.split(","))
    rows = plan(spec, train, cluster, args.margin, stages, hybrid=not args.no_hybrid, ddp=args.ddp)
    print(
        f"{spec.name}: {spec.num_params / 1e9:.3f}B parameters ({spec.trainable:,} trainable), "
        f"{len(spec.units) - 1} units; {cluster.nodes} x {cluster.gpus_per_node} {args.preset} "
        f"({cluster.gpu_mem / GIB:.1f} GiB per GPU, {cluster.host_mem / GIB:.0f} GiB per node); micro-batch "
        f"{train.micro_batch} x {train.seq_len or spec.seq_len} tokens, {args.precision}, margin {args.margin:.0%}"
    )
    print(format_table(rows, cluster))
    best, runners = choose(rows)
    if best is None:
        print("\nnothing fits: more GPUs or nodes, a smaller micro-batch, activation checkpointing, or more memory")
    else:
        print(f"\nfastest that fits: {best['config']} ({best['predicted_step_s']:.3f} s/step)")
        for r in runners:
            print(f"  then: {r['config']} ({r['predicted_step_s']:.3f} s/step)")
    if args.show_assumptions:
        print("\nassumptions:")
        for key, note in cluster.notes.items():
            print(f"  {key}: {note}")
    if args.json:
        out = {
            "model": {"name": spec.name, "params": spec.num_params, "trainable": spec.trainable},
            "cluster": {k: v for k, v in cluster.__dict__.items()},
            "training": {k: str(v) for k, v in train.__dict__.items()},
            "margin": args.margin,
            "rows": rows_for_json(rows),
        }
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

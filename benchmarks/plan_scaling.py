"""What does the planner predict for large runs, and how does that compare with published figures?

No measurement happens here: every number is ``zeroshard.plan``'s, from the assumptions printed with it (the cluster
presets in ``python/zeroshard/plan/cluster.py``). Three parts:

1. The seed's table (``shared/seeds/002``: minGPT on one server of 8 x A100 with 1 TB of host memory, DeepSpeed through
   Lightning, 2021): the largest model the planner fits for each of its three settings, beside the seed's figure.
   Shapes and batch as the seed's benchmark (SeanNaren/minGPT, branch stage3): character vocabulary (65), block 128,
   untied head, 16 heads, n_embd 3072 (DDP, batch 1) or 8192 (ZeRO-3, batch 4; ZeRO-3 + offload of optimizer and
   parameters + activation checkpointing, batch 4), fp16 compute; A100 40 GB.
2. Step time of the seed's GPT shapes (15 x 3072 = 1.7B, 16 x 8192 = 12.9B, 56 x 8192 = 45.1B; vocabulary 50304,
   sequence 2048, micro-batch 1, bf16) on 8, 64, 256 and 1,024 H100s (8 per node): the fastest configuration that
   fits, and stage 3 over every rank against hybrid sharding (one node per shard group).
3. Published points: the seed's DDP step (1.7B, batch 1 x 128 tokens, 43.69 s per 128 steps) and torchtitan's FSDP2
   Llama 3.1 8B on 8 and 128 H100s (``benchmarks/llama3_h100_202412_torchtitan.md`` in pytorch/torchtitan: local
   batch 2, sequence 8192, selective activation checkpointing, 5,762 and 5,605 tokens/s per GPU, 82.4 and 67.0 GiB).

Usage:
    PYTHONPATH=python python benchmarks/plan_scaling.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import tempfile
from pathlib import Path

import torch

from zeroshard.plan import PRESETS, Layout, Training, choose, evaluate, gpt_spec, hf_config_spec, largest_gpt, plan
from zeroshard.plan.cluster import GIB

REPO = Path(__file__).resolve().parents[1]

SEED = [
    # name, layout, n_embd, micro-batch, activation checkpointing, the seed's largest model (parameters, n_layer)
    ("DDP", Layout("ddp"), 3072, 1, False, 1.7e9, 15),
    ("ZeRO-3", Layout(3), 8192, 4, False, 12.8e9, 16),
    ("ZeRO-3, gradients reduced in fp16", Layout(3), 8192, 4, False, 12.8e9, 16),
    ("ZeRO-3 + CPU offload + act. ckpt", Layout(3, True, True), 8192, 4, True, 45e9, 56),
]
SHAPES = [(15, 3072), (16, 8192), (56, 8192)]
GPUS = [8, 64, 256, 1024]
LLAMA31_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 131072, "hidden_act": "silu", "tie_word_embeddings": False,
              "rope_theta": 500000.0}  # fmt: skip


def seed_table(margin: float) -> list[dict]:
    cluster = PRESETS["a100-40gb"].with_(gpus_per_node=8, nodes=1, host_mem=1024 * GIB)
    rows = []
    for name, layout, n_embd, batch, ckpt, seed_params, seed_layers in SEED:
        reduce = torch.float16 if "fp16" in name else torch.float32  # DeepSpeed reduces in the compute dtype
        train = Training(
            micro_batch=batch, compute_dtype=torch.float16, reduce_dtype=reduce, activation_checkpointing=ckpt
        )
        n_layer, spec = largest_gpt(layout, train, cluster, n_embd, 16, 65, 128, tied_head=False, margin=margin)
        got = spec.num_params if spec else 0
        row = evaluate(spec, train, layout, cluster, margin) if spec else None
        limit = None
        if row:
            dev = row["device_total_bytes"] / cluster.gpu_mem
            host = row["host_bytes_per_node"] / cluster.host_mem
            limit = f"GPU {dev:.0%}, host {host:.0%} of memory"
        rows.append({"setting": name, "seed_params": seed_params, "seed_n_layer": seed_layers, "n_layer": n_layer,
                     "params": got, "ratio": got / seed_params, "at_largest": limit,
                     "device_items_gib": {k: v / GIB for k, v in row["device_bytes"].items()} if row else None,
                     "host_gib_per_node": row["host_bytes_per_node"] / GIB if row else None})  # fmt: skip
    return rows


def scaling_table(margin: float) -> list[dict]:
    """Per shape and cluster size: the fastest fitting configuration with or without activation checkpointing, and
    stage 3 over every rank against hybrid sharding with one node per shard group, at that checkpointing setting."""
    rows = []
    for n_layer, n_embd in SHAPES:
        spec = gpt_spec(n_layer, n_embd, 16, 50304, 2048)
        for gpus in GPUS:
            cluster = PRESETS["h100"].with_(gpus_per_node=8, nodes=gpus // 8)
            candidates = []
            for ckpt in (False, True):
                train = Training(micro_batch=1, activation_checkpointing=ckpt)
                best, _ = choose(plan(spec, train, cluster, margin))
                if best is not None:
                    candidates.append((best["predicted_step_s"], ckpt, best, train))
            _, ckpt, best, train = min(candidates, key=lambda c: c[0]) if candidates else (0, True, None, Training())
            flat3 = evaluate(spec, train, Layout(3), cluster, margin)
            hsdp = evaluate(spec, train, Layout(3, shard_group_size=8), cluster, margin) if gpus > 8 else flat3
            rows.append({
                "model": f"{n_layer} x {n_embd}", "params": spec.num_params, "gpus": gpus, "act_ckpt": ckpt,
                "best": best["config"] if best else None,
                "best_step_s": best["predicted_step_s"] if best else None,
                "best_tokens_per_s_per_gpu": best["tokens_per_s"] / gpus if best else None,
                "best_gpu_gib": best["device_total_bytes"] / GIB if best else None,
                "stage3_step_s": flat3["predicted_step_s"], "stage3_fits": flat3["fits"],
                "stage3_exposed_comm_s": flat3["step"]["exposed_comm_s"],
                "hybrid8_step_s": hsdp["predicted_step_s"], "hybrid8_fits": hsdp["fits"],
                "hybrid8_exposed_comm_s": hsdp["step"]["exposed_comm_s"],
                "compute_s": flat3["step"]["compute_s"],
            })  # fmt: skip
    return rows


def published(margin: float) -> list[dict]:
    out = []
    # the seed's DDP run: 1.7B, batch 1 x 128 tokens per GPU, fp16 autocast, 8 x A100 40 GB
    a100 = PRESETS["a100-40gb"].with_(gpus_per_node=8, nodes=1, host_mem=1024 * GIB)
    spec = gpt_spec(15, 3072, 16, 65, 128, tied_head=False)
    row = evaluate(spec, Training(micro_batch=1, compute_dtype=torch.float16), Layout("ddp"), a100, margin)
    out.append({"point": "seed DDP 1.7B, 8 x A100", "published_step_s": 43.69 / 128,
                "predicted_step_s": row["predicted_step_s"], "published_peak_gib": 36148.55 / 1024,
                "predicted_peak_gib": row["device_total_bytes"] / GIB})  # fmt: skip
    # torchtitan FSDP2 Llama 3.1 8B: stage 3 over every rank is FSDP2's layout
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA31_8B))
        llama = hf_config_spec(tmp, seq_len=8192)
    for gpus, tps, gib in ((8, 5762, 82.4), (128, 5605, 67.0)):
        cluster = PRESETS["h100"].with_(gpus_per_node=8, nodes=gpus // 8, gpu_mem=94.5 * GIB)
        for ckpt in (False, True):
            r = evaluate(llama, Training(micro_batch=2, activation_checkpointing=ckpt), Layout(3), cluster, margin)
            name = f"torchtitan Llama 3.1 8B FSDP, {gpus} x H100, act. ckpt {'full' if ckpt else 'none'}"
            out.append({"point": name, "published_tokens_per_s_per_gpu": tps,
                        "predicted_tokens_per_s_per_gpu": r["tokens_per_s"] / gpus,
                        "published_peak_gib": gib, "predicted_peak_gib": r["device_total_bytes"] / GIB,
                        "params": llama.num_params})  # fmt: skip
    return out


def recorded_h100(margin: float) -> list[dict]:
    """Runs an earlier session measured on one H100 (benchmarks/results/offload_h100.json, max_model_size_h100.json):
    GPU peak is max_memory_allocated (no CUDA context), host peak the process's maximum RSS. Its CPU Adam rate is
    the h100 preset's, so the optimizer part of these step times is not an independent check."""
    cluster = PRESETS["h100"].with_(gpus_per_node=1, nodes=1, host_mem=125.9 * GIB)
    points = [
        ("1.3B GPT, stage 3 + optimizer offload", gpt_spec(24, 2048, 16, 50304, 1024), 4, torch.float32,
         Layout(3, True), 0.512, 11.05, 21.2),
        ("1.3B GPT, stage 3 + optimizer and parameter offload", gpt_spec(24, 2048, 16, 50304, 1024), 4,
         torch.float32, Layout(3, True, True), 0.556, 8.60, 23.6),
        ("7.67B GPT, stage 3 + optimizer and parameter offload", gpt_spec(9, 8192, 16, 50304, 512), 1,
         torch.bfloat16, Layout(3, True, True), 2.61, 28.0, 115.7),
    ]  # fmt: skip
    out = []
    for name, spec, batch, reduce, layout, step_s, gpu_gib, host_gib in points:
        r = evaluate(spec, Training(micro_batch=batch, reduce_dtype=reduce), layout, cluster, margin)
        gpu = (r["device_total_bytes"] - r["device_bytes"]["cuda_context"]) / GIB
        out.append({"point": name, "measured_step_s": step_s, "predicted_step_s": r["predicted_step_s"],
                    "measured_gpu_gib": gpu_gib, "predicted_gpu_gib": gpu, "measured_host_gib": host_gib,
                    "predicted_host_gib": r["host_bytes_per_node"] / GIB})  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--margin", type=float, default=0.10)
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "plan_scaling.json"))
    args = p.parse_args()

    seed = seed_table(args.margin)
    print(f"1. Largest model per setting, 8 x A100 40 GB + 1 TiB host, margin {args.margin:.0%}")
    print("| setting | seed | planner | planner / seed | planner n_layer (seed) | at the largest |")
    print("|---|---|---|---|---|---|")
    for r in seed:
        print(f"| {r['setting']} | {r['seed_params'] / 1e9:.1f}B | {r['params'] / 1e9:.1f}B | {r['ratio']:.2f} | "
              f"{r['n_layer']} ({r['seed_n_layer']}) | {r['at_largest']} |")  # fmt: skip
    scaling = scaling_table(args.margin)
    print("\n2. Step time, seed GPT shapes, seq 2048, micro-batch 1, bf16, H100 x 8 per node")
    print("| model | GPUs | act. ckpt | fastest that fits | s/step | tokens/s/GPU | GPU GiB | stage 3 s/step (exposed "
          "comm) | hybrid 8 s/step (exposed comm) | compute s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in scaling:
        best = "none | | |"
        if r["best"]:
            best = f"{r['best']} | {r['best_step_s']:.3f} | {r['best_tokens_per_s_per_gpu']:,.0f} | "
            best += f"{r['best_gpu_gib']:.1f}"
        flat = f"{r['stage3_step_s']:.3f} ({r['stage3_exposed_comm_s']:.3f}){'' if r['stage3_fits'] else ' no fit'}"
        hsdp = f"{r['hybrid8_step_s']:.3f} ({r['hybrid8_exposed_comm_s']:.3f}){'' if r['hybrid8_fits'] else ' no fit'}"
        ckpt = "yes" if r["act_ckpt"] else "no"
        print(f"| {r['model']} ({r['params'] / 1e9:.1f}B) | {r['gpus']} | {ckpt} | {best} | {flat} | {hsdp} | "
              f"{r['compute_s']:.3f} |")  # fmt: skip
    pub = published(args.margin)
    print("\n3. Published points")
    for r in pub:
        print("  " + ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items()))
    recorded = recorded_h100(args.margin)
    print("\n4. Recorded one-H100 runs (earlier session) against the planner")
    print("| run | s/step measured / predicted | GPU GiB measured / predicted | host GiB measured / predicted |")
    print("|---|---|---|---|")
    for r in recorded:
        print(f"| {r['point']} | {r['measured_step_s']:.3f} / {r['predicted_step_s']:.3f} | "
              f"{r['measured_gpu_gib']:.2f} / {r['predicted_gpu_gib']:.2f} | "
              f"{r['measured_host_gib']:.1f} / {r['predicted_host_gib']:.1f} |")  # fmt: skip
    result = {
        "benchmark": "plan_scaling",
        "note": "planner predictions only (no measurement); assumptions in python/zeroshard/plan/cluster.py",
        "machine": {"hostname": socket.gethostname(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "margin": args.margin,
        "presets": {name: c.notes for name, c in PRESETS.items()},
        "seed": seed,
        "scaling": scaling,
        "published": pub,
        "recorded_h100": recorded,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What is the largest GPT that trains for 3 steps with ZeRO stage 3 + optimizer and parameter offload on one GPU and
its host memory?

Method: the GPT of the examples (``examples/gpt.py``) with n_head 16, n_embd 8192, block 512, vocab 50304, batch 1 and a
growing number of layers. Host bytes per parameter are estimated as fp32 master 4 + Adam ``exp_avg`` 4 +
``exp_avg_sq`` 4 + gradient shard 2 (``reduce_dtype`` bf16) + bf16 parameter shard 2 = 16 (moments in bf16 with
``--optimizer_state_dtype bf16``: 12; block-wise int8: 10), plus ``--overhead_gib``
(CUDA context, torch, the upload buffers of the offload pipeline). The search starts at the largest n_layer whose
estimate fits into 0.9 x ``psutil.virtual_memory().available`` (one layer above it first with ``--try_above``) and
steps down by one layer after every failure, stopping at the first success. Each attempt is a subprocess (the script
re-invokes itself with ``--worker N_LAYER``) that:

* builds the GPT under ``zeroshard.init_meta_context()`` (nothing allocated) and a ``torch.optim.AdamW`` over it;
* makes ``ZeroEngine(ZeroConfig(stage=3, offload_optimizer=True, offload_params=True, wrap_policy=Block,
  reduce_dtype=torch.bfloat16), compute_dtype=torch.bfloat16)``, which materialises the model unit by unit on the GPU
  and keeps only the host shards, so the model is never whole anywhere;
* trains 3 steps on random tokens (fixed seed), bf16 compute, loss ``cross_entropy(logits.float(), y)``;
* reports the parameter count, GPU peak memory (``torch.cuda.max_memory_allocated``), host peak RSS (``ru_maxrss``),
  pinned and unpinned host bytes (``zeroshard._C.host_memory_stats()``), setup seconds, every step's seconds and loss.

``--system deepspeed`` sizes DeepSpeed's ZeRO-3 with ``offload_optimizer`` and ``offload_param`` the same way
(``benchmarks/deepspeed_zero3.py``: the GPT built inside ``deepspeed.zero.Init`` with the parameters on the host), so
the two largest models and their step times come from the same machine; its JSON is ``max_model_size_deepspeed_*``.

An attempt that fails (CUDA OOM, the engine's host-budget error, a crash, or its ``--timeout``) is reported with the
last line of its output and the search goes on downward. ``--n_layers 2,4`` runs a fixed list instead (every entry,
no search). ``--smoke`` runs n_embd 64, n_head 4, n_layer 1 and 2 on the CPU (gloo). The JSON, every attempt
included, is rewritten after each attempt, so a run cut short still leaves what finished.

Usage:
    PYTHONPATH=python:examples python benchmarks/max_model_size.py [--try_above] [--n_layers 4,6] [--timeout 240]
        [--budget 300] [--out benchmarks/results/] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_offload.py: the shared worker and launcher code

import bench_offload as bo  # noqa: E402
import deepspeed_zero3  # noqa: E402

GIB = 2**30
MIB = 2**20
HOST_BYTES_PER_PARAM = 4 + 4 + 4 + 2 + 2  # fp32 master, exp_avg, exp_avg_sq; bf16 gradient shard, bf16 param shard
# by --optimizer_state_dtype: the moments' bytes (int8: 1 + 1, the block absmax scales' 8 per 2048 rounded away)
STATE_BYTES_PER_PARAM = {"fp32": 8, "bf16": 4, "int8": 2}


def host_bytes_per_param(args: argparse.Namespace) -> int:
    """Host bytes per parameter of the estimate: :data:`HOST_BYTES_PER_PARAM` with the moments in their format."""
    return HOST_BYTES_PER_PARAM - 8 + STATE_BYTES_PER_PARAM[args.optimizer_state_dtype]


def count_params(args: argparse.Namespace, n_layer: int) -> int:
    """Parameters of the GPT with ``n_layer`` layers (built on the meta device: nothing allocated)."""
    import torch

    from gpt import GPT

    with torch.device("meta"):
        return GPT(bo.gpt_config(argparse.Namespace(**(vars(args) | {"n_layer": n_layer})))).num_params()


def host_estimate(args: argparse.Namespace, n_layer: int) -> int:
    """Estimated host bytes to train ``n_layer`` layers: :func:`host_bytes_per_param` each, plus the fixed overhead."""
    return host_bytes_per_param(args) * count_params(args, n_layer) + int(args.overhead_gib * GIB)


def candidates(args: argparse.Namespace, host_budget: int) -> tuple[list[int], int]:
    """(n_layer values to try, largest to smallest, and the largest whose estimate fits into ``host_budget``)."""
    fit = 0
    while fit < args.max_layers and host_estimate(args, fit + 1) <= host_budget:
        fit += 1
    top = min(fit + 1, args.max_layers) if args.try_above else fit
    return list(range(top, 0, -1)), fit


# -- worker -----------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """Trains a GPT of ``--worker`` layers for ``--steps`` steps; writes the measurements to ``--worker_out``."""
    import torch

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    device = bo.init_single_process(cuda)
    args.n_layer, args.warmup = int(args.worker), 0
    t = time.perf_counter()
    if args.system == "deepspeed":
        num_params, engine, forward_backward, optimizer_step = deepspeed_zero3.setup(
            args, device, offload_params=True, build_model=lambda: bo.build_gpt(args, device), loss_of=bo.loss_of,
            meta=True,
        )  # fmt: skip
    else:
        state_dtype = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8"}[args.optimizer_state_dtype]
        num_params, engine, forward_backward, optimizer_step = bo.setup_zeroshard(
            args, device, True, meta=True, state_dtype=state_dtype
        )
    setup_s = time.perf_counter() - t
    print(f"  n_layer {args.n_layer}: {num_params:,} params, setup {setup_s:.1f} s; host "
          f"{bo.host_peak_mib() / 1024:.1f} GiB peak so far", flush=True)  # fmt: skip
    out = {"num_params": num_params, "setup_s": setup_s}
    if cuda:
        out["gpu_setup_peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB
    out |= bo.train(args, device, forward_backward, optimizer_step, lambda: None)
    out["gpu_peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB if cuda else None
    out["host_peak_mib"] = bo.host_peak_mib()
    if args.system == "zeroshard":
        out["host_memory_stats"] = bo.pinned_stats()
        out["memory_summary"] = engine.memory_summary()
    Path(args.worker_out).write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


# -- launcher ---------------------------------------------------------------------------------------------------------

WORKER_ARGS = ("n_head", "n_embd", "block_size", "vocab_size", "batch_size", "steps", "lr", "seed", "reduce_dtype",
               "offload_chunk_size", "system", "optimizer_state_dtype")  # fmt: skip


def attempt(n_layer: int, args: argparse.Namespace, tmp: Path, timeout: float) -> dict:
    """One worker; its row (measurements, or the last line of its output as the error)."""
    worker_out = tmp / f"n_layer_{n_layer}.json"
    cmd = [sys.executable, __file__, "--worker", str(n_layer), "--worker_out", str(worker_out)]
    cmd += [f"--{k}={getattr(args, k)}" for k in WORKER_ARGS] + (["--smoke"] if args.smoke else [])
    row = {"n_layer": n_layer, "num_params": count_params(args, n_layer),
           "host_estimate_gib": host_estimate(args, n_layer) / GIB}  # fmt: skip
    code, text, wall = bo.run_worker(cmd, timeout)
    row["wall_s"] = wall
    if code == 0 and worker_out.exists():
        return row | {"ok": True} | json.loads(worker_out.read_text())
    print(f"  n_layer {n_layer}: FAILED ({bo.last_line(text)})", flush=True)
    return row | {"ok": False, "error": bo.last_line(text), "log_tail": text}


def human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def print_table(rows: list[dict]) -> None:
    print("\n| n_layer |  params | est. host GiB | result | setup s | step s           | GPU peak GiB | host peak GiB "
          "| pinned GiB | losses / error")  # fmt: skip
    print("|---------|---------|---------------|--------|---------|------------------|--------------|---------------"
          "|------------|---------------")  # fmt: skip
    for r in rows:
        head = f"| {r['n_layer']:>7} | {human(r['num_params']):>7} | {r['host_estimate_gib']:>13.1f} |"
        if not r["ok"]:
            print(f"{head} failed |         |                  |              |               |            | "
                  f"{r['error'][:150]}")  # fmt: skip
            continue
        steps = ",".join(f"{s:.1f}" for s in r["step_s"])
        pinned = (r.get("host_memory_stats") or {}).get("peak_pinned_bytes")
        print(f"{head} ok     | {r['setup_s']:>7.1f} | {steps:<16} | {bo.gib(r.get('gpu_peak_mib'), MIB):>12} | "
              f"{bo.gib(r['host_peak_mib'], MIB):>13} | {bo.gib(pinned, 1):>10} | "
              f"{', '.join(f'{v:.4f}' for v in r['losses'])}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--system", choices=["zeroshard", "deepspeed"], default="zeroshard",
                   help="whose ZeRO-3 + optimizer and parameter offload to size (deepspeed: "
                   "benchmarks/deepspeed_zero3.py, built inside deepspeed.zero.Init)")  # fmt: skip
    p.add_argument("--n_layers", default="", help="comma list of n_layer to run (all of them, no search)")
    p.add_argument("--try_above", action="store_true", help="start one layer above the host-memory estimate")
    p.add_argument("--max_layers", type=int, default=200, help="upper bound of the search")
    overhead = "host GiB beyond 16 bytes per parameter in the estimate (CUDA context, torch, upload buffers)"
    p.add_argument("--overhead_gib", type=float, default=4.0, help=overhead)
    p.add_argument("--n_head", type=int, default=16)
    p.add_argument("--n_embd", type=int, default=8192)
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--reduce_dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--optimizer_state_dtype", choices=list(STATE_BYTES_PER_PARAM), default="fp32",
                   help="Adam moments' format on the host (ZeroConfig.optimizer_state_dtype)")  # fmt: skip
    p.add_argument("--offload_chunk_size", type=int, default=0, help="elements; 0 = the engine's default")
    p.add_argument("--timeout", type=float, default=240, help="seconds per attempt before its worker is killed")
    p.add_argument("--budget", type=float, default=300,
                   help="seconds for the whole search: no attempt starts with less than 20 s left")  # fmt: skip
    p.add_argument("--out", default=None, help="directory for the JSON (default benchmarks/results/; --smoke: a "
                   "new temporary directory)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="n_embd 64, n_head 4, n_layer 1 and 2 on the CPU (gloo)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one attempt in this process
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke and not args.worker:
        args.n_embd, args.n_head, args.block_size, args.vocab_size = 64, 4, 32, 256
        args.n_layers = args.n_layers or "1,2"
        args.timeout = min(args.timeout, 120)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import psutil

    t_start = time.perf_counter()
    available = psutil.virtual_memory().available
    host_budget = int(0.9 * available)
    fixed = [int(s) for s in args.n_layers.split(",") if s.strip()]
    tries, fit = (fixed, None) if fixed else candidates(args, host_budget)
    print(f"GPT n_embd {args.n_embd}, n_head {args.n_head}, block {args.block_size}, vocab {args.vocab_size}, batch "
          f"{args.batch_size}, {args.steps} steps, {'CPU smoke' if args.smoke else 'CUDA'}; host available "
          f"{available / GIB:.1f} GiB, budget 0.9 x that = {host_budget / GIB:.1f} GiB at {host_bytes_per_param(args)} "
          f"bytes/param ({args.optimizer_state_dtype} moments) + {args.overhead_gib:g} GiB", flush=True)  # fmt: skip
    if fit is not None:
        print(f"largest n_layer by the estimate: {fit} ({human(count_params(args, fit))} params, "
              f"{host_estimate(args, fit) / GIB:.1f} GiB); trying {tries[:6]}{' ...' if len(tries) > 6 else ''}",
              flush=True)  # fmt: skip
    default_out = tempfile.mkdtemp(prefix="max_model_size_smoke_") if args.smoke else bo.REPO / "benchmarks" / "results"
    out_dir = Path(args.out or default_out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.system == "deepspeed" and args.optimizer_state_dtype != "fp32":
        raise SystemExit("error: --optimizer_state_dtype is zeroshard's setting: use it without --system deepspeed")
    if args.system == "deepspeed" and deepspeed_zero3.unavailable():
        raise SystemExit(f"error: --system deepspeed: {deepspeed_zero3.unavailable()}")
    system = "" if args.system == "zeroshard" else f"_{args.system}"
    system += "" if args.optimizer_state_dtype == "fp32" else f"_{args.optimizer_state_dtype}_state"
    path = out_dir / f"max_model_size{system}{'_smoke' if args.smoke else ''}_{socket.gethostname()}.json"
    result = {
        "benchmark": "max_model_size",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
        "machine": bo.machine() | {"host_available_gib": available / GIB, "load_average_start": os.getloadavg()},
        "versions": bo.versions(),
        "host_bytes_per_param_estimate": host_bytes_per_param(args),
        "host_budget_bytes": host_budget,
        "estimate_fit_n_layer": fit,
        "largest_ok": None,
        "attempts": [],
    }
    rows = result["attempts"]
    with tempfile.TemporaryDirectory(prefix="max_model_size_") as tmp:
        for n_layer in tries:
            left = args.budget - (time.perf_counter() - t_start)
            if left < 20:
                print(f"out of --budget ({args.budget:.0f} s): n_layer {n_layer} and below not tried", flush=True)
                result["stopped"] = f"out of --budget at n_layer {n_layer}"
                break
            print(f"[{time.perf_counter() - t_start:5.0f} s] n_layer {n_layer} ({human(count_params(args, n_layer))}"
                  f" params, est. host {host_estimate(args, n_layer) / GIB:.1f} GiB)", flush=True)  # fmt: skip
            rows.append(attempt(n_layer, args, Path(tmp), min(args.timeout, left)))
            if rows[-1]["ok"]:
                best = result["largest_ok"]
                if best is None or n_layer > best["n_layer"]:
                    result["largest_ok"] = {"n_layer": n_layer, "num_params": rows[-1]["num_params"]}
            result["machine"]["load_average_end"] = os.getloadavg()
            path.write_text(json.dumps(result, indent=2) + "\n")  # after every attempt: a timeout still leaves data
            if rows[-1]["ok"] and not fixed:
                break
    print_table(rows)
    best = result["largest_ok"]
    print("\nlargest that trained: " + (f"n_layer {best['n_layer']} ({human(best['num_params'])} params)"
                                          if best else "none"))  # fmt: skip
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
    if fixed:
        return 0 if rows and all(r["ok"] for r in rows) else 1
    return 0 if best is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""DeviceAdam's torch-ops step (``zeroshard.optim.torch_state_step``), eager against ``torch.compile``, by format.

Issue 19 asks for the GPU step without offload "with torch.compile where it measures faster". This measures, on each
device present (the CPU always, CUDA when there is one), the time of one ``adam_step_torch`` over one fp32 parameter
of N elements with fp32 / bf16 / int8 moments, eager and compiled (compile time reported apart, not in the step), in
interleaved rounds (median); beside it the reference step of the device: the fused C++ kernel (``ops.adam_step``) on
the CPU, zeroshard's CUDA kernel (``ops.adam_step`` on CUDA tensors, every format) and torch's fused AdamW (fp32
state) on CUDA. Prints a table and writes JSON (command, machine, versions, load).

    PYTHONPATH=python python benchmarks/bench_device_adam.py [--sizes 1M,4M] [--rounds 5] [--devices cpu,cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from zeroshard import _C, ops
from zeroshard.optim.state_format import new_moments
from zeroshard.optim.torch_state_step import adam_step_torch

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True, bias_correction=True)
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": "int8"}


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


IMPLS = ("eager", "compiled", "cpu_adam_kernel", "cuda_kernel", "torch_fused_adamw")


def make_runs(device: str, n: int, fmt, impls=IMPLS) -> dict:
    """name -> a function doing one step (state kept across calls: the steps count up)."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen).to(device)
    runs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        p = torch.randn(n, generator=gen).to(device)
        st = {k: v.to(device) for k, v in new_moments((n,), fmt).items()}
        t = [0]

        def run(p=p, st=st, t=t, compiled=compiled):
            t[0] += 1
            adam_step_torch(p, grad, st, step=t[0], compile=compiled, **HYPER)

        runs[name] = run
    # zeroshard's kernel through ops.adam_step: the fused CPU kernel, or the CUDA one where this build has it
    if device == "cpu" or _C.adam_cuda_available():
        p = torch.randn(n, generator=gen).to(device)
        st = {k: v.to(device) for k, v in new_moments((n,), fmt).items()}
        absmax = {k: st[k] for k in ("exp_avg_absmax", "exp_avg_sq_absmax") if k in st}
        t = [0]

        def kernel():
            t[0] += 1
            ops.adam_step(p, grad, st["exp_avg"], st["exp_avg_sq"], step=t[0], **HYPER, **absmax)

        runs["cpu_adam_kernel" if device == "cpu" else "cuda_kernel"] = kernel
    if device != "cpu":
        if fmt == torch.float32:
            q = torch.nn.Parameter(torch.randn(n, generator=gen).to(device))
            q.grad = grad.clone()
            opt = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01, fused=True)
            runs["torch_fused_adamw"] = opt.step
    return {k: f for k, f in runs.items() if k in impls}


def measure(device: str, n: int, fmt_name: str, rounds: int, impls=IMPLS) -> list[dict]:
    runs = make_runs(device, n, FORMATS[fmt_name], impls)
    first = {}
    for name, fn in runs.items():  # warm-up; the compiled one compiles here
        t0 = time.perf_counter()
        fn()
        sync(device)
        first[name] = time.perf_counter() - t0
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    eager = statistics.median(times["eager"]) if "eager" in times else float("nan")
    return [
        {
            "device": device,
            "numel": n,
            "format": fmt_name,
            "impl": name,
            "median_ms": statistics.median(ts) * 1e3,
            "times_ms": [x * 1e3 for x in ts],
            "first_call_s": first[name],
            "x_eager": eager / statistics.median(ts),
        }  # fmt: skip
        for name, ts in times.items()
    ]


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,4M")
    ap.add_argument("--formats", default="fp32,bf16,int8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list from {', '.join(IMPLS)}")
    ap.add_argument("--json", default=f"benchmarks/results/device_adam_{socket.gethostname()}.json")
    args = ap.parse_args(argv)
    devices = [d for d in args.devices.split(",") if d == "cpu" or torch.cuda.is_available()]
    rows = []
    result = {
        "benchmark": "device_adam",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "hostname": socket.gethostname(),
            "cpu": platform.processor(),
            "logical_cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
        },  # fmt: skip
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "loadavg_before": loadavg(),
        "rows": rows,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    print("| device | numel | format | impl | median ms | x eager | first call s |\n|---|---|---|---|---|---|---|")
    for device in devices:
        for n in map(parse_size, args.sizes.split(",")):
            for fmt in args.formats.split(","):
                new = measure(device, n, fmt, args.rounds, args.impls.split(","))
                for r in new:
                    print(f"| {r['device']} | {r['numel']:,} | {r['format']} | {r['impl']} | {r['median_ms']:.2f} | "
                          f"{r['x_eager']:.2f} | {r['first_call_s']:.1f} |", flush=True)  # fmt: skip
                rows += new
                result["loadavg_after"] = loadavg()
                path.write_text(json.dumps(result, indent=2) + "\n")  # after each measurement: a timeout keeps these
    print(f"loadavg before {result['loadavg_before']}, after {result.get('loadavg_after')}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

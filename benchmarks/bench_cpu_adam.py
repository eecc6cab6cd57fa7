"""How fast is one fused CPU Adam step, and how close to this machine's memory bandwidth?

Times one optimizer step (median of --repeats after a warm-up) over n fp32 parameters for:
  zeroshard CPUAdam on every ISA build this CPU runs (fp32 grad),
  torch.optim.AdamW(foreach=True) and AdamW(fused=True),
  the mixed-dtype fused path (bf16 grad in, bf16 param copy out, one pass: zeroshard.ops.adam_step),
  the same mixed job done unfused: bf16->fp32 grad pass, fp32 step, fp32->bf16 param pass.
The step is memory bound, so each row also reports GB/s over the bytes the step must move (bytes_per_param) and
that rate as a fraction of a copy/triad bandwidth measured in the same run. Bytes count write-allocate traffic (a
write-only stream also reads its lines), for the steps and for copy/triad alike. For the torch rows bytes_per_param
is the same 28-byte minimum as ours (their real traffic is higher: several passes), so their GB/s is "effective".

Usage: python benchmarks/bench_cpu_adam.py [--sizes 1M,10M,100M] [--repeats 5] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from zeroshard import ops
from zeroshard.cpu_adam import CPUAdam
from zeroshard.isa import supported_cpu_isas

# DRAM bytes per parameter, counting write-allocate: a store to a line the pass did not read first costs a read for
# ownership too (x86 caches), so a write-only stream moves its bytes twice. p, m, v are read before written: no RFO.
FP32_BYTES = 16 + 12  # read p, g, m, v; write p, m, v
MIXED_BYTES = 2 + 12 + 12 + 2 * 2  # read bf16 g, p, m, v; write p, m, v; write (+RFO) the bf16 param copy
UNFUSED_BYTES = (2 + 4 * 2) + FP32_BYTES + (4 + 2 * 2)  # bf16->fp32 grad pass + fp32 step + fp32->bf16 pass
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True, bias_correction=True)


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def timed(fn, repeats: int, best: bool = False) -> float:
    """Median (or best) seconds of `repeats` calls after one warm-up call (first touch of the pages, lazy state)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def measure_bandwidth(repeats: int) -> dict:
    """Copy (read + write) and triad (2 reads + write) over 512 MiB fp32 buffers, well past the caches.

    Best of `repeats`: the machine's attainable bandwidth, the ceiling the step rows (medians) are compared to.
    """
    n = 128 * 2**20
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    copy_s = timed(lambda: a.copy_(b), repeats, best=True)
    triad_s = timed(lambda: torch.add(b, c, alpha=0.5, out=a), repeats, best=True)
    # Bytes as DRAM sees them, with the read for ownership of `a` (see FP32_BYTES): copy 12, triad 16 per element.
    res = {"copy_gb_per_s": 12 * n / copy_s / 1e9, "triad_gb_per_s": 16 * n / triad_s / 1e9}
    res["buffer_mib"] = 4 * n / 2**20
    res["reference_gb_per_s"] = max(res["copy_gb_per_s"], res["triad_gb_per_s"])
    return res


def bench_size(n: int, repeats: int, isas: list[str]):
    gen = torch.Generator().manual_seed(0)
    rows = []

    def row(impl, isa, seconds, bytes_per_param):
        rows.append(dict(impl=impl, isa=isa, n_params=n, seconds_per_step=seconds, params_per_s=n / seconds,
                         bytes_per_param=bytes_per_param, gb_per_s=n * bytes_per_param / seconds / 1e9))  # fmt: skip

    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    p.grad = torch.randn(n, generator=gen)
    for isa in isas:
        os.environ["ZEROSHARD_CPU_ISA"] = isa
        opt = CPUAdam([p], lr=1e-3, weight_decay=0.01)
        row("zeroshard.CPUAdam", isa, timed(opt.step, repeats), FP32_BYTES)
        del opt
    os.environ.pop("ZEROSHARD_CPU_ISA", None)
    gc.collect()

    for flag in ("foreach", "fused"):
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **{flag: True})
        row(f"torch.AdamW({flag}=True)", "torch", timed(opt.step, repeats), FP32_BYTES)
        del opt
        gc.collect()

    master, m, v = p.detach(), torch.zeros(n), torch.zeros(n)
    g16 = p.grad.to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    del p
    gc.collect()
    for isa in isas:
        row("fused bf16 grad -> bf16 out", isa,
            timed(lambda isa=isa: ops.adam_step(master, g16, m, v, step=1, param_out=out, isa=isa, **HYPER), repeats),
            MIXED_BYTES)  # fmt: skip
    g32 = torch.empty(n)

    def unfused():
        g32.copy_(g16)
        ops.adam_step(master, g32, m, v, step=1, **HYPER)
        out.copy_(master)

    row("fp32 step + separate casts", isas[-1], timed(unfused, repeats), UNFUSED_BYTES)
    return rows


def machine() -> dict:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "cpu_model": model, "logical_cpus": os.cpu_count(),
            "platform": platform.platform()}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,10M,100M", help="comma list of parameter counts, K/M/G suffixes allowed")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per row (median reported)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch/zeroshard threads")
    ap.add_argument("--json", default=f"benchmarks/results/cpu_adam_{socket.gethostname()}.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    isas = supported_cpu_isas()

    # Measured before and after the steps (shared machines drift); the reference is the best of both.
    bw_before = measure_bandwidth(args.repeats)
    rows = []
    for n in sizes:
        for r in bench_size(n, args.repeats, isas):
            rows.append(r)
            print(f"  {r['impl']:<30} {r['isa']:<7} n={n:>11,}  {r['seconds_per_step']:.4f} s", flush=True)
    bw_after = measure_bandwidth(args.repeats)
    bw = {"before": bw_before, "after": bw_after}
    bw["reference_gb_per_s"] = max(bw_before["reference_gb_per_s"], bw_after["reference_gb_per_s"])
    for r in rows:
        r["bandwidth_fraction"] = r["gb_per_s"] / bw["reference_gb_per_s"]
    for when, b in (("before", bw_before), ("after", bw_after)):
        print(f"memory bandwidth {when}: copy {b['copy_gb_per_s']:.1f} GB/s, triad {b['triad_gb_per_s']:.1f} GB/s")
    print(f"reference: {bw['reference_gb_per_s']:.1f} GB/s ({args.threads} threads, write-allocate bytes counted)")

    hdr = (
        f"| {'impl':<30} | {'isa':<7} | {'n_params':>11} | {'s/step':>8} | {'params/s':>9} | B/param | GB/s  | of bw |"
    )
    print("\n" + hdr + "\n|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for r in rows:
        print(f"| {r['impl']:<30} | {r['isa']:<7} | {r['n_params']:>11,} | {r['seconds_per_step']:>8.4f} | "
              f"{r['params_per_s']:>9.3g} | {r['bytes_per_param']:>7} | {r['gb_per_s']:>5.1f} | "
              f"{r['bandwidth_fraction']:>5.0%} |")  # fmt: skip

    result = {
        "benchmark": "cpu_adam",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": machine(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "supported_cpu_isas": isas,
        "bandwidth": bw,
        "rows": rows,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

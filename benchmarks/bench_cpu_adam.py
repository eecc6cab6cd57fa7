"""How fast is one fused CPU Adam step, against torch, DeepSpeed and this machine's memory bandwidth?

Rows, per size (fp32 master weights and moments; one shared parameter and gradient, each optimizer its own moments):
  zeroshard.CPUAdam on each ISA build (``--isas``), and the raw kernel ``ops.adam_step``;
  torch.optim.AdamW(fused=True); DeepSpeedCPUAdam (fp32) when ``deepspeed`` is importable;
  the bandwidth reference ``ops.adam_traffic_reference`` per ISA: the step's exact in-place traffic (read p, g, m, v;
  write p, m, v) with no arithmetic, the same chunks, threads and loop;
  the mixed path: bf16 grad in, fp32 master, bf16 param copy out in one pass (ops.adam_step with param_out), against
  torch fused and DeepSpeed doing their fp32 step plus the two separate casts (bf16 -> fp32 grad, fp32 -> bf16 param),
  and DeepSpeedCPUAdam on bf16 parameters (its bf16 path: fp32 moments, no fp32 master);
  state formats (issue 19) on the mixed path: bf16 and block-wise int8 moments (``ops.adam_step`` with bf16 /
  uint8 + absmax state), fp32 master, bf16 grad in, bf16 param copy out, beside the fp32-state mixed row, torch
  fused + casts and torch fused's plain fp32 step (``x torch fp32``); ``of ref`` for them is the fp32 in-place
  reference's time scaled to their bytes (the reference kernel moves fp32 only);
  bf16 parameters with no master on both sides: zeroshard.CPUAdam on each ISA build against DeepSpeedCPUAdam;
  and a model of ``--model-tensors`` tensors of ``--model-numel`` elements each (the per-tensor cost of a step).

Timing: interleaved rounds. In each round every row is timed once (``reps`` steps, enough for ~10 ms), in an order
rotated from round to round; ratios are formed within a round and their median over rounds is reported, so a burst
of load from other processes shifts both sides of a ratio. Load averages before and after are recorded.

Columns: seconds per step (median over rounds), GB/s over the bytes the step must move, ``of ref``: the in-place
reference's time / this row's time within the round (same ISA; the best ISA for non-zeroshard rows), ``of copy``:
GB/s / the copy bandwidth of 512 MiB buffers (the old reference, kept for comparison), and ``x best other``: the
faster of torch fused / DeepSpeed (same precision path) divided by this row, within the round (> 1: we are faster).

DeepSpeed lives in its own optional venv (never a dependency of the package): see benchmarks/README.md. Its CPU Adam
op is JIT-built at first use (DS_BUILD_OPS=0), which this script triggers before timing.

Usage: python benchmarks/bench_cpu_adam.py [--sizes 1M,10M,100M] [--rounds 9] [--threads 2] [--isas avx512,avx2]
       [--model-tensors 300] [--model-numel 1024] [--json PATH] [--plot]
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

from zeroshard import _C, ops
from zeroshard.isa import supported_cpu_isas
from zeroshard.optim.cpu_adam import CPUAdam

# DRAM bytes per parameter, counting write-allocate: a store to a line the pass did not read first costs a read for
# ownership too (x86 caches), so a write-only stream moves its bytes twice. p, m, v are read before written: no RFO.
FP32_BYTES = 16 + 12  # read p, g, m, v; write p, m, v
MIXED_BYTES = 2 + 12 + 12 + 2 * 2  # read bf16 g, p, m, v; write p, m, v; write (+RFO) the bf16 param copy
CASTS_BYTES = (2 + 4 * 2) + FP32_BYTES + (4 + 2 * 2)  # bf16->fp32 grad pass + fp32 step + fp32->bf16 pass
BF16_PARAM_BYTES = 2 + 2 + 8 + 2 + 8  # read bf16 p, g, fp32 m, v; write bf16 p, fp32 m, v
BF16_STATE_BYTES = 2 + 4 + 4 + 4 + 4 + 2 * 2  # read bf16 g, p, bf16 m, v; write p, m, v; bf16 param copy (+RFO)
INT8_STATE_BYTES = 2 + 4 + 2 + 4 + 2 + 2 * 2 + 16 / 2048  # codes 1 B per moment each way, absmax 4 B per 2048
LR, WD = 1e-3, 0.01
HYPER = dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=WD, adamw_mode=True, bias_correction=True)


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def deepspeed_adam():
    """DeepSpeedCPUAdam, or None (with the reason printed) when deepspeed or its op build is not available."""
    os.environ.setdefault("DS_BUILD_OPS", "0")  # DeepSpeed's own way: JIT-build the op at first use
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 - any import failure means "no DeepSpeed row"
        print(f"DeepSpeed rows skipped: {type(e).__name__}: {e}", flush=True)
        return None, None
    import deepspeed

    return DeepSpeedCPUAdam, deepspeed.__version__


def measure_copy_bandwidth(repeats: int = 5) -> float:
    """Best copy bandwidth over 512 MiB fp32 buffers, counting the write-allocate read (12 bytes per element)."""
    n = 128 * 2**20
    a, b = torch.empty(n), torch.rand(n)
    a.copy_(b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.copy_(b)
        best = min(best, time.perf_counter() - t0)
    return 12 * n / best / 1e9


class Row:
    def __init__(self, name, isa, fn, n, bytes_per_param, path, reps, ref=None):
        self.name, self.isa, self.fn, self.n, self.bytes = name, isa, fn, n, bytes_per_param
        self.path, self.reps, self.ref = path, reps, ref  # path: "fp32" | "mixed" | "model" | "reference"
        self.times: list[float] = []

    def time_once(self) -> None:
        if self.isa in ("avx512", "avx2", "scalar"):
            os.environ["ZEROSHARD_CPU_ISA"] = self.isa
        t0 = time.perf_counter()
        for _ in range(self.reps):
            self.fn()
        self.times.append((time.perf_counter() - t0) / self.reps)
        os.environ.pop("ZEROSHARD_CPU_ISA", None)


def interleave(rows: list[Row], rounds: int) -> None:
    for r in rows:  # warm-up: first touch of pages, lazy state, DeepSpeed's op
        r.time_once()
        r.times.clear()
    for k in range(rounds):
        order = rows[k % len(rows) :] + rows[: k % len(rows)]
        for r in order:
            r.time_once()


def fp32_rows(n, isas, ds_cls, reps):
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    p.grad = torch.randn(n, generator=gen)
    rows = []
    ours = CPUAdam([p], lr=LR, weight_decay=WD)
    ours.step()  # creates the state the raw and reference rows share
    st = ours.state[p]
    master, g, m, v = p.detach(), p.grad, st["exp_avg"], st["exp_avg_sq"]
    for isa in isas:
        rows.append(
            Row(
                "in-place 4R/3W reference",
                isa,
                lambda isa=isa: ops.adam_traffic_reference(master, g, m, v, isa=isa),
                n,
                FP32_BYTES,
                "reference",
                reps,
            )
        )
    for isa in isas:
        rows.append(Row("zeroshard.CPUAdam", isa, ours.step, n, FP32_BYTES, "fp32", reps))
    rows.append(
        Row(
            "raw ops.adam_step",
            isas[0],
            lambda: ops.adam_step(master, g, m, v, step=2, **HYPER),
            n,
            FP32_BYTES,
            "fp32",
            reps,
        )
    )
    torch_opt = torch.optim.AdamW([p], lr=LR, weight_decay=WD, fused=True)
    rows.append(Row("torch.AdamW(fused=True)", "torch", torch_opt.step, n, FP32_BYTES, "fp32", reps))
    if ds_cls is not None:
        ds = ds_cls([p], lr=LR, weight_decay=WD, adamw_mode=True)
        rows.append(Row("DeepSpeedCPUAdam", "ds", ds.step, n, FP32_BYTES, "fp32", reps))

    # mixed: bf16 gradient in, fp32 master, bf16 parameter copy out
    g16 = torch.randn(n, generator=gen).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    for isa in isas:
        rows.append(
            Row(
                "zeroshard fused bf16 grad -> bf16 out",
                isa,
                lambda isa=isa: ops.adam_step(master, g16, m, v, step=2, param_out=out, isa=isa, **HYPER),
                n,
                MIXED_BYTES,
                "mixed",
                reps,
            )
        )

    def with_casts(opt):
        def run():
            g.copy_(g16)
            opt.step()
            out.copy_(master)

        return run

    # state formats: the same mixed path with bf16 or int8 moments (each row its own state, started by one step)
    m16, v16 = m.to(torch.bfloat16), v.to(torch.bfloat16)
    mq, ma = ops.quantize_state(m, signed=True)
    vq, va = ops.quantize_state(v, signed=False)
    for isa in isas:
        rows.append(
            Row(
                "zeroshard bf16 state, bf16 grad -> out",
                isa,
                lambda isa=isa: ops.adam_step(master, g16, m16, v16, step=2, param_out=out, isa=isa, **HYPER),
                n,
                BF16_STATE_BYTES,
                "mixed",
                reps,
            )
        )
        rows.append(
            Row(
                "zeroshard int8 state, bf16 grad -> out",
                isa,
                lambda isa=isa: ops.adam_step(
                    master,
                    g16,
                    mq,
                    vq,
                    step=2,
                    param_out=out,
                    isa=isa,
                    exp_avg_absmax=ma,
                    exp_avg_sq_absmax=va,
                    **HYPER,
                ),  # fmt: skip
                n,
                INT8_STATE_BYTES,
                "mixed",
                reps,
            )
        )

    rows.append(Row("torch fused fp32 step + casts", "torch", with_casts(torch_opt), n, CASTS_BYTES, "mixed", reps))
    if ds_cls is not None:
        rows.append(Row("DeepSpeed fp32 step + casts", "ds", with_casts(ds), n, CASTS_BYTES, "mixed", reps))

    # bf16 parameters with no fp32 master, fp32 moments: the same algorithm on both sides
    def bf16_param():
        pb = torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16))
        pb.grad = g16
        return pb

    for isa in isas:
        ours16 = CPUAdam([bf16_param()], lr=LR, weight_decay=WD)
        rows.append(Row("zeroshard.CPUAdam bf16 params", isa, ours16.step, n, BF16_PARAM_BYTES, "bf16-params", reps))
    if ds_cls is not None:
        ds16 = ds_cls([bf16_param()], lr=LR, weight_decay=WD, adamw_mode=True)
        rows.append(Row("DeepSpeedCPUAdam bf16 params", "ds", ds16.step, n, BF16_PARAM_BYTES, "bf16-params", reps))
    return rows


def model_rows(ntens, numel, isas, ds_cls, reps):
    gen = torch.Generator().manual_seed(1)

    def params():
        ps = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(ntens)]
        for q in ps:
            q.grad = torch.randn(numel, generator=gen)
        return ps

    n = ntens * numel
    name = f"{ntens} tensors x {numel}"
    rows = [
        Row(
            f"zeroshard.CPUAdam, {name}",
            isas[0],
            CPUAdam(params(), lr=LR, weight_decay=WD).step,
            n,
            FP32_BYTES,
            "model",
            reps,
        )
    ]
    rows.append(
        Row(
            f"torch.AdamW(fused=True), {name}",
            "torch",
            torch.optim.AdamW(params(), lr=LR, weight_decay=WD, fused=True).step,
            n,
            FP32_BYTES,
            "model",
            reps,
        )
    )
    if ds_cls is not None:
        rows.append(
            Row(
                f"DeepSpeedCPUAdam, {name}",
                "ds",
                ds_cls(params(), lr=LR, weight_decay=WD, adamw_mode=True).step,
                n,
                FP32_BYTES,
                "model",
                reps,
            )
        )
    return rows


def _paired(a: Row, b: Row) -> float:
    """Median over rounds of a's time / b's time (rounds are paired: both timed within the same round)."""
    return statistics.median(x / y for x, y in zip(a.times, b.times))


def summarize(rows: list[Row], copy_gbs: float, ntensors: int | None = None) -> list[dict]:
    refs = {r.isa: r for r in rows if r.path == "reference"}
    best_ref = next(iter(refs.values()), None)  # the first ISA listed (the best this CPU runs)
    out = []
    for r in rows:
        med = statistics.median(r.times)
        d = dict(impl=r.name, isa=r.isa, n_params=r.n, path=r.path, seconds_per_step=med, rounds=len(r.times),
                 bytes_per_param=r.bytes, gb_per_s=r.n * r.bytes / med / 1e9)  # fmt: skip
        d["of_copy"] = d["gb_per_s"] / copy_gbs
        if r.path in ("fp32", "reference") and best_ref is not None:
            d["of_ref"] = _paired(refs.get(r.isa, best_ref), r)
        if " state," in r.name and best_ref is not None:
            # the fp32 reference's time scaled to this row's bytes: what moving only these bytes would take
            d["of_ref_scaled"] = _paired(refs.get(r.isa, best_ref), r) * r.bytes / FP32_BYTES
            fused = [o for o in rows if o.path == "fp32" and o.isa == "torch"]
            if fused:
                d["x_torch_fp32_step"] = _paired(fused[0], r)
        if r.isa not in ("torch", "ds") and r.path != "reference":
            others = [o for o in rows if o.path == r.path and o.isa in ("torch", "ds")]
            if others:  # the faster of torch fused and DeepSpeed on the same path, round by round
                d["x_best_other"] = statistics.median(
                    min(ts) / t for *ts, t in zip(*[o.times for o in others], r.times)
                )
            for o in others:
                d["x_torch" if o.isa == "torch" else "x_deepspeed"] = _paired(o, r)
            for o in rows:
                if o.path == "bf16-params" and o.isa == "ds" and r.path == "mixed":
                    d["x_deepspeed_bf16"] = _paired(o, r)
        if r.path == "model" and ntensors:
            d["us_per_tensor"] = med / ntensors * 1e6
        out.append(d)
    return out


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


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def print_table(rows: list[dict]) -> None:
    hdr = f"| {'impl':<40} | {'isa':<6} | {'n_params':>11} | {'s/step':>9} | GB/s  | of ref | of copy | x best other |"
    print("\n" + hdr + "\n|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for r in rows:
        ref = (
            f"{r['of_ref']:.3f}" if "of_ref" in r else f"~{r['of_ref_scaled']:.2f}" if "of_ref_scaled" in r else "  -  "
        )
        best = f"{r['x_best_other']:.2f}x" if "x_best_other" in r else "-"
        print(f"| {r['impl']:<40} | {r['isa']:<6} | {r['n_params']:>11,} | {r['seconds_per_step']:>9.6f} | "
              f"{r['gb_per_s']:>5.1f} | {ref:>6} | {r['of_copy']:>7.0%} | {best:>12} |")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,10M,100M", help="comma list of parameter counts, K/M/G suffixes allowed")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds per size (medians reported)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch/zeroshard/DeepSpeed threads")
    ap.add_argument("--isas", default=None, help="zeroshard ISA builds to time (default: avx512/avx2 this CPU runs)")
    ap.add_argument("--model-tensors", type=int, default=300)
    ap.add_argument("--model-numel", type=int, default=1024)
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed rows even if it is importable")
    ap.add_argument("--json", default=f"benchmarks/results/cpu_adam_{socket.gethostname()}.json")
    ap.add_argument("--plot", action="store_true", help="also write a PNG of the table beside the JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    supported = supported_cpu_isas()
    isas = args.isas.split(",") if args.isas else [i for i in reversed(supported) if i != "scalar"] or ["scalar"]
    ds_cls, ds_version = (None, None) if args.no_deepspeed else deepspeed_adam()
    load_before = loadavg()
    os_load_before = os.getloadavg()
    copy_gbs = measure_copy_bandwidth()
    print(f"threads {args.threads}, isas {isas}, DeepSpeed {ds_version}, loadavg {load_before}", flush=True)
    print(f"copy bandwidth (512 MiB, write-allocate counted): {copy_gbs:.1f} GB/s", flush=True)

    results = []
    for n in [parse_size(s) for s in args.sizes.split(",")]:
        reps = max(1, int(3e7 // n))
        rows = fp32_rows(n, isas, ds_cls, reps)
        interleave(rows, args.rounds)
        results += summarize(rows, copy_gbs)
        print(f"  n={n:,} done (loadavg {loadavg()})", flush=True)
        del rows
        gc.collect()
    n = args.model_tensors * args.model_numel
    rows = model_rows(args.model_tensors, args.model_numel, isas, ds_cls, max(1, int(1e7 // n)))
    interleave(rows, args.rounds * 3)
    results += summarize(rows, copy_gbs, args.model_tensors)
    load_after = loadavg()
    os_load_after = os.getloadavg()
    copy_after = measure_copy_bandwidth()
    print_table(results)
    for r in results:
        if "x_torch_fp32_step" in r:
            print(f"{r['impl']} ({r['isa']}, n={r['n_params']:,}): {r['bytes_per_param']:.2f} B/param, "
                  f"{r['x_torch_fp32_step']:.2f}x torch fused fp32 step, {r['of_ref_scaled']:.2f} of the scaled "
                  f"in-place reference")  # fmt: skip
        if "us_per_tensor" in r:
            print(f"{r['impl']}: {r['us_per_tensor']:.2f} us per tensor")
    print(f"loadavg before {load_before}, after {load_after}; copy bandwidth after {copy_after:.1f} GB/s")

    result = {
        "benchmark": "cpu_adam",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "threads": args.threads,
        "rounds": args.rounds,
        "machine": machine(),
        "torch_version": torch.__version__,
        "deepspeed_version": ds_version,
        "python_version": platform.python_version(),
        "supported_cpu_isas": supported,
        "cpu_vendor": _C.cpu_vendor(),
        "adam_prefetch_bytes": _C.adam_prefetch_bytes(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "os_getloadavg": {"before": list(os_load_before), "after": list(os_load_after)},
        "copy_gb_per_s": {"before": copy_gbs, "after": copy_after},
        "rows": results,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    if args.plot:
        from plot_table import plot_result  # matplotlib only when asked

        print(f"wrote {plot_result(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

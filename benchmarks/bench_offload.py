"""What does zeroshard's offload pipeline achieve on one GPU, against a plain pinned copy and against PyTorch FSDP2
with ``CPUOffloadPolicy``?

Method: one process per config (the script re-invokes itself with ``--worker CONFIG``), so GPU and host peaks are the
config's own and a crash loses only that config. Configs, in order:

* ``pinned_copy``: the reference: ``dst.copy_(src, non_blocking=True)`` of a 1 GiB pinned host tensor to the GPU and
  back, timed with CUDA events, median of 5, in GB/s (1e9 bytes/s). CUDA only.
* ``zeroshard_opt_offload``: ``ZeroEngine(ZeroConfig(stage=3, offload_optimizer=True, wrap_policy=Block))``: bf16
  parameters on the GPU, fp32 master weights and AdamW state on the host, stepped by zeroshard's fused CPU Adam.
* ``zeroshard_opt_param_offload``: the same with ``offload_params=True``: the bf16 parameter shards live on the host
  too and are uploaded per unit.
* ``zeroshard_no_offload``: the same engine without offload (everything on the GPU): what offload costs.
  ``zeroshard_no_offload_fused`` steps its shards with ``AdamW(fused=True)``, as ``fsdp2_no_offload_fused`` does.
  ``zeroshard_no_offload_bf16_state`` / ``_int8_state`` keep bf16 / block-wise int8 Adam moments on the GPU, stepped
  by ``DeviceAdam`` (issue 19's device step), against ``zeroshard_no_offload_fused``.
* ``deepspeed_opt_offload`` / ``deepspeed_opt_param_offload``: DeepSpeed's ZeRO-3 with ``offload_optimizer`` (and
  ``offload_param``) to pinned CPU memory, bf16, DeepSpeedCPUAdam (``benchmarks/deepspeed_zero3.py``). Skipped when
  ``deepspeed`` is not importable (it lives in the benchmark's own venv, see ``benchmarks/README.md``).
* ``fsdp2_cpu_offload``: ``torch.distributed.fsdp.fully_shard`` on every Block and then the GPT, with
  ``CPUOffloadPolicy()`` and ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; ``torch.optim.AdamW``
  (default implementation: foreach) steps the fp32 parameters on the host.
* ``fsdp2_cpu_offload_fused``: the same with ``AdamW(fused=True)`` (torch's fused CPU kernel).
* ``fsdp2_no_offload`` / ``fsdp2_no_offload_fused``: the same FSDP2 wrapping without ``CPUOffloadPolicy``: fp32
  sharded parameters and AdamW (foreach / fused) on the GPU, against ``zeroshard_no_offload`` (issue 22's stage-3
  goal without offload on one GPU).

Every training config builds the examples' GPT (``examples/gpt.py``) with the same seed on the compute device (so all
configs start from identical weights), trains ``--warmup`` + ``--steps`` AdamW steps (lr ``--lr``, weight decay 0.1)
on the same random tokens (fixed seed), bf16 compute, loss ``cross_entropy(logits.float(), y)``, and reports:

* s/step: median over the timed steps of the wall time from the start of forward to the end of the optimizer step,
  each end marked by ``torch.cuda.synchronize()``; tokens/s = batch * block / (s/step);
* optimizer step alone: wall time of ``optimizer.step()`` + ``engine.after_step()`` (zeroshard) or ``optimizer.step()``
  + ``zero_grad()`` (FSDP2), synchronized before and after: the part of a step where offload usually loses;
* GPU peak (``torch.cuda.max_memory_allocated``, reset once the model and optimizer are built, so the fp32 model the
  seeded build makes on the GPU is not counted; the setup peak is stored too); host peak RSS (``ru_maxrss``, the
  whole process) and the host peak during training (``VmHWM`` after resetting it through ``/proc/self/clear_refs``);
  for zeroshard the pinned bytes of ``zeroshard._C.host_memory_stats()``;
* for zeroshard: the offload pipeline's D2H and H2D GB/s over the timed steps from ``engine.offload.copy_stats()``
  (bytes moved by its copy streams / device time they took), printed next to the plain pinned copy;
* the loss of every step: zeroshard rows should agree closely with each other, and with FSDP2 (same weights, same
  data; the gradient reduce dtype differs if ``--reduce_dtype bf16``).

``--smoke`` runs a tiny GPT on the CPU (gloo) instead, skipping the CUDA-only ``pinned_copy`` and running FSDP2
without ``CPUOffloadPolicy`` (parameters are on the CPU already); it goes through the same functions as the GPU run.
The JSON is rewritten after every config, so a run cut short still leaves the finished ones.

Usage:
    PYTHONPATH=python:examples python benchmarks/bench_offload.py [--configs pinned_copy,zeroshard_opt_offload,...]
        [--n_layer 24 --n_head 16 --n_embd 2048 --block_size 1024 --batch_size 4] [--steps 5 --warmup 2]
        [--reduce_dtype fp32|bf16] [--out benchmarks/results/] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))  # gpt.py

import deepspeed_zero3  # noqa: E402  (beside this file; imports deepspeed only when its rows run)

GIB = 2**30
MIB = 2**20

CONFIGS = {
    "pinned_copy": "1 GiB pinned host tensor <-> GPU, dst.copy_(src, non_blocking=True), CUDA events, median of 5",
    "zeroshard_no_offload": "ZeroEngine stage 3, no offload (bf16 params, fp32 master and AdamW on the GPU)",
    "zeroshard_no_offload_fused": "as zeroshard_no_offload with torch.optim.AdamW(fused=True) on the GPU shards",
    "zeroshard_no_offload_bf16_state": "as zeroshard_no_offload with bf16 Adam moments (DeviceAdam on the GPU shards)",
    "zeroshard_no_offload_int8_state": "as zeroshard_no_offload with block-wise int8 Adam moments (DeviceAdam)",
    "zeroshard_opt_offload": "ZeroEngine stage 3 + offload_optimizer (bf16 params on GPU; fp32 master + Adam on host)",
    "zeroshard_opt_param_offload": "ZeroEngine stage 3 + offload_optimizer + offload_params (bf16 params on host)",
    "deepspeed_opt_offload": "DeepSpeed ZeRO-3 + offload_optimizer to pinned CPU memory, bf16, DeepSpeedCPUAdam",
    "deepspeed_opt_param_offload": "DeepSpeed ZeRO-3 + offload_optimizer + offload_param to pinned CPU memory, bf16",
    "fsdp2_cpu_offload": "fully_shard per Block + root, CPUOffloadPolicy, bf16 params, fp32 reduce, AdamW foreach",
    "fsdp2_cpu_offload_fused": "as fsdp2_cpu_offload with torch.optim.AdamW(fused=True) on the host parameters",
    "fsdp2_no_offload": "fully_shard per Block + root, no offload, bf16 params, fp32 reduce, AdamW foreach on the GPU",
    "fsdp2_no_offload_fused": "as fsdp2_no_offload with torch.optim.AdamW(fused=True) on the GPU",
}
CUDA_ONLY = {"pinned_copy"}


# -- machine and versions (max_model_size.py uses these too) ----------------------------------------------------------


def machine() -> dict:
    """CPU model, logical CPUs, host RAM, and the GPU name, memory and driver (``nvidia-smi``) when there is one."""
    import psutil

    model = platform.processor()
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    out = {"hostname": socket.gethostname(), "cpu_model": model, "logical_cpus": os.cpu_count(),
           "host_ram_gib": psutil.virtual_memory().total / GIB, "platform": platform.platform()}  # fmt: skip
    try:
        import zeroshard

        out |= {"cpu_isa": zeroshard.cpu_isa(), "supported_cpu_isas": zeroshard.supported_cpu_isas()}
    except ImportError:
        pass
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip().splitlines()  # fmt: skip
        name, driver, mem = (s.strip() for s in smi[0].split(","))
        out |= {"gpu": name, "gpu_driver": driver, "gpu_memory": mem, "gpu_count": len(smi)}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        out |= {"gpu": None, "gpu_driver": None}
    return out


def versions() -> dict:
    """Python, torch (and its CUDA), Lightning, and zeroshard's git commit (``-dirty`` with local changes)."""
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        import lightning

        v["lightning"] = lightning.__version__
    except ImportError:
        v["lightning"] = None
    try:
        git = ["git", "-C", str(REPO)]
        sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
        v["zeroshard_git_sha"] = sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        v["zeroshard_git_sha"] = None
    return v


# -- host memory ------------------------------------------------------------------------------------------------------


def host_peak_mib() -> float:
    """Peak RSS of this process over its whole life (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_host_hwm() -> bool:
    """Resets this process's RSS high-water mark (``VmHWM``); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def host_hwm_mib() -> float | None:
    """``VmHWM`` of this process (peak RSS since the last ``reset_host_hwm``), or None off Linux."""
    try:
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return None


def pinned_stats() -> dict | None:
    """``zeroshard._C.host_memory_stats()`` (pinned and unpinned host bytes of the offload buffers), if it exists."""
    from zeroshard import _C

    stats = getattr(_C, "host_memory_stats", None)
    return dict(stats()) if stats is not None else None


# -- worker side: setup ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(cuda: bool):
    """A one-rank process group (NCCL on GPU 0, else gloo); returns the compute device."""
    import torch
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")  # fmt: skip
    return torch.device("cuda", 0) if cuda else torch.device("cpu")


def gpt_config(args: argparse.Namespace):
    from gpt import GPTConfig

    return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                     vocab_size=args.vocab_size)  # fmt: skip


def build_gpt(args: argparse.Namespace, device):
    """The GPT in fp32 on ``device``, seeded: every config starts from the same weights."""
    import torch

    from gpt import GPT

    torch.manual_seed(args.seed)
    with torch.device(device):
        return GPT(gpt_config(args))


def make_batches(args: argparse.Namespace, n: int) -> list:
    """``n`` batches (x, y) of random token ids from a fixed seed, on the CPU (moved to the device per step)."""
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.block_size + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


@contextmanager
def default_dtype(dtype):
    """Tensors created in forward default to the compute dtype, as ``ZeroPrecision.forward_context`` does."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def loss_of(model, x, y):
    import torch.nn.functional as F

    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- worker side: the configs -----------------------------------------------------------------------------------------


def run_pinned_copy(args: argparse.Namespace, device) -> dict:
    """GB/s of a plain pinned host -> GPU and GPU -> host ``copy_(non_blocking=True)``, median of ``repeats``."""
    import torch

    n = int(args.copy_gib * GIB)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    gpu = torch.empty(n, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", gpu, host), ("d2h", host, gpu)):
        dst.copy_(src, non_blocking=True)  # warm-up
        secs = []
        for _ in range(args.copy_repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            secs.append(start.elapsed_time(end) / 1e3)
        out[f"{name}_gb_per_s"] = n / statistics.median(secs) / 1e9
        out[f"{name}_seconds"] = secs
    out["bytes"] = n
    print(f"  pinned copy: H2D {out['h2d_gb_per_s']:.1f} GB/s, D2H {out['d2h_gb_per_s']:.1f} GB/s", flush=True)
    return out


def setup_zeroshard(
    args: argparse.Namespace,
    device,
    offload_params: bool,
    meta: bool = False,
    offload: bool = True,
    fused: bool = False,
    state_dtype: object = None,
):
    """(params, engine, forward_backward, optimizer_step) for ZeRO stage 3 + optimizer (and parameter) offload, or
    none (``offload=False``). ``state_dtype``: ``ZeroConfig.optimizer_state_dtype`` (None: fp32 moments).

    ``meta``: build the GPT under ``zeroshard.init_meta_context()`` and let the engine materialise it unit by unit on
    ``device`` (``max_model_size.py``: a model larger than the GPU); otherwise build it whole on ``device``.
    """
    import torch

    from gpt import GPT, Block
    from zeroshard import ZeroConfig, ZeroEngine, init_meta_context

    extra = {"offload_chunk_size": args.offload_chunk_size} if args.offload_chunk_size else {}
    if state_dtype is not None:
        extra["optimizer_state_dtype"] = state_dtype
    config = ZeroConfig(stage=3, offload_optimizer=offload, offload_params=offload_params, wrap_policy=Block,
                        reduce_dtype=torch.bfloat16 if args.reduce_dtype == "bf16" else None, **extra)  # fmt: skip
    if meta:
        torch.manual_seed(args.seed)
        with init_meta_context():
            model = GPT(gpt_config(args))
    else:
        model = build_gpt(args, device)
    num_params = sum(p.numel() for p in model.parameters())  # before the engine turns them into views
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, **({"fused": True} if fused else {}))
    engine = ZeroEngine(model, opt, config, compute_dtype=torch.bfloat16)

    def forward_backward(x, y):
        engine.begin_step()
        with default_dtype(torch.bfloat16):
            loss = loss_of(model, x, y)
        loss.backward()
        engine.finish_backward()
        return loss

    def optimizer_step():
        engine.optimizer.step()
        engine.after_step()

    return num_params, engine, forward_backward, optimizer_step


def setup_fsdp2(args: argparse.Namespace, device, fused: bool, offload: bool = True):
    """(params, optimizer, forward_backward, optimizer_step) for FSDP2 with CPUOffloadPolicy (``offload``; never on a
    CPU device) or without it."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = build_gpt(args, device)
    num_params = sum(p.numel() for p in model.parameters())
    # The mesh names the device: fully_shard's default mesh is on CUDA whenever a GPU exists, also in --smoke.
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    if offload and device.type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, **({"fused": True} if fused else {}))

    def forward_backward(x, y):
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return num_params, opt, forward_backward, optimizer_step


def train(args: argparse.Namespace, device, forward_backward: Callable, optimizer_step: Callable,
          on_timed_start: Callable[[], None]) -> dict:  # fmt: skip
    """``--warmup`` + ``--steps`` steps; per step: wall seconds, optimizer-step seconds, loss."""
    batches = make_batches(args, args.warmup + args.steps)
    step_s, opt_s, losses = [], [], []
    for i, (x, y) in enumerate(batches):
        if i == args.warmup:
            on_timed_start()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync(device)
        t0 = time.perf_counter()
        loss = forward_backward(x, y)
        sync(device)
        t1 = time.perf_counter()
        optimizer_step()
        sync(device)
        t2 = time.perf_counter()
        losses.append(float(loss.detach()))
        step_s.append(t2 - t0)
        opt_s.append(t2 - t1)
        tag = "warm-up" if i < args.warmup else "timed"
        print(f"    step {i} ({tag}): {step_s[-1]:.3f} s (optimizer {opt_s[-1]:.3f} s), loss {losses[-1]:.5f}",
              flush=True)  # fmt: skip
    return {"step_s": step_s, "optimizer_step_s": opt_s, "losses": losses}


def state_dtype_of(name: str):
    """``ZeroConfig.optimizer_state_dtype`` named by a config's ``_bf16_state`` / ``_int8_state`` suffix (else None)."""
    import torch

    for suffix, fmt in (("_bf16_state", torch.bfloat16), ("_int8_state", "int8")):
        if name.endswith(suffix):
            return fmt
    return None


def run_training(name: str, args: argparse.Namespace, device) -> dict:
    """Builds config ``name``, trains it, and returns its measurements."""
    import torch

    cuda = device.type == "cuda"
    t = time.perf_counter()
    if name.startswith("zeroshard"):
        num_params, engine, forward_backward, optimizer_step = setup_zeroshard(
            args, device, "param" in name, offload="no_offload" not in name, fused=name.endswith("fused"),
            state_dtype=state_dtype_of(name),
        )  # fmt: skip
    elif name.startswith("deepspeed"):
        num_params, _, forward_backward, optimizer_step = deepspeed_zero3.setup(
            args, device, offload_params="param" in name, build_model=lambda: build_gpt(args, device), loss_of=loss_of
        )
        engine = None
    else:
        num_params, _, forward_backward, optimizer_step = setup_fsdp2(
            args, device, name.endswith("fused"), offload="cpu_offload" in name
        )
        engine = None
    setup_s = time.perf_counter() - t
    print(f"  {name}: {num_params:,} params, setup {setup_s:.1f} s", flush=True)
    out = {"num_params": num_params, "setup_s": setup_s, "host_rss_after_setup_mib": host_hwm_mib()}
    offload = getattr(engine, "offload", None) if engine is not None else None
    if cuda:
        out["gpu_setup_peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        torch.cuda.reset_peak_memory_stats(device)
    out["host_hwm_reset"] = reset_host_hwm()

    def on_timed_start() -> None:
        if offload is not None and cuda:
            offload.reset_copy_stats()

    out |= train(args, device, forward_backward, optimizer_step, on_timed_start)
    if offload is not None and cuda:
        stats = offload.copy_stats()
        out["copy_stats"] = stats
        for d in ("d2h", "h2d"):
            b, s = stats[d]["bytes"], stats[d]["seconds"]
            out[f"pipeline_{d}_gb_per_s"] = b / s / 1e9 if s > 0 else None
    if engine is not None:
        out["memory_summary"] = engine.memory_summary()
        out["host_memory_stats"] = pinned_stats()
    out["gpu_peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB if cuda else None
    out["host_peak_mib"] = host_peak_mib()
    out["host_train_peak_mib"] = host_hwm_mib() if out["host_hwm_reset"] else None
    out["threads"] = torch.get_num_threads()
    return out


def worker(args: argparse.Namespace) -> None:
    """One config in this process; writes its measurements to ``--worker_out``."""
    import torch

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = init_single_process(cuda)
    if args.worker == "pinned_copy":
        result = run_pinned_copy(args, device)
    else:
        result = run_training(args.worker, args, device)
    Path(args.worker_out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


# -- launcher side ----------------------------------------------------------------------------------------------------


def run_worker(cmd: list[str], timeout: float, prefix: str = "") -> tuple[int | None, str, float]:
    """Runs ``cmd``, echoing its output live; returns (exit code or None on timeout, last 3000 chars, seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    tail: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            print(prefix + line, end="", flush=True)
            tail.append(line)
            del tail[:-200]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    reader.join(timeout=10)
    text = "".join(tail)[-3000:]
    if code is None:
        text += f"\nTimeoutError: killed after {timeout:.0f} s"
    return code, text, time.perf_counter() - t0


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


WORKER_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "batch_size", "steps", "warmup", "lr", "seed",
               "reduce_dtype", "offload_chunk_size", "copy_gib", "copy_repeats", "threads")  # fmt: skip


def summarize(name: str, r: dict, args: argparse.Namespace) -> dict:
    timed = r["step_s"][args.warmup :] or r["step_s"]
    opt = r["optimizer_step_s"][args.warmup :] or r["optimizer_step_s"]
    s = statistics.median(timed)
    pinned = (r.get("host_memory_stats") or {}).get("peak_pinned_bytes")
    return r | {
        "s_per_step": s,
        "tokens_per_s": args.batch_size * args.block_size / s,
        "optimizer_step_s_median": statistics.median(opt),
        "final_loss": r["losses"][-1],
        "peak_pinned_bytes": pinned,
    }


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def gib(v, unit: int) -> str:
    """``v`` (a count of ``unit`` bytes, or None) in GiB with two decimals."""
    return fmt(v * unit / GIB if v is not None else None, ".2f")


COLUMNS = [
    ("config", 27, lambda r, c: r["config"]),
    ("params", 8, lambda r, c: fmt(r.get("num_params", 0) / 1e6, ".1f") + "M"),
    ("s/step", 7, lambda r, c: fmt(r.get("s_per_step"), ".3f")),
    ("tokens/s", 8, lambda r, c: fmt(r.get("tokens_per_s"), ".0f")),
    ("opt step s", 10, lambda r, c: fmt(r.get("optimizer_step_s_median"), ".3f")),
    ("GPU peak GiB", 12, lambda r, c: gib(r.get("gpu_peak_mib"), MIB)),
    ("host peak GiB", 13, lambda r, c: gib(r.get("host_peak_mib"), MIB)),
    ("train peak GiB", 14, lambda r, c: gib(r.get("host_train_peak_mib"), MIB)),
    ("pinned GiB", 10, lambda r, c: gib(r.get("peak_pinned_bytes"), 1)),
    ("D2H GB/s (copy)", 15, lambda r, c: fmt(r.get("pipeline_d2h_gb_per_s"), ".1f") + f" ({fmt(c.get('d2h'), '.1f')})"),
    ("H2D GB/s (copy)", 15, lambda r, c: fmt(r.get("pipeline_h2d_gb_per_s"), ".1f") + f" ({fmt(c.get('h2d'), '.1f')})"),
    ("final loss", 10, lambda r, c: fmt(r.get("final_loss"), ".5f")),
]


def print_table(rows: list[dict]) -> None:
    copy = next((r for r in rows if r["config"] == "pinned_copy" and "error" not in r), {})
    ref = {"d2h": copy.get("d2h_gb_per_s"), "h2d": copy.get("h2d_gb_per_s")}
    align = ["<"] + [">"] * (len(COLUMNS) - 1)
    print("\n| " + " | ".join(f"{h:{a}{w}}" for a, (h, w, _) in zip(align, COLUMNS)) + " |")
    print("|" + "|".join("-" * (w + 2) for _, w, _ in COLUMNS) + "|")
    for r in rows:
        if r["config"] == "pinned_copy":
            if "error" not in r and "skipped" not in r:
                print(f"| {'pinned_copy':<27} | H2D {r['h2d_gb_per_s']:.1f} GB/s, D2H {r['d2h_gb_per_s']:.1f} GB/s "
                      f"({r['bytes'] / GIB:.0f} GiB, median of {len(r['h2d_seconds'])})")  # fmt: skip
        if "error" in r or "skipped" in r:
            print(f"| {r['config']:<27} | {'failed: ' + r['error'] if 'error' in r else 'skipped: ' + r['skipped']}")
        elif r["config"] != "pinned_copy":
            print("| " + " | ".join(f"{cell(r, ref):{a}{w}}" for a, (_, w, cell) in zip(align, COLUMNS)) + " |")


# The comparisons: tokens/s of the row over tokens/s of the reference row, same run (> 1: the row is faster).
RATIOS = [
    ("zeroshard_opt_offload", "deepspeed_opt_offload"),
    ("zeroshard_opt_param_offload", "deepspeed_opt_param_offload"),
    ("zeroshard_opt_offload", "fsdp2_cpu_offload_fused"),
    ("zeroshard_opt_offload", "fsdp2_cpu_offload"),
    ("zeroshard_opt_offload", "zeroshard_no_offload"),
    ("zeroshard_no_offload", "fsdp2_no_offload"),
    ("zeroshard_no_offload", "fsdp2_no_offload_fused"),
    ("zeroshard_no_offload_fused", "fsdp2_no_offload_fused"),
    ("zeroshard_no_offload_bf16_state", "zeroshard_no_offload_fused"),
    ("zeroshard_no_offload_int8_state", "zeroshard_no_offload_fused"),
]


def ratios(rows: list[dict]) -> dict[str, float]:
    """``"a / b"``: tokens/s of config a over config b, for each pair of :data:`RATIOS` where both rows ran."""
    tps = {r["config"]: r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    return {f"{a} / {b} tokens/s": tps[a] / tps[b] for a, b in RATIOS if a in tps and b in tps}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list from {', '.join(CONFIGS)}")
    p.add_argument("--n_layer", type=int, default=24)
    p.add_argument("--n_head", type=int, default=16)
    p.add_argument("--n_embd", type=int, default=2048)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps, after the warm-up ones")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--reduce_dtype", choices=["fp32", "bf16"], default="fp32",
                   help="zeroshard's gradient reduce dtype (FSDP2 reduces in fp32)")  # fmt: skip
    p.add_argument("--offload_chunk_size", type=int, default=0, help="elements; 0 = the engine's default")
    p.add_argument("--copy_gib", type=float, default=1.0, help="size of the plain pinned copy")
    p.add_argument("--copy_repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads in the workers; 0 = torch's default")
    p.add_argument("--timeout", type=float, default=150, help="seconds per config before its worker is killed")
    p.add_argument("--budget", type=float, default=290,
                   help="seconds for the whole run: a config is not started with less than 30 s left")  # fmt: skip
    p.add_argument("--out", default=None, help="directory for the JSON (default benchmarks/results/; --smoke: a "
                   "new temporary directory)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny GPT on the CPU (gloo); CUDA-only configs skipped")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one config in this process
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke and not args.worker:
        args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size = 2, 4, 64, 32, 256
        args.batch_size, args.steps, args.warmup = 2, 2, 1
        args.timeout = min(args.timeout, 120)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = [s.strip() for s in args.configs.split(",") if s.strip()]
    unknown = [s for s in names if s not in CONFIGS]
    if unknown:
        raise SystemExit(f"error: unknown --configs {unknown}; choose from {', '.join(CONFIGS)}")
    default_out = tempfile.mkdtemp(prefix="bench_offload_smoke_") if args.smoke else REPO / "benchmarks" / "results"
    out_dir = Path(args.out or default_out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"offload{'_smoke' if args.smoke else ''}_{socket.gethostname()}.json"
    t_start = time.perf_counter()
    print(f"GPT {args.n_layer} layers x {args.n_embd} (heads {args.n_head}, block {args.block_size}, vocab "
          f"{args.vocab_size}), batch {args.batch_size}, {args.warmup} + {args.steps} steps, "
          f"{'CPU smoke' if args.smoke else 'CUDA'}; load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    result = {
        "benchmark": "offload",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
        "machine": machine() | {"load_average_start": os.getloadavg()},
        "versions": versions(),
        "configs": {n: CONFIGS[n] for n in names},
        "rows": [],
    }
    rows = result["rows"]
    with tempfile.TemporaryDirectory(prefix="bench_offload_") as tmp:
        for name in names:
            left = args.budget - (time.perf_counter() - t_start)
            if args.smoke and name in CUDA_ONLY:
                rows.append({"config": name, "skipped": "CUDA only (--smoke runs on the CPU)"})
            elif name.startswith("deepspeed") and deepspeed_zero3.unavailable():
                rows.append({"config": name, "skipped": deepspeed_zero3.unavailable()})
            elif left < 30:
                rows.append({"config": name, "skipped": f"out of --budget ({args.budget:.0f} s)"})
            else:
                print(f"[{time.perf_counter() - t_start:5.0f} s] {name}: {CONFIGS[name]}", flush=True)
                worker_out = Path(tmp) / f"{name}.json"
                cmd = [sys.executable, __file__, "--worker", name, "--worker_out", str(worker_out)]
                cmd += [f"--{k}={getattr(args, k)}" for k in WORKER_ARGS] + (["--smoke"] if args.smoke else [])
                code, text, wall = run_worker(cmd, min(args.timeout, left), prefix="")
                if code == 0 and worker_out.exists():
                    r = json.loads(worker_out.read_text())
                    row = {"config": name, "wall_s": wall}
                    row |= r if name == "pinned_copy" else summarize(name, r, args)
                    rows.append(row)
                else:
                    rows.append({"config": name, "error": last_line(text), "log_tail": text, "wall_s": wall})
                    print(f"  {name}: FAILED ({last_line(text)})", flush=True)
            result["machine"]["load_average_end"] = os.getloadavg()
            path.write_text(json.dumps(result, indent=2) + "\n")  # after every config: a timeout still leaves data
    print_table(rows)
    result["ratios"] = ratios(rows)
    for k, v in result["ratios"].items():
        print(f"{k}: {v:.2f}")
    path.write_text(json.dumps(result, indent=2) + "\n")
    losses = [(r["config"], r["final_loss"]) for r in rows if "final_loss" in r]
    if losses:
        print("final losses: " + ", ".join(f"{n} {v:.6f}" for n, v in losses))
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Question: what do zeroshard's sharded checkpoints cost to save and load, against a consolidated full state dict?

Method: 2 ranks (gloo, CPU) build the same GPT under ZeRO stage 3 and take one optimizer step so Adam state exists.
Then, each timed on every rank and reported per rank:

* sharded save: ``save_sharded`` (each rank writes its own shards, no gather);
* full save: ``ZeroEngine.full_state_dict()`` + ``optimizer_state_dict()`` (gathered to rank 0's CPU, unit by unit) and
  ``torch.save`` on rank 0 -- what Lightning's strategies write by default;
* sharded load at the same world size into a fresh engine (each rank reads only its byte ranges);
* full load: ``torch.load`` of the whole file on every rank, then the engine's loaders;
* pretrained load: ``load_pretrained`` from the consolidated safetensors file, with the bytes each rank read.

Peak host memory is the growth of ru_maxrss over the phase: a high-water mark, so a phase shows only what goes beyond
the phases before it; it counts file pages mapped by safetensors' memory-mapped reads, and the sharded load also
allocates the fresh engine's Adam state (2 x its shard). Prints a table and writes JSON with the command, machine and
versions.

    python benchmarks/bench_checkpoint.py [--n_layer 8 --n_embd 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT, Block, GPTConfig
    from zeroshard import ZeroConfig, ZeroEngine
    from zeroshard.checkpoint.sharded_checkpoint import load_sharded, save_sharded
    from zeroshard.meta_init import init_meta_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)

    def engine():
        with init_meta_context():
            model = GPT(cfg)
        torch.manual_seed(0)
        return ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=3, wrap_policy=Block))

    e = engine()
    x = torch.randint(0, 256, (2, cfg.block_size))
    e.begin_step()
    loss = torch.nn.functional.cross_entropy(e.module(x).flatten(0, 1), x.flatten())
    loss.backward()
    e.finish_backward()
    e.optimizer.step()
    e.after_step()

    out = Path(args.dir)
    rows = {}

    def timed(name, fn):
        dist.barrier()
        before, t = _rss(), time.perf_counter()
        result = fn()
        dist.barrier()
        rows[name] = {"seconds": time.perf_counter() - t, "peak_growth_mib": (_rss() - before) / MIB}
        return result

    timed("sharded save", lambda: save_sharded(e, out / "sharded", {}))
    fresh = engine()
    timed("sharded load", lambda: load_sharded(fresh, out / "sharded"))

    def full_save():
        state = {"state_dict": e.full_state_dict(), "optimizer": e.optimizer_state_dict()}
        if rank == 0:
            torch.save(state, out / "full.pt")

    timed("full save", full_save)

    def full_load():
        state = torch.load(out / "full.pt", weights_only=False)
        fresh.load_full_state_dict(state["state_dict"])
        fresh.load_optimizer_state_dict(state["optimizer"])

    timed("full load", full_load)
    # rank-relevant loading of pretrained weights: consolidate to safetensors, then each rank reads its slices
    from zeroshard.consolidate import consolidate
    from zeroshard.pretrained import load_pretrained

    if rank == 0:
        consolidate(out / "sharded", out / "weights")
    dist.barrier()
    report = timed("pretrained load", lambda: load_pretrained(fresh.module, out / "weights" / "model.safetensors"))
    rows["pretrained load"].update(bytes_read=report.bytes_read, bytes_total=report.bytes_total)
    sizes = {
        "sharded": sum(f.stat().st_size for f in (out / "sharded").rglob("*") if f.is_file()),  # LATEST + v00001/
        "full": (out / "full.pt").stat().st_size,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        num_params = sum(p.numel() for p in e.module.parameters())
        Path(args.result).write_text(json.dumps({"ranks": gathered, "bytes": sizes, "num_params": num_params}))
    dist.barrier()
    dist.destroy_process_group()  # torch asks for it; a gloo group alive at exit can abort it (pytorch/pytorch#190489)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--n_head", type=int, default=8)
    p.add_argument("--n_embd", type=int, default=512)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / f"checkpoint_{socket.gethostname()}.json"))
    p.add_argument("--rank_dir", dest="dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank_result", dest="result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dir:
        run_rank(args)
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    result = tmp / "result.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed buffers leave RSS, so peaks measure what was alive
        cmd = [sys.executable, __file__, *sys.argv[1:], "--rank_dir", str(tmp), "--rank_result", str(result)]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [q.wait(timeout=1800) for q in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    data = json.loads(result.read_text())
    shutil.rmtree(tmp, ignore_errors=True)

    print(f"GPT {data['num_params'] / 1e6:.1f}M params, ZeRO stage 3, 2 ranks on CPU (gloo), AdamW state")
    print(
        f"bytes on disk: sharded {data['bytes']['sharded'] / MIB:.1f} MiB, full {data['bytes']['full'] / MIB:.1f} MiB"
    )
    print(f"| {'phase':<15} | {'s rank0':>8} | {'s rank1':>8} | {'peak +MiB rank0':>15} | {'peak +MiB rank1':>15} |")
    print(f"|{'-' * 17}|{'-' * 10}|{'-' * 10}|{'-' * 17}|{'-' * 17}|")
    for phase in data["ranks"][0]:
        r0, r1 = data["ranks"][0][phase], data["ranks"][1][phase]
        print(
            f"| {phase:<15} | {r0['seconds']:>8.3f} | {r1['seconds']:>8.3f} | {r0['peak_growth_mib']:>15.1f} "
            f"| {r1['peak_growth_mib']:>15.1f} |"
        )
    pre = [r["pretrained load"] for r in data["ranks"]]
    print(
        "load_pretrained bytes read per rank: "
        + ", ".join(
            f"rank {i}: {r['bytes_read'] / MIB:.1f} MiB ({r['bytes_read'] / r['bytes_total']:.3f})"
            for i, r in enumerate(pre)
        )
        + f" of {pre[0]['bytes_total'] / MIB:.1f} MiB"
    )
    import torch

    record = {
        "benchmark": "checkpoint",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "hostname": socket.gethostname(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_average": os.getloadavg(),
        },  # fmt: skip
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "device": "cpu",
        **data,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

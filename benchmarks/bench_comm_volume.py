"""Is zeroshard's communication volume what ZeRO theory says? Bytes per rank per step, measured beside theory.

Method: the examples' GPT (``examples/gpt.py``; default 4 x 130, 5 heads, block 63, byte vocabulary: 859,690
parameters, a count that divides by neither 3 nor 4) trains 3 steps (fp32, AdamW, batch 2 x 63 tokens per rank) at
world sizes 2, 3 and 4 on gloo, one launch of N ranks per world size, every config in turn: Lightning-free torch
DDP, zeroshard stages 1, 2 and 3 (Blocks as units) and hybrid sharding (shard groups of k ranks, replicated across N/k
groups; k = 1 at N = 2 and 3, k = 2 at N = 4) at stages 2 and 3. The last step is measured three ways:

* ``measured``: what we ask of the process group, counted by the C++ collectives layer (``engine.comm_stats()``) in ring
  volume (all-gather and reduce-scatter F (N-1)/N, all-reduce 2 F (N-1)/N for F bytes). DDP: its comm hook counts each
  bucket it all-reduces, in the same ring volume.
* ``gloo wire``: what gloo sends for those collectives: ring volumes; zeroshard's reduce-scatter on gloo is an
  all-to-all of the chunks (gloo's own reduce-scatter all-reduces the whole buffer: twice the bytes).
* ``socket``: the bytes this process wrote (``wchar`` of ``/proc/self/io``, which gloo's socket writes go through), an
  independent check of the wire figure (about 0.05% of it is gloo's message headers).

Theory (ZeRO paper, Rajbhandari et al. 2020, section 7; Psi = trainable parameter elements x 4 bytes): DDP and stages
1-2 2 Psi (N-1)/N, stage 3 3 Psi (N-1)/N; hybrid: the same with N = k inside the group, plus 2 (Psi / k) (R-1)/R for the
all-reduce of the gradient shard across the R = N/k groups. ``padding`` is the padded flat parameters' size over Psi
(every flat parameter is padded to a multiple of N x 64 bytes); ``exact`` divides the measurement by the theory with
the padded sizes and, at stage 3, with the root unit (embeddings, final norm) and the last block gathered once per
step: the root stays gathered from forward through backward, as FSDP2 keeps its root, and the last block from its
forward into the backward that starts with it, so stage 3 sends less than 3 Psi.

Usage:
    PYTHONPATH=python:examples python benchmarks/bench_comm_volume.py [--worlds 2,3,4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

STEPS = 3


def hybrid_k(world: int) -> int:
    """The shard group size of the hybrid rows: 2 where it divides the world size and is smaller, else 1."""
    return 2 if world % 2 == 0 and world > 2 else 1


def configs(world: int) -> list[dict]:
    k = hybrid_k(world)
    return [
        {"name": "ddp", "stage": "ddp", "k": world},
        {"name": "stage1", "stage": 1, "k": world},
        {"name": "stage2", "stage": 2, "k": world},
        {"name": "stage3", "stage": 3, "k": world},
        {"name": f"hybrid{k}x{world // k}_stage2", "stage": 2, "k": k},
        {"name": f"hybrid{k}x{world // k}_stage3", "stage": 3, "k": k},
    ]


def socket_bytes() -> int:
    """Bytes this process passed to write-like system calls so far (gloo's socket writes among them)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


# -- one rank ---------------------------------------------------------------------------------------------------------


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import zeroshard
    from gpt import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g) for _ in range(STEPS)]
    results = []
    for conf in configs(world):
        torch.manual_seed(0)
        model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ddp_bytes, ddp_calls = [0], [0]
        engine = None
        if conf["stage"] == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)

            def hook(state, bucket, counter=ddp_bytes, calls=ddp_calls):
                buf = bucket.buffer()
                counter[0] += 2 * buf.numel() * buf.element_size() * (world - 1) // world  # ring all-reduce
                calls[0] += 1
                return default_hooks.allreduce_hook(None, bucket)

            model.register_comm_hook(None, hook)
        else:
            config = zeroshard.ZeroConfig(
                stage=conf["stage"],
                wrap_policy=Block if conf["stage"] == 3 else None,
                shard_group_size=conf["k"] if conf["k"] != world else None,
            )
            engine = zeroshard.ZeroEngine(model, optimizer, config)
            optimizer = engine.optimizer
        sock = []
        for x in batches:
            before, ddp_bytes[0], ddp_calls[0] = socket_bytes(), 0, 0
            if engine is not None:
                engine.begin_step()
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            loss.backward()
            if engine is not None:
                engine.finish_backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if engine is not None:
                engine.after_step()
            sock.append(socket_bytes() - before)
        row = {"config": conf["name"], "stage": conf["stage"], "k": conf["k"], "socket_bytes": sock[-1]}
        row["params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if engine is None:
            row["measured_bytes"] = ddp_bytes[0]
            row["wire_bytes"] = ddp_bytes[0]  # gloo runs all-reduce as a ring
            row["calls"] = ddp_calls[0]
            row["padded_params"] = row["params"]
        else:
            stats = engine.comm_stats()
            last = stats["last_step"]
            row["measured_bytes"] = sum(v["bytes"] for v in last.values())
            row["calls"] = sum(v["calls"] for v in last.values())
            row["wire_bytes"] = sum(v["wire_bytes"] for v in last.values())
            row["by_kind"] = {group: g["last_step"] for group, g in stats["groups"].items()}
            trainable = [fp for fp in engine.all_flat_params if fp.trainable]
            row["padded_params"] = sum(fp.layout.padded_numel for fp in trainable)
            if engine.sharded is not None:
                # gathered once a step: the root unit and the last unit of the forward (kept into backward)
                once = [engine.sharded.units[0]]
                if engine.sharded.last_kept is not None:
                    once.append(engine.sharded.units[engine.sharded.last_kept])
                row["root_padded_params"] = sum(fp.layout.padded_numel for u in once for fp in u.flat_params)
                # each unit all-gather also carries the unit's 4-element tag (zeroshard.sharding.gather_check), inside
                # the unit's own all-gather: one call per gather
                row["unit_gathers"] = stats["groups"]["shard_gather"]["last_step"]["all_gather"]["calls"]
            engine.remove_hooks()
        results.append(row)
        dist.barrier()
    (Path(args.rank_out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


# -- theory -----------------------------------------------------------------------------------------------------------


def theory(row: dict, world: int, elements: int, root_elements: int = 0) -> float:
    """Bytes per rank and step for ``elements`` fp32 parameter elements (see the module docstring); with
    ``root_elements``, stage 3 gathers those once instead of twice."""
    from zeroshard.sharding.comm_stats import theory_bytes

    k = row["k"]
    psi = 4 * elements
    total = theory_bytes(row["stage"], psi, k, world // k)
    if row["stage"] == 3 and root_elements:
        total -= 4 * root_elements * (k - 1) / k
    return total


# -- driver -----------------------------------------------------------------------------------------------------------


def launch(world: int, args: argparse.Namespace, tmp: Path) -> list[list[dict]]:
    out = Path(tempfile.mkdtemp(prefix=f"w{world}_", dir=tmp))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--rank_out", str(out)]
    cmd += [f"--{k}={getattr(args, k)}" for k in ("n_layer", "n_head", "n_embd", "block_size")]
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit("\n".join(f"--- rank {r} ---\n{log[-3000:]}" for r, log in enumerate(logs)))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def summarize(world: int, ranks: list[list[dict]]) -> list[dict]:
    from zeroshard.sharding.gather_check import TAG_ELEMS

    rows = []
    for i, row in enumerate(ranks[0]):
        per_rank = [r[i] for r in ranks]
        measured = max(r["measured_bytes"] for r in per_rank)
        assert all(r["measured_bytes"] == measured for r in per_rank), f"ranks differ: {per_rank}"
        th = theory(row, world, row["params"])
        th_exact = theory(row, world, row["padded_params"], row.get("root_padded_params", 0))
        th_exact += 4 * TAG_ELEMS * (row["k"] - 1) * row.get("unit_gathers", 0)  # fp32 tags, ring bytes per rank
        wire = row["wire_bytes"]
        sock = sum(r["socket_bytes"] for r in per_rank) / world
        rows.append(
            {
                "world_size": world,
                "config": row["config"],
                "layout": f"{row['k']}x{world // row['k']}",
                "params": row["params"],
                "measured_bytes": measured,
                "calls": row["calls"],
                "theory_bytes": th,
                "measured_over_theory": measured / th,
                "padding": row["padded_params"] / row["params"],
                "exact_theory_bytes": th_exact,
                "measured_over_exact": measured / th_exact,
                "gloo_wire_bytes": wire,
                "socket_bytes_mean": sock,
                "socket_over_wire": sock / wire,
                "by_kind": row.get("by_kind"),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    head = ("N", "config", "k x R", "measured B", "theory B", "meas/theory", "padding", "meas/exact", "gloo wire B",
            "socket B", "socket/wire")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = (r["world_size"], r["config"], r["layout"], f"{r['measured_bytes']:,}", f"{r['theory_bytes']:,.0f}",
                 f"{r['measured_over_theory']:.4f}", f"{r['padding']:.5f}", f"{r['measured_over_exact']:.6f}",
                 f"{r['gloo_wire_bytes']:,}", f"{r['socket_bytes_mean']:,.0f}",
                 f"{r['socket_over_wire']:.4f}")  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="2,3,4")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=5)
    p.add_argument("--n_embd", type=int, default=130)
    p.add_argument("--block_size", type=int, default=63)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / f"comm_volume_{socket.gethostname()}.json"))
    p.add_argument("--rank_out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_out:
        run_rank(args)
        return 0
    import torch

    load_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_comm_") as tmp:
        for world in [int(w) for w in args.worlds.split(",")]:
            t0 = time.perf_counter()
            rows += summarize(world, launch(world, args, Path(tmp)))
            print(f"world size {world}: {time.perf_counter() - t0:.0f} s", flush=True)
    load_end = os.getloadavg()
    print_table(rows)
    # (N-1)/N of a byte count is rounded down per collective: allow one byte per call
    bad = [r["config"] for r in rows if abs(r["measured_bytes"] - r["exact_theory_bytes"]) > r["calls"]]
    print(f"\nmeasured = exact theory (to a byte per collective) for {len(rows) - len(bad)} of {len(rows)} rows"
          + (f"; NOT: {bad}" if bad else ""))  # fmt: skip
    print(f"load average: start {load_start[0]:.2f}, end {load_end[0]:.2f}")
    result = {
        "benchmark": "comm_volume",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: v for k, v in vars(args).items() if k != "rank_out"},
        "machine": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "logical_cpus": os.cpu_count(),
            "load_average_start": load_start,
            "load_average_end": load_end,
        },  # fmt: skip
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "rows": rows,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How much of the model does ZeRO stage 3 hold gathered during backward, with gradient accumulation? (CPU, one process)

The examples' GPT (``--n_layer`` x ``--n_embd``, units = blocks) under ``ZeroEngine(stage=3)`` trains ``--steps``
optimizer steps of ``--micro_batches`` micro-batches each: every micro-batch but the last only accumulates
(``engine.require_grad_sync = False``, what Lightning's ``accumulate_grad_batches`` and DDP's ``no_sync`` do), the
last one reduces. At every unit event in backward (the runtime's post-backward event, wrapped here) the gathered units
are counted, with their full buffers' bytes; the table gives, per kind of micro-batch, the most seen at once. A
gathered unit's memory is its flat parameters' full buffers, so these bytes are exact, not RSS.
What runs is whatever ``zeroshard`` is imported: run this file with ``PYTHONPATH`` pointing at another checkout's
``python/`` for a before/after (each run adds its ``--label`` to ``--json``, other labels kept, and prints every entry).

    PYTHONPATH=python python benchmarks/bench_stage3_accumulation.py --label after
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

import zeroshard  # noqa: E402
from gpt import GPT, Block, GPTConfig  # noqa: E402
from rank_launch import machine, versions  # noqa: E402
from zeroshard import ZeroConfig, ZeroEngine  # noqa: E402


def measure(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=64, vocab_size=256)
    model = GPT(cfg)
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=3, wrap_policy=Block))
    units = engine.sharded.units
    most = {"accumulating": (0, 0), "reducing": (0, 0)}
    kind = "accumulating"
    event = engine.sharded.post_backward_event

    def counted(index: int) -> None:
        held = [u for u in units if u.is_gathered]
        nbytes = sum(fp.full.untyped_storage().nbytes() for u in held for fp in u.flat_params)
        most[kind] = max(most[kind], (len(held), nbytes))
        event(index)

    engine.sharded.post_backward_event = counted
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=torch.Generator().manual_seed(1))
    for _ in range(args.steps):
        for micro in range(args.micro_batches):
            kind = "reducing" if micro == args.micro_batches - 1 else "accumulating"
            engine.require_grad_sync = kind == "reducing"
            engine.begin_step()
            logits = model(x[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
            engine.finish_backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        engine.after_step()
    whole = sum(fp.layout.padded_numel * fp.full.element_size() for u in units for fp in u.flat_params)
    engine.remove_hooks()
    return {
        "units": len(units),
        "model_bytes": whole,
        "most_gathered_in_backward": {k: {"units": n, "bytes": b} for k, (n, b) in most.items()},
    }


def _git(path: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", default="current")
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--micro_batches", type=int, default=2, help="per optimizer step (accumulate_grad_batches)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "stage3_accumulation_cpu.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            result = measure(args)
        finally:
            dist.destroy_process_group()
    entry = {
        "command": "python " + " ".join(sys.argv),
        "zeroshard_git": _git(Path(zeroshard.__file__).resolve().parent),
        "machine": machine(),
        "versions": versions(),
        "config": {k: v for k, v in vars(args).items() if k not in ("label", "json")},
        **result,
    }
    path = Path(args.json)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[args.label] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print("| entry | zeroshard | model | units | micro-batch | most units gathered in backward | MiB | of the model |")
    print("|---|---|---|---|---|---|---|---|")
    for label, e in data.items():
        c = e["config"]
        for k, m in e["most_gathered_in_backward"].items():
            print(
                f"| {label} | {e['zeroshard_git']} | {c['n_layer']} x {c['n_embd']} | {e['units']} | {k} | "
                f"{m['units']} | {m['bytes'] / 2**20:.1f} | {m['bytes'] / e['model_bytes']:.2f} |"
            )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Does training converge the same with bf16 or block-wise 8-bit Adam moments as with fp32? (issue 19, convergence)

Trains, in one process on the CPU, the demo's byte-level GPT (``examples/gpt.py``, 4 x 128) and a tiny Hugging Face
Llama built from a config (no hub) on real text (this Python's standard library source, ``examples/data.py``), once per
optimizer-state format of ``zeroshard.optim.CPUAdam`` (``state_dtype`` = ``torch.float32``, ``torch.bfloat16``,
``"int8"``: tensors under ``--min_8bit_size`` elements, 4096 by default as in bitsandbytes, keep fp32 moments;
``int8_all``: every tensor int8, ``min_8bit_size=0``), and, where ``torchao`` imports, once with torchao's
``AdamW8bit`` as an outside reference. Every run of a model starts from the same initial weights and sees the same
batches in the same order, so the curves differ only by the optimizer. Reports the final training loss (mean of the
last 20 steps) and the validation loss (20 fixed held-out batches), each beside fp32's, and whether it is within 1% of
fp32 (the goal; never asserted). Writes JSON with the command, machine and versions, and with ``--plot`` a PNG of the
loss curves.

    python benchmarks/bench_state_formats.py                      # 300 steps, both models, all formats
    python benchmarks/bench_state_formats.py --steps 600 --plot --json benchmarks/results/state_formats_vm.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

from data import ByteWindows, split_bytes, stdlib_corpus  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from rank_launch import machine, versions  # noqa: E402
from zeroshard import CPUAdam  # noqa: E402

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": "int8", "int8_all": "int8"}
TORCHAO = "torchao_adamw8bit"
GOAL = 0.01  # within 1% of fp32's loss


def build_model(name: str, block_size: int) -> torch.nn.Module:
    """``gpt``: the demo GPT (0.83M). ``llama``: transformers' LlamaForCausalLM from a config, same width and depth,
    byte vocabulary (256), grouped-query attention (4 heads, 2 KV heads), SwiGLU, RMSNorm, RoPE."""
    if name == "gpt":
        return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=block_size))
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=block_size,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def make_optimizer(kind: str, model: torch.nn.Module, lr: float, weight_decay: float, min_8bit_size: int = 4096):
    """AdamW with decay on matrices only (the usual split), as CPUAdam in ``kind``'s state format (``int8``: fp32
    moments for tensors under ``min_8bit_size`` elements; ``int8_all``: none) or torchao's AdamW8bit (its default
    blocks of 256, fp32 master weights; it too keeps fp32 state for tensors under 4096 elements, or not a multiple of
    its block: ``_new_buffer`` in ``torchao/optim/adam.py``)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if kind == TORCHAO:
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, lr=torch.tensor(lr), betas=(0.9, 0.95))  # a tensor lr: it is set each step
    small = 0 if kind == "int8_all" else min_8bit_size
    return CPUAdam(groups, lr=lr, betas=(0.9, 0.95), state_dtype=FORMATS[kind], min_8bit_size=small)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine to a tenth of the peak (the demo's schedule)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    losses = [F.cross_entropy(logits_of(model, x).flatten(0, 1), y.flatten()).item() for x, y in val]
    model.train()
    return statistics.fmean(losses)


def train(model_name: str, kind: str, batches, val, args: argparse.Namespace) -> dict:
    """One run: same seed (same initial weights) and same batches for every ``kind``."""
    torch.manual_seed(args.seed)
    model = build_model(model_name, args.block_size)
    opt = make_optimizer(kind, model, args.lr, args.weight_decay, args.min_8bit_size)
    curve, vals, step_s = [], [], []
    for step, (x, y) in enumerate(batches):
        for g in opt.param_groups:
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(lr_at(step, args))  # torchao refuses a float assigned over its tensor lr
            else:
                g["lr"] = lr_at(step, args)
        loss = F.cross_entropy(logits_of(model, x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t0 = time.perf_counter()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        curve.append(loss.item())
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            vals.append((step + 1, val_loss(model, val)))
    return {
        "model": model_name,
        "optimizer": kind,
        "params": sum(p.numel() for p in model.parameters()),
        "final_train_loss": statistics.fmean(curve[-20:]),
        "final_val_loss": vals[-1][1],
        "optimizer_step_s_median": statistics.median(step_s[5:] or step_s),
        "train_curve": curve,
        "val_curve": vals,
    }


def torchao_rows(argv: list[str]) -> list[dict]:
    """torchao's AdamW8bit rows, from a child process running this script with ``--torchao only``: importing torchao
    changes torch's global state (measured here: the next fp32 GPT run took 51 s for 20 steps instead of 3 s), so it
    never shares a process with the other rows. Empty, with the reason printed, if torchao does not import."""
    try:
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            raise ImportError("no module named 'torchao'")
    except ImportError as e:
        print(f"torchao not importable ({e}): no AdamW8bit reference row")
        return []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "torchao.json"
        # the last --torchao and --json win in argparse
        cmd = [sys.executable, __file__, *[a for a in argv if a != "--plot"], "--torchao", "only", "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr)[-3000:]
            print(f"torchao's AdamW8bit run failed (exit {done.returncode}):\n{tail}")
            return []
        rows = json.loads(out.read_text())["rows"]
    for r in rows:
        print(f"  {r['model']} {r['optimizer']}: val {r['final_val_loss']:.4f} in {r['wall_s']:.0f} s (child process)")
    return rows


def plot(result: dict, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        for r in (r for r in result["rows"] if r["model"] == name):
            c = r["train_curve"]
            smooth, ema = [], c[0]
            for v in c:
                ema = 0.9 * ema + 0.1 * v
                smooth.append(ema)
            (line,) = ax.plot(range(1, len(c) + 1), smooth, label=f"{r['optimizer']} train (EMA 0.9)", lw=1.2)
            steps, losses = zip(*r["val_curve"])
            ax.plot(steps, losses, "o--", color=line.get_color(), ms=4, lw=0.8, label=f"{r['optimizer']} val")
        ax.set_title(f"{name}: Adam state formats")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--models", default="gpt,llama", help="comma list of gpt, llama")
    p.add_argument("--formats", default="fp32,bf16,int8", help="comma list of fp32, bf16, int8, int8_all")
    p.add_argument(
        "--min_8bit_size",
        type=int,
        default=4096,
        help="int8: tensors with fewer elements keep fp32 moments (bitsandbytes' default 4096; int8_all uses 0)",
    )
    p.add_argument(
        "--torchao",
        choices=["auto", "off", "only"],
        default="auto",
        help="auto: add torchao's AdamW8bit rows (run in a child process) if torchao imports; only: just those rows",
    )
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--val_every", type=int, default=50)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--json", default="benchmarks/results/state_formats.json")
    p.add_argument("--plot", action="store_true", help="also write a PNG of the loss curves beside the JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = [k.strip() for k in args.formats.split(",") if k.strip()]
    bad = [k for k in kinds if k not in FORMATS]
    if bad:
        p.error(f"--formats: unknown {bad}; use a comma list of {list(FORMATS)}")
    if args.torchao == "only":
        kinds = [TORCHAO]
    train_tokens, val_tokens = split_bytes(stdlib_corpus(), args.block_size)
    windows = ByteWindows(train_tokens, args.block_size, num_samples=args.steps * args.batch_size, seed=args.seed)
    batches = [
        tuple(torch.stack(t) for t in zip(*(windows[i * args.batch_size + j] for j in range(args.batch_size))))
        for i in range(args.steps)
    ]
    vwin = ByteWindows(val_tokens, args.block_size)
    val = [
        tuple(torch.stack(t) for t in zip(*(vwin[i * args.batch_size + j] for j in range(args.batch_size))))
        for i in range(20)
    ]

    rows = []
    for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if model_name == "llama":
            try:
                import transformers  # noqa: F401
            except ImportError as e:
                print(f"transformers not importable ({e}): no Llama rows")
                continue
        for kind in kinds:
            t0 = time.perf_counter()
            row = train(model_name, kind, batches, val, args)
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(f"  {model_name} {kind}: val {row['final_val_loss']:.4f} in {row['wall_s']:.0f} s", flush=True)
    if args.torchao == "auto":
        rows += torchao_rows(argv if argv is not None else sys.argv[1:])

    print(f"\n{args.steps} steps, batch {args.batch_size} x {args.block_size} bytes, lr {args.lr} (cosine), AdamW")
    print("| model | optimizer | final train loss | vs fp32 | val loss | vs fp32 | within 1% | opt step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = next((x for x in rows if x["model"] == r["model"] and x["optimizer"] == "fp32"), r)
        r["train_vs_fp32"] = r["final_train_loss"] / ref["final_train_loss"] - 1
        r["val_vs_fp32"] = r["final_val_loss"] / ref["final_val_loss"] - 1
        r["within_goal"] = abs(r["train_vs_fp32"]) <= GOAL and abs(r["val_vs_fp32"]) <= GOAL
        print(
            f"| {r['model']} | {r['optimizer']} | {r['final_train_loss']:.4f} | {r['train_vs_fp32']:+.2%} | "
            f"{r['final_val_loss']:.4f} | {r['val_vs_fp32']:+.2%} | {'yes' if r['within_goal'] else 'NO'} | "
            f"{1e3 * r['optimizer_step_s_median']:.2f} |"
        )
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "versions": versions(),
        "args": vars(args),
        "rows": rows,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    if args.plot:
        print(f"loss curves: {plot(result, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

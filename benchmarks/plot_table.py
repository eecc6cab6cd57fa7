"""PNG pictures of the tables bench_train.py and bench_cpu_adam.py print, drawn from the JSON they write (``--plot``
on either writes the PNG beside its JSON). matplotlib (a benchmark/example dependency only), "Agg" backend.

    python benchmarks/plot_table.py benchmarks/results/train_vm.json      # -> benchmarks/results/train_vm.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MIB = 2**20


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_train(result: dict, out_png: Path) -> Path:
    """bench_train.py: tokens/s and model-state MiB per rank (theory and measured) by configuration, and each
    configuration's loss curve."""
    plt = _pyplot()
    rows = [r for r in result["rows"] if "error" not in r]
    names = [r["config"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(
        1, 3, figsize=(17, 0.5 * len(rows) + 3.5), gridspec_kw={"width_ratios": [1, 1, 1.3]}
    )
    y = range(len(rows))
    ax1.barh(y, [r["tokens_per_s"] for r in rows], color="tab:blue")
    ax1.set_yticks(list(y), names)
    ax1.invert_yaxis()
    ax1.set_xlabel("tokens/s (all ranks)")
    ax1.set_title("throughput")
    h = 0.4
    theory = [r["model_state_theory_bytes"]["total"] / MIB for r in rows]
    measured = [r["model_state_measured_bytes_rank0"]["total"] / MIB for r in rows]
    ax2.barh([i - h / 2 for i in y], theory, h, label="theory")
    ax2.barh([i + h / 2 for i in y], measured, h, label="measured (rank 0)")
    ax2.set_yticks(list(y), names)
    ax2.invert_yaxis()
    ax2.set_xlabel("MiB per rank")
    ax2.set_title("model state held between steps")
    ax2.legend()
    for r in rows:
        ax3.plot(r["loss_curve"], label=r["config"], lw=1)
    ax3.set_xlabel("step (warm-up included)")
    ax3.set_ylabel("train loss (mean over ranks)")
    ax3.set_title("loss")
    ax3.legend(fontsize="small")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    a = result.get("args", {})
    fig.suptitle(
        f"bench_train: GPT {result.get('num_params', 0):,} params, {a.get('devices')} ranks on "
        f"{result.get('device', '?')}, batch {a.get('batch_size')}/rank"
    )
    return _save(fig, plt, out_png)


def plot_cpu_adam(result: dict, out_png: Path) -> Path:
    """bench_cpu_adam.py: GB/s of each implementation (and ISA), one panel per parameter count (and the many-small-
    tensors "model" rows)."""
    plt = _pyplot()
    groups: dict[str, list[dict]] = {}
    for r in result["rows"]:
        key = f"model, {r['n_params']:,} params" if r["path"] == "model" else f"{r['n_params']:,} params"
        groups.setdefault(key, []).append(r)
    paths = list(dict.fromkeys(r["path"] for r in result["rows"]))
    colors = {path: f"C{i}" for i, path in enumerate(paths)}
    heights = [len(g) + 2 for g in groups.values()]
    fig, axes = plt.subplots(
        len(groups), 1, figsize=(10, 0.3 * sum(heights) + 1.5), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for ax, (title, rows) in zip(axes[:, 0], groups.items()):
        y = range(len(rows))
        ax.barh(y, [r["gb_per_s"] for r in rows], color=[colors[r["path"]] for r in rows])
        ax.set_yticks(list(y), [f"{r['impl']} [{r['isa']}]" for r in rows], fontsize="small")
        ax.invert_yaxis()
        ax.set_title(title, fontsize="medium")
        ax.grid(alpha=0.3, axis="x")
    axes[-1, 0].set_xlabel("GB/s (bytes per parameter x parameters / step time)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    h = fig.get_figheight()  # inches: the title and the legend of paths sit in the top 0.75 in, above the panels
    legend = {"loc": "upper center", "ncol": len(colors), "bbox_to_anchor": (0.5, 1 - 0.35 / h), "fontsize": "small"}
    fig.legend(handles, list(colors), **legend)
    copy = result.get("copy_gb_per_s", {}).get("before")
    title = f"bench_cpu_adam: {result.get('threads')} threads on {result.get('machine', {}).get('cpu_model', '?')}"
    title += f"; copy bandwidth {copy:.1f} GB/s" if copy else ""
    fig.text(0.5, 1 - 0.08 / h, title, ha="center", va="top", fontsize="large")
    return _save(fig, plt, out_png, top=1 - 0.75 / h)


def _save(fig, plt, out_png: Path, top: float = 1.0) -> Path:
    fig.tight_layout(rect=(0, 0, 1, top))
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def plot_result(json_path: Path, out_png: Path | None = None) -> Path:
    """The PNG of a bench_train or bench_cpu_adam JSON (by its ``benchmark`` key), beside it unless ``out_png``."""
    json_path = Path(json_path)
    result = json.loads(json_path.read_text())
    draw = {"train": plot_train, "cpu_adam": plot_cpu_adam}.get(result.get("benchmark"))
    if draw is None:
        raise ValueError(f"{json_path}: no picture for benchmark {result.get('benchmark')!r}")
    return draw(result, out_png or json_path.with_suffix(".png"))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python benchmarks/plot_table.py RESULT.json [...]")
    for arg in sys.argv[1:]:
        print(plot_result(Path(arg)))

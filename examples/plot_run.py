"""Pictures of a run from the metrics.csv Lightning's CSVLogger wrote: training and validation loss against step, and
the tokens/s of each rank. matplotlib (an example dependency only) is imported here, with the "Agg" backend.

    python examples/plot_run.py runs/train_gpt/version_0/metrics.csv      # writes loss.png beside it
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def read_metrics(metrics_csv: Path) -> dict[str, list[tuple[int, float]]]:
    """``{column: [(step, value), ...]}`` for every column but ``step`` and ``epoch`` (CSVLogger leaves a cell empty
    where a row did not log that metric)."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("step"):
                continue
            step = int(float(row["step"]))
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                series.setdefault(key, []).append((step, float(value)))
    return series


def plot_metrics(metrics_csv: Path, out_png: Path) -> Path:
    """Write a PNG of train loss (per step) and val loss (per validation) against step and, below, the tokens/s of
    each rank (``tokens_per_s/rank{i}`` columns), read from ``metrics_csv``. Returns ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_metrics(Path(metrics_csv))
    rates = sorted(k for k in series if k.startswith("tokens_per_s/"))
    fig, axes = plt.subplots(2 if rates else 1, 1, figsize=(8, 7 if rates else 4.5), sharex=True, squeeze=False)
    ax = axes[0][0]
    if "train_loss" in series:
        steps, losses = zip(*series["train_loss"])
        ax.plot(steps, losses, lw=1, label="train loss (rank 0)")
    if "val_loss" in series:
        steps, losses = zip(*series["val_loss"])
        ax.plot(steps, losses, "o-", lw=2, label="validation loss")
    ax.set_ylabel("loss (nats per byte)")
    run = Path(metrics_csv).parent
    ax.set_title(f"{run.parent.name}/{run.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if rates:
        ax2 = axes[1][0]
        for key in rates:
            steps, values = zip(*series[key])
            ax2.plot(steps, values, "o-", ms=4, label=key.split("/", 1)[1].replace("rank", "rank "))
        ax2.set_ylabel("tokens/s (training only)")
        ax2.set_title("throughput per rank (each point: the steps since the last one)")
        ax2.set_ylim(0, 1.15 * max(v for key in rates for _, v in series[key]))
        ax2.grid(alpha=0.3)
        ax2.legend(loc="lower right")
    axes[-1][0].set_xlabel("optimizer step")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python examples/plot_run.py METRICS_CSV [OUT_PNG]")
    src = Path(sys.argv[1])
    print(plot_metrics(src, Path(sys.argv[2]) if len(sys.argv) == 3 else src.with_name("loss.png")))

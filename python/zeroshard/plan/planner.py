"""Every configuration of a model on a cluster: bytes, fits, predicted step time; and the choice among them."""

from __future__ import annotations

from zeroshard.plan.cluster import GIB, Cluster
from zeroshard.plan.memory import DEVICE_ITEMS, HOST_ITEMS, Layout, Training, fits, memory
from zeroshard.plan.model_spec import ModelSpec, gpt_spec
from zeroshard.plan.step_time import step_time

DEFAULT_MARGIN = 0.10  # fraction of device and host memory left free: allocator fragmentation, loaders, spikes


def group_sizes(cluster: Cluster) -> list[int]:
    """Shard group sizes to consider: the world, and the powers of two (times the node size) that divide it."""
    world = cluster.world_size
    sizes = {world}
    k = 1
    while k < world:
        if world % k == 0:
            sizes.add(k)
        k *= 2
    if world % cluster.gpus_per_node == 0:
        sizes.add(cluster.gpus_per_node)
    return sorted(sizes, reverse=True)


def layouts(cluster: Cluster, stages=(1, 2, 3), hybrid: bool = True) -> list[Layout]:
    """stage 1/2/3 x optimizer offload x parameter offload (stage 3 with optimizer offload) x shard group size."""
    out = []
    for k in group_sizes(cluster) if hybrid else [cluster.world_size]:
        shard = None if k == cluster.world_size else k
        for stage in stages:
            for off in (False, True):
                for op in (False, True) if stage == 3 and off else (False,):
                    out.append(Layout(stage, off, op, shard))
    return out


def evaluate(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster, margin: float = DEFAULT_MARGIN):
    """One row: the layout, itemised bytes, fits (with ``margin``), predicted step time."""
    mem = memory(spec, train, layout, cluster)
    t = step_time(spec, train, layout, cluster, mem["flat"])
    world = cluster.world_size
    return {
        "config": layout.label(world),
        "stage": layout.stage,
        "offload_optimizer": layout.offload_optimizer,
        "offload_params": layout.offload_params,
        "shard_group_size": layout.shard_group_size or world,
        "device_bytes": mem["device"],
        "device_total_bytes": mem["device_total"],
        "host_bytes_per_rank": mem["host"],
        "host_bytes_per_node": mem["host_per_node"],
        "fits": fits(mem, cluster, margin),
        "predicted_step_s": t["step_s"],
        "tokens_per_s": t["tokens_per_s"],
        "step": t,
    }


def plan(
    spec: ModelSpec,
    train: Training,
    cluster: Cluster,
    margin: float = DEFAULT_MARGIN,
    stages=(1, 2, 3),
    hybrid: bool = True,
    ddp: bool = False,
) -> list[dict]:
    """Rows for every configuration (``ddp`` adds torch DDP for reference), fastest fitting first."""
    todo = ([Layout("ddp")] if ddp else []) + layouts(cluster, stages, hybrid)
    rows = [evaluate(spec, train, layout, cluster, margin) for layout in todo]
    return sorted(rows, key=lambda r: (not r["fits"], r["predicted_step_s"]))


def choose(rows: list[dict]) -> tuple[dict | None, list[dict]]:
    """The fastest fitting zeroshard row and the next fitting ones (``rows`` as :func:`plan` sorts them)."""
    ok = [r for r in rows if r["fits"] and r["stage"] != "ddp"]
    return (ok[0] if ok else None), ok[1:4]


def largest_gpt(
    layout: Layout,
    train: Training,
    cluster: Cluster,
    n_embd: int,
    n_head: int,
    vocab_size: int,
    block_size: int,
    tied_head: bool = True,
    margin: float = DEFAULT_MARGIN,
    max_layers: int = 4096,
) -> tuple[int, ModelSpec | None]:
    """The most GPT blocks of width ``n_embd`` that fit with ``layout`` (0 and None if not even one)."""

    def ok(n: int) -> bool:
        spec = gpt_spec(n, n_embd, n_head, vocab_size, block_size, tied_head=tied_head)
        return fits(memory(spec, train, layout, cluster), cluster, margin)

    lo, hi = 0, 1
    while hi <= max_layers and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_layers + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    if lo == 0:
        return 0, None
    return lo, gpt_spec(lo, n_embd, n_head, vocab_size, block_size, tied_head=tied_head)


def format_table(rows: list[dict], cluster: Cluster) -> str:
    """A markdown table of the rows, GiB per GPU by item and per host."""
    short = {"optimizer_state": "optim", "gathered_units": "gathered", "activations": "act", "cuda_context": "ctx"}
    head = ["config", "fits", "GPU GiB"] + [short.get(i, i) for i in DEVICE_ITEMS] + ["host GiB/node", "step s",
                                                                                     "tokens/s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["config"], "yes" if r["fits"] else "no", f"{r['device_total_bytes'] / GIB:.2f}"]
        cells += [f"{r['device_bytes'][i] / GIB:.2f}" for i in DEVICE_ITEMS]
        cells += [f"{r['host_bytes_per_node'] / GIB:.1f}", f"{r['predicted_step_s']:.3f}", f"{r['tokens_per_s']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_for_json(rows: list[dict]) -> list[dict]:
    """The rows with plain types (bytes per item, per GPU and per host)."""
    out = []
    for r in rows:
        row = {k: v for k, v in r.items() if k != "step"}
        row["host_items"] = list(HOST_ITEMS)
        row["step_breakdown"] = {k: v for k, v in r["step"].items()}
        out.append(row)
    return out

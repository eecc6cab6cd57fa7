"""``ZeroStrategy(stage="auto")``: the planner picks the configuration at setup, before anything is sharded.

The model (on the meta device, or already built) is measured as :func:`~zeroshard.plan.model_spec.module_spec` sees it,
the cluster is the running job's (:func:`~zeroshard.plan.cluster.from_environment`: its ranks, this GPU's memory or this
host's, this host's available memory; rates from the presets), and the fastest configuration whose device and host
bytes stay under ``1 - margin`` of the memory is chosen. The choice and the runners-up are logged. When nothing fits
with fp32 Adam moments and the user left ``optimizer_state_dtype`` unset, bf16 and then int8 moments are tried, and the
message says which format was chosen and why.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from zeroshard.engine.config import ZeroConfig
from zeroshard.plan.cluster import GIB, Cluster, from_environment
from zeroshard.plan.memory import Training
from zeroshard.plan.model_spec import _default_unit_class, module_spec
from zeroshard.plan.planner import DEFAULT_MARGIN, choose, plan
from zeroshard.sharding.sharded_units import PREFETCH_BUCKET_SIZE

log = logging.getLogger("zeroshard.plan")

# Formats stage="auto" tries in turn when the user did not set optimizer_state_dtype: fp32 first (torch's own
# state), then the fewer bytes (zeroshard.optim.state_format: 8, 4, 2 + 8/2048 bytes per element).
STATE_FORMAT_FALLBACK = (torch.float32, torch.bfloat16, "int8")

AUTO_CHOSEN = ("stage", "offload_optimizer", "offload_params", "shard_group_size", "device_mesh")


def check_auto_settings(settings: dict) -> None:
    """``stage="auto"`` decides these itself: fail at construction when the user set one.

    Raises:
        ValueError: naming the setting.
    """
    for name in AUTO_CHOSEN[1:]:
        if settings.get(name):
            raise ValueError(
                f"ZeroStrategy(stage='auto', {name}={settings[name]!r}): 'auto' chooses {name} itself; drop it, or "
                "give a stage (1, 2 or 3) to set it by hand."
            )


def auto_config(
    module: nn.Module,
    config: ZeroConfig,
    *,
    wrap_policy=None,
    world_size: int,
    local_world_size: int,
    device: str,
    compute_dtype: torch.dtype | None,
    activation_checkpointing: bool = False,
    grad_accum: int = 1,
    options: dict | None = None,
    choose_state_dtype: bool = False,
) -> tuple[ZeroConfig, dict]:
    """The planner's fastest fitting configuration for ``module`` as a :class:`ZeroConfig` (other settings kept).

    Args:
        config: the user's settings (its stage, offload and shard group size are replaced).
        wrap_policy: the user's stage-3 units, or None (the repeated block class, as the planner detects it).
        options: ``margin`` (default 0.1), ``micro_batch`` (1), ``seq_len`` (the model's, else 1024) and ``cluster``
            (a :class:`~zeroshard.plan.cluster.Cluster` instead of the detected one).
        choose_state_dtype: the user left ``optimizer_state_dtype`` unset and every optimizer is a fused-capable
            Adam: when no configuration fits with fp32 moments, try bf16, then int8 (:data:`STATE_FORMAT_FALLBACK`),
            and keep the first format with which one fits (said in the message).

    Returns:
        ``(config, report)``: report holds ``choice``, ``runners_up``, every row (of the format chosen),
        ``state_dtype`` and ``message``.

    Raises:
        ValueError: if no configuration fits (in any format tried), with the smallest one's bytes and the memory
            there is.
    """
    options = dict(options or {})
    margin = options.pop("margin", DEFAULT_MARGIN)
    cluster: Cluster = options.pop("cluster", None) or from_environment(world_size, local_world_size, device)
    policy = wrap_policy if wrap_policy is not None else _default_unit_class(module)
    spec = module_spec(module, policy, seq_len=options.pop("seq_len", None))
    base = Training(
        micro_batch=options.pop("micro_batch", 1),
        grad_accum=grad_accum,
        compute_dtype=compute_dtype or torch.float32,
        reduce_dtype=config.reduce_dtype or torch.float32,
        optimizer_state_dtype=config.optimizer_state_dtype,
        activation_checkpointing=activation_checkpointing,
        reduce_bucket_size=config.reduce_bucket_size,
        allgather_bucket_size=config.allgather_bucket_size,
        prefetch_bucket_size=PREFETCH_BUCKET_SIZE
        if config.prefetch_bucket_size is None
        else config.prefetch_bucket_size,
        max_inflight_buckets=config.max_inflight_buckets,
        offload_chunk_size=config.offload_chunk_size,
        align_bytes=config.align_bytes,
    )
    if options:
        raise ValueError(f"ZeroStrategy(plan_options=...): unknown keys {sorted(options)}")
    formats = [config.optimizer_state_dtype]
    if choose_state_dtype and config.optimizer_state_dtype == torch.float32:
        formats = list(STATE_FORMAT_FALLBACK)
    for fmt in formats:
        rows = plan(spec, dataclasses.replace(base, optimizer_state_dtype=fmt), cluster, margin)
        best, runners = choose(rows)
        if best is not None:
            break
        if fmt == formats[0]:
            first_smallest = min(rows, key=lambda r: r["device_total_bytes"])
    if best is None:
        smallest = min(rows, key=lambda r: r["device_total_bytes"])
        tried = f" even with optimizer_state_dtype={fmt!r}" if len(formats) > 1 else ""
        raise ValueError(
            f"ZeroStrategy(stage='auto'): no configuration of {spec.name} ({spec.num_params / 1e9:.3f}B parameters) "
            f"fits {world_size} ranks with a {margin:.0%} margin{tried}: the smallest, {smallest['config']}, needs "
            f"{smallest['device_total_bytes'] / GIB:.2f} GiB per {'GPU' if cluster.device == 'cuda' else 'rank'} and "
            f"{smallest['host_bytes_per_node'] / GIB:.1f} GiB per host, against {cluster.gpu_mem / GIB:.1f} and "
            f"{cluster.host_mem / GIB:.1f} GiB. Use more ranks, activation checkpointing or a smaller model."
        )
    k = best["shard_group_size"]
    chosen = dataclasses.replace(
        config,
        stage=best["stage"],
        offload_optimizer=best["offload_optimizer"],
        offload_params=best["offload_params"],
        shard_group_size=None if k == cluster.world_size else k,
        wrap_policy=policy if best["stage"] == 3 else None,
        # stage-3-only settings mean nothing at the stage 1-2 the planner may choose
        check_gather_order=config.check_gather_order if best["stage"] == 3 else False,
        param_persistence_threshold=config.param_persistence_threshold if best["stage"] == 3 else 0,
        prefetch_bucket_size=config.prefetch_bucket_size if best["stage"] == 3 else None,
        optimizer_state_dtype=fmt,
    )
    message = f"zeroshard stage='auto' chose {best['config']}"
    if fmt != formats[0]:
        where = "GPU" if cluster.device == "cuda" else "rank"
        message += (
            f" with optimizer_state_dtype={fmt!r}, because no configuration fits with fp32 Adam moments (the smallest,"
            f" {first_smallest['config']}, needs {first_smallest['device_total_bytes'] / GIB:.2f} GiB per {where} and"
            f" {first_smallest['host_bytes_per_node'] / GIB:.1f} GiB per host; set optimizer_state_dtype to choose "
            "the format yourself)"
        )
    message += f": predicted {best['predicted_step_s']:.4f} s/step, " + (
        f"{best['device_total_bytes'] / GIB:.2f} GiB per rank on the device, {best['host_bytes_per_node'] / GIB:.1f} "
        f"GiB per host (margin {margin:.0%})"
    )
    if runners:
        message += "; runners-up: " + ", ".join(f"{r['config']} ({r['predicted_step_s']:.4f} s)" for r in runners)
    log.info(message)
    report = {"choice": best, "runners_up": runners, "rows": rows, "state_dtype": fmt, "message": message}
    return chosen, report

"""Predicted seconds per optimizer step for one configuration, overlapped the way zeroshard's engine overlaps.

Pieces (per rank; ``k`` ranks per shard group, ``R`` groups):

* compute: FLOPs per token 6 (P - lookup tables) + 6 L h s (causal attention; Kaplan et al. 2020's 2N forward,
  tripled for training), 8/6 of that with activation checkpointing, at ``cluster.flops``;
* collectives: the bytes each rank sends, as ``engine.comm_stats()`` counts them (ring volume; section 2 of issue 12 and
  ``benchmarks/bench_comm_volume.py`` check them against the engine), over nccl-tests bus bandwidth, plus
  (N - 1) ring steps of latency per collective. A group inside one node runs at ``intra_busbw``, one that spans
  nodes at ``inter_busbw``;
* optimizer: on the device, (28 + p) bytes per shard element at ``hbm_bw``; with offload, 28 bytes per element at
  this rank's share of the host's fused CPU Adam rate, overlapped with the chunked host-to-device upload.

Overlap, as the engine does it: stage 3's all-gathers are prefetched one unit ahead (forward and backward), so they
hide behind compute except the first unit of each pass; gradient reduce-scatters run during backward (only the last
bucket's is exposed); the cross-group all-reduce of hybrid sharding runs on its own process group; stages 1-2
all-gather the updated parameters after the step and wait for it; the host step of optimizer offload runs after
backward. Gradient accumulation reduces once per step (stages 1-2 skip communication on the other micro-batches).
"""

from __future__ import annotations

import math

from zeroshard.plan.cluster import Cluster
from zeroshard.plan.memory import FlatPlan, Layout, Training
from zeroshard.plan.model_spec import ModelSpec
from zeroshard.sharding.gather_check import TAG_ELEMS

ADAM_BYTES = 28  # bytes per element one Adam step reads and writes (master, grad, m, v; benchmarks/bench_cpu_adam.py)


def flops_per_token(spec: ModelSpec, train: Training) -> float:
    """Training FLOPs per token: forward + backward (twice the forward) + the recomputed forward with activation
    checkpointing."""
    passes = 4 if train.activation_checkpointing else 3
    return passes * spec.forward_flops_per_token(train.seq_len or spec.seq_len)


def _link(cluster: Cluster, ranks_spanned: int) -> tuple[float, float]:
    """(busbw, latency per ring step) of a group whose consecutive members lie ``ranks_spanned`` ranks apart at
    most: inside one node if it fits in one."""
    if cluster.nodes == 1 or ranks_spanned <= cluster.gpus_per_node:
        return cluster.intra_busbw, cluster.intra_latency
    return cluster.inter_busbw, cluster.inter_latency


def _ring(bytes_sent: float, n: int, calls: int, link: tuple[float, float]) -> float:
    if n <= 1 or calls == 0:
        return 0.0
    busbw, latency = link
    return bytes_sent / busbw + calls * (n - 1) * latency


def step_time(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster, fp: FlatPlan | None) -> dict:
    """Seconds per optimizer step and its parts (see the module docstring).

    Returns:
        ``{"step_s", "compute_s", "optimizer_s", "exposed_comm_s", "comm_bytes": {kind: bytes per rank per step},
        "comm_s": {kind: seconds}, "tokens_per_s"}`` (tokens per second over all ranks).
    """
    world = cluster.world_size
    p, g = train.compute_dtype.itemsize, train.reduce_dtype.itemsize
    s, b, acc = train.seq_len or spec.seq_len, train.micro_batch, train.grad_accum
    fwd = spec.forward_flops_per_token(s) * s * b / cluster.flops
    bwd = fwd * (3 if train.activation_checkpointing else 2)  # the recomputed forward runs in backward
    compute = acc * (fwd + bwd)
    comm_bytes, comm_s = {}, {}

    if layout.stage == "ddp":
        n = world
        data = 2 * 4.0 * spec.trainable * (n - 1) / n
        calls = max(1, math.ceil(4.0 * spec.trainable / 25e6))
        comm_bytes["all_reduce"] = data
        comm_s["all_reduce"] = _ring(data, n, calls, _link(cluster, n))
        exposed = max(0.0, comm_s["all_reduce"] - bwd) + comm_s["all_reduce"] / calls
        optimizer = (ADAM_BYTES + 4) * spec.trainable / cluster.hbm_bw
        step = compute + exposed + optimizer
        return _result(step, compute, optimizer, exposed, comm_bytes, comm_s, s * b * acc * world)

    k = fp.k
    r = world // k
    shard_link, cross_link = _link(cluster, k), _link(cluster, world if r > 1 else 1)
    padded = fp.trainable_numel
    shard_t = padded // k
    n_flat = len(fp.reductions)  # reduce-scatters per step (stage 3: one per unit)
    rs_bytes = g * padded * (k - 1) / k
    rs = _ring(rs_bytes, k, n_flat, shard_link)
    shard_dtype = g if layout.offload_optimizer else 4
    ar_bytes = 2 * shard_dtype * shard_t * (r - 1) / r
    ar = _ring(ar_bytes, r, n_flat, cross_link)
    tail = (rs + ar) / max(1, n_flat)  # the last bucket's reduction, after backward's compute
    if layout.stage == 3:
        units = [fp.root] + fp.units
        # each unit all-gather also carries the unit's tag, TAG_ELEMS elements per rank
        # (zeroshard.sharding.gather_check)
        ag_fwd_bytes = p * (sum(units) + TAG_ELEMS * k * len(units)) * (k - 1) / k
        # the last unit of the forward stays gathered into backward, which starts with it: no second gather
        bwd_units = fp.units[:-1]
        ag_bwd_bytes = p * (sum(bwd_units) + TAG_ELEMS * k * len(bwd_units)) * (k - 1) / k
        ag_fwd = _ring(ag_fwd_bytes, k, len(units), shard_link)
        ag_bwd = _ring(ag_bwd_bytes, k, len(bwd_units), shard_link)
        if layout.offload_params:  # host shard -> device before each gather, on the same side stream
            ag_fwd += p * sum(units) / k / cluster.pcie_bw
            ag_bwd += p * sum(bwd_units) / k / cluster.pcie_bw
        first = ag_fwd / max(1, len(units))  # the first unit of each pass is not hidden
        mb_fwd = max(fwd, ag_fwd) + first
        mb_bwd_plain = max(bwd, ag_bwd) + first
        mb_bwd_last = max(bwd, ag_bwd + rs, ar) + first + tail
        comm_bytes["all_gather"] = acc * (ag_fwd_bytes + ag_bwd_bytes)
        comm_s["all_gather"] = acc * (ag_fwd + ag_bwd)
        after = 0.0
    else:
        mb_fwd = fwd
        mb_bwd_plain = bwd
        mb_bwd_last = max(bwd, rs, ar) + tail
        ag_bytes = p * padded * (k - 1) / k
        calls = max(1, math.ceil(padded / train.allgather_bucket_size))
        after = _ring(ag_bytes, k, calls, shard_link)
        comm_bytes["all_gather"] = ag_bytes
        comm_s["all_gather"] = after
    comm_bytes["reduce_scatter"], comm_s["reduce_scatter"] = rs_bytes, rs
    comm_bytes["all_reduce"], comm_s["all_reduce"] = ar_bytes, ar
    if layout.offload_optimizer:
        cpu = ADAM_BYTES * shard_t / (cluster.cpu_adam_bw / cluster.gpus_per_node)
        upload = 0.0 if layout.offload_params else p * shard_t / cluster.pcie_bw
        chunk = min(shard_t, train.offload_chunk_size)
        optimizer = max(cpu, upload) + p * chunk / cluster.pcie_bw
    else:
        optimizer = (ADAM_BYTES + (p if p != 4 else 0)) * shard_t / cluster.hbm_bw
    step = (acc - 1) * (mb_fwd + mb_bwd_plain) + mb_fwd + mb_bwd_last + optimizer + after
    exposed = step - compute - optimizer
    return _result(step, compute, optimizer, exposed, comm_bytes, comm_s, s * b * acc * world)


def _result(step, compute, optimizer, exposed, comm_bytes, comm_s, tokens) -> dict:
    return {
        "step_s": step,
        "compute_s": compute,
        "optimizer_s": optimizer,
        "exposed_comm_s": exposed,
        "comm_bytes": comm_bytes,
        "comm_s": comm_s,
        "tokens_per_s": tokens / step,
    }

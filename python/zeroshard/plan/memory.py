"""Bytes per GPU and per host for one configuration, itemised, as zeroshard's engine allocates them.

Every item follows the engine's buffers (``docs/architecture.md``), with flat parameters padded exactly as
``_C.FlatParamLayout`` pads them (stages 1-2: buckets of ``reduce_bucket_size`` elements in reverse registration order;
stage 3: one flat parameter per unit, plus one for its frozen parameters):

==================  ====================================================================================================
params              compute-dtype parameters: whole at stages 1-2, this rank's shard at stage 3 (on the host with
                    parameter offload)
grads               stage 1: the whole gradient buffer (kept) + the fp32 gradient shard; stages 2-3: the fp32 shard;
                    with optimizer offload the shard lives on the host
master              fp32 master shard, when it does not alias the parameter shard (compute dtype is not fp32)
optimizer_state     Adam's exp_avg and exp_avg_sq shards (8 bytes per element; bf16 4, int8 2 + 8 per 2048; under
                    int8 the parameters below ``min_8bit_size`` sit in flat parameters of their own with fp32 moments,
                    as the engine builds them: ``optim/small_state.py``); Muon's momentum shard for
                    ``Training.muon_shapes`` (4 bytes per element, plan/muon_memory.py)
buckets             the largest transient: gradient buckets in flight during backward (max_inflight + 1 full
                    buffers at stages 2-3), autograd's gradient of the largest parameter before the hook takes it, the
                    all-gather staging of several flat parameters after the step; with offload on a GPU, the gradient
                    shards the device-to-host queue still holds (more when backward outruns PCIe)
gathered_units      stage 3: the root unit (kept through the step), the current unit and the prefetched units whole (the
                    next one, or the largest group of consecutive units within ``prefetch_bucket_size``)
activations         saved for backward per micro-batch, a pre-LayerNorm transformer with SDPA (flash attention: no
                    s^2 term, its output is the projection's input): per layer (8 h + 2 f) s b elements (two norm
                    inputs, the qkv projection's input and output, the output projection's input, the MLP's input
                    and its two f-wide activations; 4 f for a gated MLP), only each layer's input with activation
                    checkpointing plus one layer recomputed; and the logits (compute dtype, fp32 copy, log-softmax,
                    its gradient). Korthikanti et al. 2022 count 34 s b h bytes per layer in 16 bits with two
                    dropout masks and without flash attention; this is 32 s b h for f = 4 h
step_temp           temporaries of the device optimizer step (torch's foreach AdamW: two shard-sized tensors; with
                    Muon, the larger of that and the busiest owner's whole-matrix buffers, plan/muon_memory.py)
comm_temp           the backend's own copies: on gloo the reduce-scatter's all-to-all receives into a full-size buffer
                    and sums the chunks there (1 x the bucket), and all-gather goes through a full-size copy; 0 on NCCL
                    (in place)
cuda_context        CUDA context and library workspaces (0 on CPU)
==================  ====================================================================================================

The items do not all live at once: the device total is the largest sum over five phases, each on top of the resident
state (params, grads, master, optimizer state, context): the start of backward (every activation and the logits), the
backward walked bucket by bucket (a bucket's gradient buffer appears once backward reaches it, by when the activations
after it are freed), the last reductions, the optimizer step and the post-step all-gather.

Host, per rank: the process baseline, and with offload exactly what :func:`zeroshard.offload.offload.host_bytes_needed`
allocates (fp32 master, Adam state, gradient shard in the reduce dtype, parameter shard with parameter offload, two
upload buffers). ``"ddp"`` models torch DDP with autocast: fp32 parameters and gradients, DDP's bucket copy of the
gradients, full Adam state, and autocast's compute-dtype copies of the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zeroshard import _C
from zeroshard.ops import QUANT_BLOCK
from zeroshard.plan.cluster import Cluster
from zeroshard.plan.model_spec import ModelSpec, Shape, _numel
from zeroshard.plan.muon_memory import muon_step_bytes
from zeroshard.sharding.sharded_units import PREFETCH_BUCKET_SIZE

DEVICE_ITEMS = ("params", "grads", "master", "optimizer_state", "buckets", "comm_temp", "gathered_units", "activations",
                "step_temp", "cuda_context")  # fmt: skip
HOST_ITEMS = ("baseline", "params", "grads", "master", "optimizer_state", "pinned_buffers")


@dataclass(frozen=True)
class Training:
    """How the model is trained (defaults: zeroshard's ZeroConfig defaults, AdamW, bf16 compute, fp32 reduction).

    ``optimizer_state_bytes``: bytes of optimizer state per trainable element (Adam's fp32 moments: 8), used unless
    ``optimizer_state_dtype`` names the fused Adam's state format (``ZeroConfig.optimizer_state_dtype``):
    ``torch.float32`` 8 bytes per element, ``torch.bfloat16`` 4, ``"int8"`` 2 plus one fp32 absmax per moment and
    started block of 2048 elements of each shard (:func:`optimizer_state_bytes`); under int8, parameters of fewer
    than ``min_8bit_size`` elements (``CPUAdam``'s default, bitsandbytes' 4096) go into flat parameters of their own
    with fp32 moments, as the engine does. Raises ValueError for another value.
    """

    micro_batch: int = 1
    seq_len: int | None = None  # default: the model's
    grad_accum: int = 1
    compute_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    activation_checkpointing: bool = False
    optimizer_state_bytes: int = 8
    optimizer_state_dtype: object = None
    min_8bit_size: int = 4096
    reduce_bucket_size: int = 25_000_000
    allgather_bucket_size: int = 25_000_000
    prefetch_bucket_size: int = PREFETCH_BUCKET_SIZE
    max_inflight_buckets: int = 2
    offload_chunk_size: int = 4 * 1024 * 1024
    align_bytes: int = 64
    muon_shapes: tuple = ()  # shapes of the matrices torch.optim.Muon steps (the rest: Adam), see plan/muon_memory.py

    def __post_init__(self) -> None:
        if self.optimizer_state_dtype is not None and not any(
            type(self.optimizer_state_dtype) is type(f) and self.optimizer_state_dtype == f for f in _STATE_FORMATS
        ):
            raise ValueError(
                f"Training(optimizer_state_dtype={self.optimizer_state_dtype!r}): use None (optimizer_state_bytes), "
                "torch.float32, torch.bfloat16 or 'int8'"
            )


_STATE_FORMATS = (torch.float32, torch.bfloat16, "int8")


def optimizer_state_bytes(train: Training, shards: list[int]) -> float:
    """Bytes of optimizer state over trainable tensors of ``shards`` elements each (flat shards, or one whole
    model): ``train.optimizer_state_bytes`` per element, or by ``train.optimizer_state_dtype``: fp32 8, bf16 4, int8
    ``2 * n + 8 * ceil(n / 2048)`` per tensor of ``n`` (uint8 codes of both moments and their fp32 block absmax)."""
    fmt = train.optimizer_state_dtype
    if fmt is None:
        return float(train.optimizer_state_bytes * sum(shards))
    if fmt == "int8":
        return float(sum(2 * n + 8 * -(-n // QUANT_BLOCK) for n in shards))
    return float(2 * fmt.itemsize * sum(shards))


def muon_adam_state_bytes(train: Training, k: int) -> float:
    """Bytes of Adam state the Muon matrices' elements (``train.muon_shapes``) would keep in one rank's shard (of
    ``k``) under ``train``'s state format: what Muon's fp32 momentum replaces. Muon's momentum is fp32 whatever the
    format (torch.optim.Muon's ``momentum_buffer``; ``optimizer_state_dtype`` applies to the fused Adam only), so with
    bf16 or int8 Adam state Muon adds bytes where with fp32 it saves them. Under int8, matrices of fewer than
    ``min_8bit_size`` elements would keep fp32 moments (8 bytes)."""
    numels = [int(s[0]) * int(s[1]) for s in train.muon_shapes]
    small = [n for n in numels if train.optimizer_state_dtype == "int8" and n < train.min_8bit_size]
    large = sum(numels) - sum(small)
    return optimizer_state_bytes(train, [-(-large // k)]) + 8.0 * -(-sum(small) // k)


@dataclass(frozen=True)
class Layout:
    """One configuration: ZeRO stage (or ``"ddp"``), offload, and the shard group size (``None``: every rank)."""

    stage: int | str
    offload_optimizer: bool = False
    offload_params: bool = False
    shard_group_size: int | None = None

    def label(self, world: int) -> str:
        if self.stage == "ddp":
            return "ddp"
        name = f"stage{self.stage}"
        if self.offload_optimizer:
            name += "+offload"
        if self.offload_params:
            name += "+params"
        k = self.shard_group_size or world
        if k != world:
            name += f" hybrid {k}x{world // k}"
        return name


@dataclass
class FlatPlan:
    """Padded sizes (elements) of the flat parameters one configuration builds, for a shard group of ``k``."""

    k: int
    trainable: list[int]  # padded numel per trainable flat parameter
    frozen: list[int]  # padded numel per frozen flat parameter (stage 3), or plain numel (stages 1-2, unsharded)
    root: int  # stage 3: padded numel of the root unit's flat parameters (trainable + frozen)
    units: list[int]  # stage 3: padded numel per non-root unit (trainable + frozen)
    largest_param: int
    fp32_state: list[bool] | None = None  # per trainable flat parameter: fp32 moments (int8 state's small tensors)
    # stage 3: per unit with trainable flat parameters (unit order), their padded numel together (one reduce-scatter
    # each, GradReducer's groups) and whether there are several (their gradients are copied into one staging buffer)
    groups: list[int] | None = None
    staged: list[bool] | None = None

    @property
    def reductions(self) -> list[int]:
        """Padded numel per reduce-scatter of a step, in launch order."""
        return self.groups if self.groups is not None else self.trainable

    @property
    def trainable_numel(self) -> int:
        return sum(self.trainable)

    def shard(self, numel: int) -> int:
        return numel // self.k

    def state_bytes(self, train: Training) -> float:
        """Optimizer state bytes of this rank's trainable shards: :func:`optimizer_state_bytes`, with 8 per element
        for the flat parameters that keep fp32 moments."""
        small = self.fp32_state or [False] * len(self.trainable)
        shards = [self.shard(n) for n in self.trainable]
        fp32 = sum(s for s, f in zip(shards, small) if f)
        return optimizer_state_bytes(train, [s for s, f in zip(shards, small) if not f]) + 8.0 * fp32


def _padded(shapes: list[Shape], k: int, align: int) -> int:
    if not shapes:
        return 0
    return _C.FlatParamLayout([list(s) for s in shapes], k, align).padded_numel


def flat_plan(spec: ModelSpec, train: Training, layout: Layout, world: int) -> FlatPlan:
    k = layout.shard_group_size or world
    align = max(1, train.align_bytes // train.compute_dtype.itemsize)
    shapes = spec.trainable_shapes()
    largest = max((_numel(s) for s in shapes), default=0)
    # int8 state: the engine's apart rule (optim/small_state.py): parameters under min_8bit_size in flat parameters
    # of their own, which keep fp32 moments
    split = train.optimizer_state_dtype == "int8"

    def small(shape: Shape) -> bool:
        return split and _numel(shape) < train.min_8bit_size

    if layout.stage == 3:
        trainable, fp32_state, root = [], [], 0
        units, groups, staged = [], [], []
        for i, u in enumerate(spec.units):
            parts = [[s for s in u.shapes if not small(s)], [s for s in u.shapes if small(s)]]
            flats = [(_padded(part, k, align), is_small) for part, is_small in zip(parts, (False, True)) if part]
            trainable += [n for n, _ in flats]
            fp32_state += [is_small for _, is_small in flats]
            if flats:
                groups.append(sum(n for n, _ in flats))
                staged.append(len(flats) > 1)
            total = sum(n for n, _ in flats) + _padded(u.frozen, k, align)
            if i == 0:
                root = total
            else:
                units.append(total)
        frozen = [f for f in (_padded(u.frozen, k, align) for u in spec.units) if f]
        return FlatPlan(k, trainable, frozen, root, units, largest, fp32_state, groups, staged)
    # the engine's plan_buckets: reverse registration order, one open bucket per kind (set apart or not), each cut at
    # reduce_bucket_size
    buckets: list[tuple[list[Shape], bool]] = []
    open_bucket: dict[bool, int] = {}  # kind -> index of its open bucket in buckets
    sizes: list[int] = []
    for s in reversed(shapes):
        key, n = small(s), _numel(s)
        i = open_bucket.get(key)
        if i is None or sizes[i] + n > train.reduce_bucket_size:
            i = open_bucket[key] = len(buckets)
            buckets.append(([], key))
            sizes.append(0)
        buckets[i][0].append(s)
        sizes[i] += n
    frozen = [sum(u.frozen_numel for u in spec.units)]
    return FlatPlan(k, [_padded(b, k, align) for b, _ in buckets], frozen, 0, [], largest, [f for _, f in buckets])


def _allgather_staging(sizes: list[int], bucket_elems: int) -> int:
    """Largest staging buffer (elements) of a bucketed all-gather: only buckets of several tensors are staged."""
    best, begin_size, count = 0, 0, 0
    for n in sizes:
        if count and begin_size + n > bucket_elems:
            if count > 1:
                best = max(best, begin_size)
            begin_size, count = 0, 0
        begin_size += n
        count += 1
    return max(best, begin_size) if count > 1 else best


def _prefetch_group(units: list[int], bucket: int) -> int:
    """Elements of the largest stage-3 prefetch (ShardedUnits._prefetch): consecutive units after the first (forward)
    or before the last (backward), one collective while their sum fits ``bucket``, at least one unit each."""
    largest = max(units, default=0)
    for run in (units[1:], units[-2::-1]):
        total = 0
        for n in run:
            if total and total + n > bucket:
                total = 0
            total += n
            largest = max(largest, total)
    return largest


def activation_bytes(spec: ModelSpec, train: Training) -> float:
    """Bytes saved for backward per micro-batch, with the logits' at the start of backward (module docstring)."""
    return sum(_activations(spec, train))


def _activations(spec: ModelSpec, train: Training) -> tuple[float, float]:
    """(the layers' saved activations, the embedding / head / logits part)."""
    e = train.compute_dtype.itemsize
    s, b, h, f, a = train.seq_len or spec.seq_len, train.micro_batch, spec.hidden, spec.ffn, spec.n_head
    sb = s * b
    per_layer = e * sb * (8 * h + (4 if spec.gated_mlp else 2) * f) + 4 * sb * (4 + a)  # + LN stats, logsumexp
    if train.activation_checkpointing:
        layers = spec.n_layer * e * sb * h + per_layer
    else:
        layers = spec.n_layer * per_layer
    head = 3 * e * sb * h + sb * spec.vocab * (e + (4 if e < 4 else 0) + 4 + 4)
    return float(layers), float(head)


def memory(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster) -> dict:
    """Itemised bytes per rank on its device and on its host, and per node.

    Returns:
        ``{"device": {item: bytes}, "host": {item: bytes}, "device_total", "host_total" (per rank),
        "host_per_node", "flat": FlatPlan}``.
    """
    world = cluster.world_size
    p, g = train.compute_dtype.itemsize, train.reduce_dtype.itemsize
    dev = dict.fromkeys(DEVICE_ITEMS, 0.0)
    host = dict.fromkeys(HOST_ITEMS, 0.0)
    host["baseline"] = cluster.host_baseline
    dev["activations"] = activation_bytes(spec, train)
    dev["cuda_context"] = cluster.context_bytes if cluster.device == "cuda" else 0.0
    if layout.stage == "ddp":
        n = spec.trainable
        dev["params"] = 4.0 * spec.num_params
        dev["grads"] = 8.0 * n  # .grad and DDP's bucket copy (gradient_as_bucket_view=False)
        dev["optimizer_state"] = optimizer_state_bytes(train, [n])
        dev["gathered_units"] = float(p * spec.num_params) if p < 4 else 0.0  # autocast's weight copies
        return _totals(dev, host, cluster, None)

    fp = flat_plan(spec, train, layout, world)
    k = fp.k
    shard_t = sum(fp.shard(n) for n in fp.trainable)
    off, op = layout.offload_optimizer, layout.offload_params
    gloo = cluster.device == "cpu"
    inflight = train.max_inflight_buckets + 1
    # reductions launch in flat-parameter order at stages 1-2, in reverse unit order (root last) at stage 3
    last = fp.trainable[:inflight] if layout.stage == 3 else fp.trainable[-inflight:]
    reductions = list(zip(fp.reductions, fp.staged or [False] * len(fp.reductions)))
    last_reductions = reductions[:inflight] if layout.stage == 3 else reductions[-inflight:]
    param_grad = p * fp.largest_param  # autograd's .grad before the hook moves it into the bucket

    if off and cluster.device == "cuda":
        # offload: a gradient shard stays on the device until its copy to the host is done; when backward produces
        # them faster than PCIe drains them, the copy queue holds several (offload.py: "the queue holds it")
        s = train.seq_len or spec.seq_len
        bwd_per_flat = 2 * spec.forward_flops_per_token(s) * s * train.micro_batch / cluster.flops / len(fp.trainable)
        copy = g * fp.shard(max(fp.trainable)) / cluster.pcie_bw
        queued = min(len(fp.trainable), inflight + math.ceil(copy / max(bwd_per_flat, 1e-12)))
    else:
        queued = inflight

    def shards(flats: list[int]) -> float:  # offload: device gradient shards until their copy to the host is done
        return g * sum(fp.shard(n) for n in flats) if off else 0.0

    def rs_temp(reds: list[tuple[int, bool]]) -> float:
        # gloo: an all-to-all into a full-size buffer, summed there in place; a unit of several flat parameters
        # (stage 3) first copies their gradients into one staging buffer, on any backend
        return max((g * n * (int(gloo) + int(staged)) for n, staged in reds), default=0.0)

    gathered = 0.0
    if layout.stage == 3:
        shard_all = shard_t + sum(fp.shard(n) for n in fp.frozen)
        dev["params"] = 0.0 if op else float(p * shard_all)
        biggest = max(fp.units, default=0)
        prefetched = biggest if op else _prefetch_group(fp.units, train.prefetch_bucket_size)
        gathered = float(p * (fp.root + biggest + prefetched) + (2 * p * biggest // k if op else 0))
        dev["gathered_units"] = gathered
        tail = g * sum(last) + shards(last)
        staging = 0.0
    else:
        dev["params"] = float(p * (fp.trainable_numel + sum(fp.frozen)))
        if layout.stage == 1:
            dev["grads"] += g * fp.trainable_numel  # the whole gradient buffer, kept between steps
            tail = shards(last)
        else:
            tail = g * sum(last) + shards(last)
        staging = p * _allgather_staging(fp.trainable, train.allgather_bucket_size)
    if not off:
        dev["grads"] += 4.0 * shard_t
        dev["optimizer_state"] = fp.state_bytes(train)
        if p != 4:
            dev["master"] = 4.0 * shard_t
        dev["step_temp"] = 2 * 4.0 * shard_t  # torch's foreach AdamW: the denominator and the update
        if train.muon_shapes:  # Muon: 4 bytes of fp32 momentum where Adam keeps its format, and its step's transients
            muon = muon_step_bytes(train.muon_shapes, k)
            dev["optimizer_state"] += muon["momentum"] - muon_adam_state_bytes(train, k)
            dev["step_temp"] = max(dev["step_temp"], muon["step_temp"])
    else:
        host["master"] = 4.0 * shard_t
        host["optimizer_state"] = fp.state_bytes(train)
        host["grads"] = float(g * shard_t)
        host["pinned_buffers"] = 2.0 * train.offload_chunk_size * 4
        if op:
            host["params"] = float(p * (shard_t + sum(fp.shard(n) for n in fp.frozen)))
    # Backward, walked bucket by bucket in launch order: a bucket's full gradient buffer appears when backward reaches
    # its first parameter, by which point the activations of what came after it are freed; the logits' part only
    # lives at the start, before any bucket.
    layers_act, head_act = _activations(spec, train)
    order = list(reversed(fp.trainable)) if layout.stage == 3 else list(fp.trainable)
    total = max(1, sum(order))
    # On CPU a fresh full gradient buffer takes memory page by page as its gradients are copied in (it is never
    # zero-filled, FlatParam.accumulate_grad), while its part of the activations is freed: either end of a bucket's
    # backward is its peak. A device's allocator hands the whole buffer out at once.
    paged = cluster.device == "cpu"
    backward, walk, done = param_grad, 0.0, 0
    pending = 0.0 if off else 4.0 * sum(fp.shard(m) for m in order)  # gradient shards not reduced yet (below)
    for j, n in enumerate(order):
        full = g * sum(order[max(0, j - inflight + 1) : j + 1]) if layout.stage != 1 else 0.0
        held = full + shards(order[max(0, j - queued + 1) : j])  # earlier shards still queued for the host
        # gradient shards are allocated by their reduction (fresh after every step): those not reduced yet (this
        # bucket's and later ones) take nothing (counted in dev["grads"] for the whole step otherwise)
        if paged and layout.stage != 1:
            start = layers_act * (1 - done / total) + held - g * n
            walk = max(walk, start - pending, layers_act * (1 - (done + n) / total) + held - pending)
        else:
            walk = max(walk, layers_act * (1 - done / total) + held - pending)
        backward = max(backward, held + param_grad)
        done += n
        if not off:
            pending -= 4.0 * fp.shard(n)
    comm_temp_backward = rs_temp(reductions) if len(reductions) > 1 else 0.0
    if gloo and layout.stage == 3:  # the next unit's all-gather (prefetch) runs through gloo's full-size copy
        comm_temp_backward += p * max(fp.units, default=0)
    ag_temp = p * max(fp.trainable, default=0) if gloo and layout.stage != 3 else 0.0  # gloo's all-gather copy
    dev["buckets"] = float(max(backward, tail, staging))
    dev["comm_temp"] = float(max(comm_temp_backward, rs_temp(last_reductions), ag_temp))
    resident = sum(dev[i] for i in ("params", "grads", "master", "optimizer_state", "cuda_context"))
    phases = {
        "backward_start": resident + gathered + layers_act + head_act + param_grad - (0.0 if off else 4.0 * shard_t),
        "backward": resident + gathered + walk + param_grad + comm_temp_backward,
        "last_reduction": resident + p * fp.root + tail + rs_temp(last_reductions),
        "optimizer_step": resident + dev["step_temp"],
        "after_step": resident + staging + ag_temp,
    }
    return _totals(dev, host, cluster, fp, phases)


def _totals(dev: dict, host: dict, cluster: Cluster, fp: FlatPlan | None, phases: dict | None = None) -> dict:
    phases = phases or {"step": sum(dev.values())}
    dt, ht = max(phases.values()), sum(host.values())
    return {
        "device": dev,
        "host": host,
        "phases": phases,
        "device_total": dt,
        "host_total": ht,
        "host_per_node": ht * cluster.gpus_per_node + (dt * cluster.gpus_per_node if cluster.device == "cpu" else 0),
        "flat": fp,
    }


def fits(mem: dict, cluster: Cluster, margin: float) -> bool:
    """Device and host totals within ``(1 - margin)`` of the cluster's memory (on CPU: both on the host)."""
    host_ok = mem["host_per_node"] <= (1 - margin) * cluster.host_mem
    if cluster.device == "cpu":
        return host_ok
    return host_ok and mem["device_total"] <= (1 - margin) * cluster.gpu_mem

"""The machines a plan is for: memory per GPU and per host, and the rates the step-time model uses.

Presets hold vendor figures (memory sizes, peak FLOP/s, link rates) and the few measured rates we have; everything
else is an assumption, named in the preset's ``notes`` and overridable from the command line. Units: bytes, bytes/s,
FLOP/s, seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

GIB = 2**30
GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster.

    Attributes:
        gpus_per_node, nodes: ranks per host and hosts.
        gpu_mem: usable device memory per GPU, bytes (``torch.cuda.mem_get_info`` total).
        host_mem: host memory per node the job may use, bytes.
        device: ``"cuda"``, or ``"cpu"`` when the ranks compute on the host (then device and host items share
            ``host_mem`` and ``gpu_mem`` is ignored).
        flops: achieved dense FLOP/s per GPU in the compute dtype (peak x an assumed utilisation).
        intra_busbw, inter_busbw: nccl-tests bus bandwidth (bytes/s) of a collective inside one node (NVLink) and of
            one that spans nodes; a ring collective of F bytes per rank then takes F (N-1)/N / busbw (ring volume).
        intra_latency, inter_latency: seconds per ring step (a ring over N ranks has N - 1 steps).
        pcie_bw: host-device copy rate, bytes/s (pinned).
        hbm_bw: device memory bandwidth the optimizer step streams at, bytes/s.
        cpu_adam_bw: fused CPU Adam throughput of one host, bytes/s, counted as benchmarks/bench_cpu_adam.py counts
            (28 bytes per parameter); shared by the ranks of the host.
        context_bytes: device memory the CUDA context and library handles take per GPU.
        host_baseline: host memory of one rank's process before any model state (libraries, CUDA runtime), bytes.
        notes: where each figure comes from.
    """

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_mem: float = 79.1 * GIB
    host_mem: float = 1800 * GIB
    device: str = "cuda"
    flops: float = 400e12
    intra_busbw: float = 360 * GB
    inter_busbw: float = 320 * GB
    intra_latency: float = 2e-6
    inter_latency: float = 6e-6
    pcie_bw: float = 50 * GB
    hbm_bw: float = 0.8 * 3350 * GB
    cpu_adam_bw: float = 106 * GB
    context_bytes: float = 0.6 * GIB
    host_baseline: float = 3 * GIB
    notes: dict = field(default_factory=dict, compare=False)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def with_(self, **changes) -> Cluster:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


H100_NOTES = {
    "gpu_mem": "H100 SXM 80 GB: 79.1 GiB usable (torch total_memory)",
    "host_mem": "2 TB per node (DGX H100); 1800 GiB assumed usable",
    "flops": "assumed 40% of the H100 SXM dense BF16 peak (989 TFLOP/s)",
    "intra_busbw": "assumed 360 GB/s: NVLink 4 ring all-gather / reduce-scatter (450 GB/s per direction, ~80%)",
    "inter_busbw": "one 400 Gb/s NIC per GPU (8 per node, rail-optimised): a ring across nodes moves 8 x 50 GB/s per "
    "node; assumed 80% of it",
    "latency": "assumed 2 us per NVLink ring step, 6 us per network ring step",
    "pcie_bw": "measured 55 GB/s pinned copies on one H100 (benchmarks/results/offload_h100.json); 50 assumed",
    "hbm_bw": "80% of 3.35 TB/s",
    "cpu_adam_bw": "measured: 1.31B-parameter fused CPU Adam step in 0.346 s on the H100 host's 16 vCPUs "
    "(benchmarks/results/offload_h100.json), 28 bytes per parameter",
    "context_bytes": "assumed 0.6 GiB (CUDA context, cuBLAS workspace)",
    "host_baseline": "assumed 3 GiB per rank (torch, CUDA runtime, Lightning, data loader)",
}

PRESETS = {
    "h100": Cluster(notes=H100_NOTES),
    "a100-40gb": Cluster(
        gpu_mem=39.4 * GIB,
        flops=0.4 * 312e12,
        intra_busbw=0.8 * 300 * GB,
        inter_busbw=0.8 * 8 * 25 * GB,
        pcie_bw=25 * GB,
        hbm_bw=0.8 * 1555 * GB,
        host_mem=1024 * GIB,
        notes={
            "gpu_mem": "A100 SXM4 40 GB: 39.4 GiB usable",
            "flops": "assumed 40% of the A100 dense FP16/BF16 peak (312 TFLOP/s)",
            "intra_busbw": "assumed 80% of NVLink 3 (300 GB/s per direction)",
            "inter_busbw": "8 x 200 Gb/s HDR per node, 80%",
            "pcie_bw": "PCIe 4 x16, assumed 25 GB/s",
            "cpu_adam_bw": "the H100 host's measured 106 GB/s (no A100-host measurement)",
        },
    ),
    "cpu": Cluster(
        gpus_per_node=2,
        device="cpu",
        gpu_mem=0,
        flops=20e9,
        intra_busbw=2 * GB,
        inter_busbw=1 * GB,
        intra_latency=50e-6,
        inter_latency=100e-6,
        pcie_bw=10 * GB,
        hbm_bw=10 * GB,
        cpu_adam_bw=10 * GB,
        context_bytes=0,
        host_baseline=0.35 * GIB,
        notes={"all": "a 2-core CPU VM with gloo: rough assumed rates; memory is what the CPU validation checks"},
    ),
}
PRESETS["a100-80gb"] = PRESETS["a100-40gb"].with_(gpu_mem=79.1 * GIB)


def host_memory_available() -> float:
    """``MemAvailable`` of this host, bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def from_environment(world_size: int, local_world_size: int, device: str) -> Cluster:
    """The cluster a running job is on: its ranks, this GPU's memory (or this host's, on CPU) and this host's
    available memory; rates from the ``h100`` preset on CUDA, ``cpu`` otherwise (assumed, see the presets)."""
    import torch

    local = max(1, local_world_size)
    nodes = max(1, world_size // local)
    host = host_memory_available()
    if device == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        base = PRESETS["h100"]
        return base.with_(gpus_per_node=local, nodes=nodes, gpu_mem=float(total), host_mem=host)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return PRESETS["cpu"].with_(gpus_per_node=local, nodes=nodes, host_mem=host, flops=10e9 * cores)

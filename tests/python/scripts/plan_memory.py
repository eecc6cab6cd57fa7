"""Rank worker for the planner's CPU validation: measured against predicted memory, stages 1-3 with and without
optimizer offload.

Usage (2 ranks, started by ``launch.run_ranks`` with ``MALLOC_MMAP_THRESHOLD_`` fixed, so freed buffers leave RSS):
    plan_memory.py OUT_JSON

After one unrecorded warm-up run of the first configuration (one-time process costs), for each configuration: the
examples' GPT (4 x 512, block 64, byte vocabulary, fp32; 12.8M parameters) is built
eagerly and wrapped in a ``ZeroEngine``; the peak-RSS mark (``VmHWM``) is reset through ``/proc/self/clear_refs`` and
3 training steps run (batch 2 x 64 tokens). Measured: peak RSS minus the RSS before the model was built (everything the
model, its state and the steps added), and ``engine.memory_summary()`` (model-state bytes). Predicted: the planner's
device + host items per rank (on a CPU run both live in host memory) for the same model, built again on the meta
device, with ``Cluster(device="cpu", host_baseline=0)``. Also the bytes each kind of collective sent in the last step
(``engine.comm_stats()``) beside the planner's, and, without an engine and on rank 0, a GPT whose activations dominate
(4 x 256; 16 x 256 tokens in fp32, 4 x 256 in bf16): the peak RSS one forward and backward add, beside the planner's
activation bytes.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "examples"))

import zeroshard  # noqa: E402
from gpt import GPT, Block, GPTConfig  # noqa: E402
from zeroshard.plan import PRESETS, Layout, Training, memory, module_spec, step_time  # noqa: E402
from zeroshard.plan.memory import activation_bytes  # noqa: E402

CONFIG = GPTConfig(n_layer=4, n_head=8, n_embd=512, block_size=64, vocab_size=256)
BATCH, STEPS, CHUNK = 2, 3, 1 << 20
RUNS = [(1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]


def status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=g) for _ in range(STEPS)]
    with torch.device("meta"):
        spec = module_spec(GPT(CONFIG), Block, seq_len=CONFIG.block_size)
    train = Training(
        micro_batch=BATCH, compute_dtype=torch.float32, reduce_dtype=torch.float32, offload_chunk_size=CHUNK
    )
    cluster = PRESETS["cpu"].with_(gpus_per_node=world, host_baseline=0.0, host_mem=2**40)
    rows = []
    # The first configuration runs twice and its first run is not recorded: the first steps of a process also pay
    # one-time costs (allocator arenas, the math library's per-thread workspaces, gloo's first buffers) that the
    # planner counts in the host baseline, not in any configuration.
    for i, (stage, offload) in enumerate(RUNS[:1] + RUNS):
        gc.collect()
        dist.barrier()
        before = status("VmRSS")
        torch.manual_seed(0)
        model = GPT(CONFIG)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = zeroshard.ZeroConfig(
            stage=stage, offload_optimizer=offload, wrap_policy=Block if stage == 3 else None, offload_chunk_size=CHUNK
        )
        engine = zeroshard.ZeroEngine(model, optimizer, config, local_world_size=world)
        torch.set_num_threads(1)
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        for x in data:
            engine.begin_step()
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            del logits
            loss.backward()
            engine.finish_backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad(set_to_none=True)
            engine.after_step()
            del loss
        peak = status("VmHWM")
        state = engine.memory_summary()
        mem = memory(spec, train, Layout(stage, offload), cluster)
        state_items = ("params", "grads", "master", "optimizer_state")
        predicted_state = sum(mem["device"][k] + mem["host"][k] for k in state_items)
        row = {
            "stage": stage,
            "offload": offload,
            "measured_peak_bytes": peak - before,
            "predicted_peak_bytes": mem["device_total"] + mem["host_total"],
            "measured_state_bytes": sum(state.values()),
            "predicted_state_bytes": predicted_state,
            "memory_summary": state,
            "predicted_device": mem["device"],
            "predicted_host": mem["host"],
            "measured_comm": {kind: v["bytes"] for kind, v in engine.comm_stats()["last_step"].items()},
            "predicted_comm": step_time(spec, train, Layout(stage, offload), cluster, mem["flat"])["comm_bytes"],
        }
        if i > 0:
            rows.append(row)
        engine.remove_hooks()
        del engine, model, optimizer, state, mem
    activations = []
    # Activations large against the model (4 x 256), on rank 0 only (no collective in it): 16 x 256 tokens in fp32,
    # 4 x 256 in bf16, whose matmuls take 15x as long on a CPU without bf16 units (60 s a rank at 16 x 256 here)
    for dtype, batch in ((torch.float32, 16), (torch.bfloat16, 4)) if rank == 0 else ():
        cfg = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=256)
        model = GPT(cfg).to(dtype)
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        for _ in range(2):  # the second pass: parameter gradients exist already
            gc.collect()
            before = status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
            del logits
            loss.backward()
            del loss
            measured = status("VmHWM") - before
        spec_a = module_spec(model, Block, seq_len=cfg.block_size)
        predicted = activation_bytes(spec_a, Training(micro_batch=batch, compute_dtype=dtype))
        activations.append({"dtype": str(dtype), "measured_bytes": measured, "predicted_bytes": predicted})
        del model
    (out.parent / f"{out.stem}_rank{rank}.json").write_text(json.dumps({"runs": rows, "activations": activations}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

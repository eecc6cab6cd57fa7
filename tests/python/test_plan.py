"""The planner (``python -m zeroshard.plan``, ``ZeroStrategy(stage="auto")``).

Validation on CPU: two gloo ranks train the examples' GPT (12.8M parameters) at stages 1-3 with and without optimizer
offload; the planner's peak memory per rank (everything the model, its state and the steps add to the process) and its
model-state bytes are within 10% of what the ranks measured (peak RSS; ``engine.memory_summary()``), and its bytes per
collective kind equal ``engine.comm_stats()``. Model specs agree with the real modules they describe, the command line
writes one JSON row per configuration, and ``stage="auto"`` picks the planner's choice and trains like DDP.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO, run_ranks

from zeroshard.plan import PRESETS, Layout, Training, choose, gpt_spec, hf_config_spec, memory, module_spec, plan
from zeroshard.plan.__main__ import main as plan_main
from zeroshard.strategies.auto_plan import auto_config

SCRIPTS = Path(__file__).parent / "scripts"
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory, monkeypatch_module) -> list[dict]:
    out = tmp_path_factory.mktemp("plan") / "memory.json"
    # a fixed mmap threshold: glibc then returns every freed buffer above 64 KiB, so RSS follows live memory
    monkeypatch_module.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    run_ranks(SCRIPTS / "plan_memory.py", [str(out)], world_size=2)
    return [json.loads((out.parent / f"memory_rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def cpu_runs(cpu_results) -> list[list[dict]]:
    return [r["runs"] for r in cpu_results]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _ids(rows):
    return [f"stage{r['stage']}{'+offload' if r['offload'] else ''}" for r in rows]


def test_predicted_peak_memory_within_10_percent_on_cpu(cpu_runs):
    seen = set()
    for rank, rows in enumerate(cpu_runs):
        for row, name in zip(rows, _ids(rows)):
            measured, predicted = row["measured_peak_bytes"], row["predicted_peak_bytes"]
            assert abs(predicted - measured) <= TOLERANCE * measured, (rank, name, predicted / measured, row)
            seen.add(name)
    assert seen == {f"stage{s}{o}" for s in (1, 2, 3) for o in ("", "+offload")}


def test_predicted_activations_within_10_percent_on_cpu(cpu_results):
    rows = cpu_results[0]["activations"]  # measured on rank 0 only
    assert [row["dtype"] for row in rows] == ["torch.float32", "torch.bfloat16"]
    for row in rows:
        measured, predicted = row["measured_bytes"], row["predicted_bytes"]
        assert abs(predicted - measured) <= TOLERANCE * measured, (row, predicted / measured)


def test_predicted_model_state_matches_memory_summary(cpu_runs):
    for rows in cpu_runs:
        for row, name in zip(rows, _ids(rows)):
            measured, predicted = row["measured_state_bytes"], row["predicted_state_bytes"]
            assert abs(predicted - measured) <= 0.01 * measured, (name, predicted, measured)


def test_predicted_bytes_per_collective_match_comm_stats(cpu_runs):
    for row, name in zip(cpu_runs[0], _ids(cpu_runs[0])):
        for kind in ("all_gather", "reduce_scatter"):
            got, want = row["predicted_comm"][kind], row["measured_comm"][kind]
            assert want > 0 and abs(got - want) <= 16, (name, kind, got, want)  # (N-1)/N rounded per collective


def test_gpt_spec_matches_the_examples_gpt():
    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT, Block, GPTConfig

    cfg = GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, vocab_size=100)
    with torch.device("meta"):
        model = GPT(cfg)
    analytic, built = gpt_spec(3, 64, 4, 100, 32), module_spec(model, Block, seq_len=32)
    assert analytic.num_params == built.num_params == model.num_params()
    assert [u.numel for u in analytic.units] == [u.numel for u in built.units]
    assert (built.hidden, built.vocab, built.n_layer, built.n_head) == (64, 100, 3, 4)
    assert built.lookup_params == analytic.lookup_params == 32 * 64  # the tied token embedding is also the head


def test_hf_config_spec_builds_the_model_on_meta(tmp_path):
    transformers = pytest.importorskip("transformers")
    raw = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128,
           "hidden_act": "silu", "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = hf_config_spec(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    assert spec.num_params == sum(p.numel() for p in reference.parameters())
    assert spec.n_layer == 3 and len(spec.units) == 4 and spec.gated_mlp and spec.seq_len == 128
    assert spec.lookup_params == 300 * 64  # untied: the embedding is only a lookup


def test_cli_writes_every_configuration(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["--gpt", "4,256,4,256,128", "--gpus", "4", "--nodes", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # stages 1-3 x offload (x parameter offload at stage 3) x shard groups 8, 4, 2, 1
    assert len(rows) == 7 * 4
    assert {(r["stage"], r["offload_optimizer"], r["offload_params"], r["shard_group_size"]) for r in rows} == {
        (s, o, p, k) for s in (1, 2, 3) for o in (False, True) for p in (False, True) for k in (8, 4, 2, 1)
        if not (p and (s != 3 or not o))
    }  # fmt: skip
    for r in rows:
        assert r["fits"] is True and r["predicted_step_s"] > 0
        assert set(r["device_bytes"]) >= {"params", "grads", "master", "optimizer_state", "buckets", "gathered_units",
                                          "activations", "cuda_context"}  # fmt: skip
    assert "fastest that fits" in capsys.readouterr().out


def test_memory_orders_the_stages_as_zero_does():
    """ZeRO's per-GPU model state (paper, figure 1): stage 3 < 2 < 1 < DDP; offload moves the optimizer to the host."""
    spec = gpt_spec(24, 2048, 16, 50304, 1024)
    train, cluster = Training(micro_batch=1), PRESETS["h100"]
    state = {}
    for layout in (Layout("ddp"), Layout(1), Layout(2), Layout(3), Layout(3, True)):
        dev = memory(spec, train, layout, cluster)["device"]
        state[layout.label(8)] = sum(dev[k] for k in ("params", "grads", "master", "optimizer_state"))
    assert state["stage3+offload"] < state["stage3"] < state["stage2"] < state["stage1"] < state["ddp"]
    # stage 3, bf16 on 8 ranks: (2 + 4 + 4 + 8) / 8 bytes per parameter, padding aside
    assert state["stage3"] == pytest.approx(18 / 8 * spec.num_params, rel=1e-3)


def test_auto_refuses_what_cannot_fit_and_picks_the_fastest_that_does():
    from zeroshard.engine.config import ZeroConfig

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    tiny = PRESETS["cpu"].with_(gpus_per_node=2, host_mem=64 * 2**20, host_baseline=0.0)
    with pytest.raises(ValueError, match="no configuration .* fits 2 ranks"):
        auto_config(model, ZeroConfig(), world_size=2, local_world_size=2, device="cpu", compute_dtype=None,
                    options={"cluster": tiny})  # fmt: skip
    roomy = tiny.with_(host_mem=2**40)
    config, report = auto_config(model, ZeroConfig(), world_size=2, local_world_size=2, device="cpu",
                                 compute_dtype=None, options={"cluster": roomy})  # fmt: skip
    rows = plan(module_spec(model), Training(compute_dtype=torch.float32), roomy)
    best, _ = choose(rows)
    assert report["choice"]["config"] == best["config"]
    assert (config.stage, config.offload_optimizer) == (best["stage"], best["offload_optimizer"])


def test_stage_auto_trains_like_ddp(tmp_path):
    runs = [{"name": "ddp", "strategy": "ddp"}, {"name": "auto", "strategy": "zeroshard", "stage": "auto"}]
    run_ranks(SCRIPTS / "fit_runs.py", [str(tmp_path), json.dumps(runs)])
    for rank in range(2):
        ref = json.loads((tmp_path / f"ddp_rank{rank}.json").read_text())["losses"]
        got = json.loads((tmp_path / f"auto_rank{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-6)
        auto = got["auto"]
        assert (auto["engine_stage"], auto["engine_offload"]) == (auto["stage"], auto["offload_optimizer"])
        assert auto["engine_shard_group"] == auto["shard_group_size"]


def test_cli_takes_a_configure_model_callable(tmp_path, monkeypatch, capsys):
    """``--model pkg:callable`` returning a LightningModule whose ``configure_model`` builds the network: built on the
    meta device (nothing allocated), units found by ``--wrap``."""
    (tmp_path / "planmodel.py").write_text(
        "import lightning as L\n"
        "from gpt import GPT, GPTConfig\n\n"
        "class Lit(L.LightningModule):\n"
        "    def configure_model(self):\n"
        "        self.model = GPT(GPTConfig(n_layer=6, n_head=4, n_embd=128, block_size=64))\n\n"
        "def build():\n"
        "    return Lit()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    args = ["--model", "planmodel:build", "--wrap", "Block", "--gpus", "2", "--preset", "cpu", "--host-mem", "8"]
    assert plan_main(args + ["--stages", "3", "--no-hybrid"]) == 0
    out = capsys.readouterr().out
    assert "planmodel:build: 0.001B parameters (1,230,848 trainable), 6 units" in out


def test_optimizer_state_bytes_follow_the_state_format():
    """fp32 moments 8 bytes per parameter, bf16 4, int8 2 plus one fp32 absmax per moment and block of 2048 of each
    shard; on the device without offload, on the host with it, and in DDP's whole-model count."""
    from zeroshard.plan.memory import flat_plan, optimizer_state_bytes

    spec = gpt_spec(4, 512, 8, 50304, 256)
    cluster = PRESETS["h100"]
    for layout, where in ((Layout(2), "device"), (Layout(3, True), "host"), (Layout("ddp"), "device")):
        got = {
            fmt: memory(spec, Training(optimizer_state_dtype=fmt), layout, cluster)[where]["optimizer_state"]
            for fmt in (torch.float32, torch.bfloat16, "int8")
        }
        assert got[torch.float32] == memory(spec, Training(), layout, cluster)[where]["optimizer_state"] > 0
        assert got[torch.bfloat16] == got[torch.float32] / 2
        n = got[torch.float32] / 8  # trainable elements counted (shards, padding included)
        if layout.stage == "ddp":
            assert 2 * n + 8 * n / 2048 <= got["int8"] <= 2 * n + 8 * (n / 2048 + 1), (got["int8"], n)
            continue
        # int8: the parameters under min_8bit_size (biases, norms) in flat parameters of their own, fp32 moments
        fp = flat_plan(spec, Training(optimizer_state_dtype="int8"), layout, cluster.world_size)
        small = sum(math.prod(s) for u in spec.units for s in u.shapes if math.prod(s) < 4096)
        fp32 = sum(m for m, f in zip(fp.trainable, fp.fp32_state) if f)
        assert 0 < small <= fp32 <= small + 64 * cluster.world_size * len(fp.trainable), (layout, small, fp32)
        shards = [(fp.shard(m), f) for m, f in zip(fp.trainable, fp.fp32_state)]
        assert got["int8"] == sum(8 * m if f else 2 * m + 8 * -(-m // 2048) for m, f in shards), layout
    assert optimizer_state_bytes(Training(optimizer_state_dtype="int8"), [2048, 2049, 1]) == 2 * 4098 + 8 * 4
    with pytest.raises(ValueError, match="optimizer_state_dtype='int4'"):
        Training(optimizer_state_dtype="int4")


def test_prefetch_group_is_the_largest_run_of_consecutive_units_within_the_bucket():
    from zeroshard.plan.memory import _prefetch_group

    # forward prefetches from the second unit on, backward from the one before the last, downward
    assert _prefetch_group([5, 5, 5, 5], 12) == 10
    assert _prefetch_group([5, 5, 5, 5], 0) == 5  # one unit at a time: the largest unit
    assert _prefetch_group([5, 5, 5, 5], 100) == 15  # all but the first (forward) or the last (backward)
    assert _prefetch_group([9, 1, 1, 9], 3) == 9  # a unit larger than the bucket is a group of its own
    assert _prefetch_group([], 10) == 0

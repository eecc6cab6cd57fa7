"""``optimizer_state_dtype`` (bf16 and int8 Adam moments) in the ZeRO engine: stages 1-3, with and without offload
(also ``overlap_step``, stage 3's ``offload_params`` and hybrid sharding).

Multi-rank runs (2 ranks on gloo, one launch for every case: ``scripts/state_format_runs.py``) against single-process
``CPUAdam`` with the same ``state_dtype``, computed from the same batches:

* bf16 moments are elementwise, so the engine equals per-parameter ``CPUAdam(state_dtype=torch.bfloat16)`` bit for bit.
* int8 moments are quantised in blocks of 2048 elements of the tensor they belong to. The engine's tensor is the flat
  shard, whose blocks start at the shard's start and span parameter boundaries and padding, so its results depend on
  the shard boundaries (the world size, the bucket size, the stage-3 units). It equals ``CPUAdam(state_dtype="int8")``
  stepping tensors cut like the engine's shards bit for bit, and differs from per-parameter int8 state where blocks
  are cut at other places (before the small parameters were set apart: about 2.5e-3 in the weights after 4 steps at
  lr 1e-2), which the test bounds loosely (1e-2).
* Under int8 the parameters below ``min_8bit_size`` (4096: the norm weights and biases, the 2048-element embedding)
  go into flat parameters of their own whose master shards keep fp32 moments, as ``CPUAdam`` keeps theirs
  (bitsandbytes' rule, :mod:`zeroshard.optim.small_state`); the reference steps those shards with fp32 moments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_ranks
from state_facts import assert_state_facts

from zeroshard import CPUAdam, ZeroConfig

SCRIPT = Path(__file__).parent / "scripts" / "state_format_runs.py"
CASES = [
    {"stage": 1, "fmt": "bf16", "offload": False},
    {"stage": 1, "fmt": "int8", "offload": True},
    {"stage": 2, "fmt": "bf16", "offload": True},
    {"stage": 2, "fmt": "int8", "offload": False},
    {"stage": 3, "fmt": "bf16", "offload": False},
    {"stage": 3, "fmt": "bf16", "offload": True},
    {"stage": 3, "fmt": "int8", "offload": False},
    {"stage": 3, "fmt": "int8", "offload": True},
    {"stage": 2, "fmt": "int8", "offload": True, "overlap_step": True},
    {"stage": 3, "fmt": "int8", "offload": True, "offload_params": True},
    {"stage": 3, "fmt": "bf16", "offload": True, "offload_params": True},
    # hybrid: shard groups of one rank, replicated over both (each rank holds whole flat parameters)
    {"stage": 2, "fmt": "int8", "offload": False, "shard_group_size": 1},
    {"stage": 3, "fmt": "int8", "offload": True, "shard_group_size": 1},
]
for _c in CASES:
    _extra = "".join(f"_{k}" for k in ("overlap_step", "offload_params", "shard_group_size") if _c.get(k))
    _c.update(name=f"stage{_c['stage']}_{_c['fmt']}_{'offload' if _c['offload'] else 'cpu_adam'}{_extra}", bucket=5000)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("state_formats")
    run_ranks(SCRIPT, [str(out), json.dumps(CASES)])
    return {c["name"]: torch.load(out / f"{c['name']}.pt") for c in CASES}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_engine_matches_single_process_cpu_adam(results, case):
    r = results[case["name"]]
    facts = r["facts"]
    assert facts["optimizer"] == ("OffloadedAdam" if case["offload"] else "CPUAdam")
    assert_state_facts(case["fmt"], facts)
    if case["fmt"] == "bf16":
        torch.testing.assert_close(r["engine"], r["per_param"], rtol=0, atol=0)
    else:
        torch.testing.assert_close(r["engine"], r["same_shards"], rtol=0, atol=0)
        diff = _max_diff(r["engine"], r["per_param"])
        # close to per-parameter int8 state; equal where the shards' blocks fall on the parameters' own blocks (the
        # large TinyLM matrices have 4096 elements: set apart from the small ones they often do)
        assert diff < 1e-2, diff


def test_bad_optimizer_state_dtype_fails_at_construction():
    with pytest.raises(ValueError, match=r"optimizer_state_dtype='fp8'.*torch.float32.*torch.bfloat16.*'int8'"):
        ZeroConfig(optimizer_state_dtype="fp8")
    with pytest.raises(ValueError, match=r"optimizer_state_dtype=torch.float16"):
        ZeroConfig(optimizer_state_dtype=torch.float16)
    assert ZeroConfig().optimizer_state_dtype == torch.float32
    assert ZeroConfig(optimizer_state_dtype="int8").optimizer_state_dtype == "int8"


def test_formats_an_optimizer_cannot_keep_are_refused():
    """Resolved before any shard exists: SGD anywhere, two different formats. torch's AdamW keeps every format, with
    or without offload (replaced by a fused Adam: test_engine_device_adam.py)."""
    from zeroshard.optim.engine_state_format import resolve_state_dtype

    p = [torch.nn.Parameter(torch.zeros(3))]
    adamw, sgd = torch.optim.AdamW(p), torch.optim.SGD(p, lr=0.1)
    assert resolve_state_dtype("int8", adamw, offload=False) == "int8"
    assert resolve_state_dtype("int8", adamw, offload=True) == "int8"
    with pytest.raises(ValueError, match=r"torch.optim.sgd.SGD"):
        resolve_state_dtype(torch.bfloat16, sgd, offload=True)
    assert resolve_state_dtype(torch.float32, sgd, offload=False) == torch.float32
    own = CPUAdam(p, state_dtype=torch.bfloat16)
    assert resolve_state_dtype(torch.float32, own, offload=False) == torch.bfloat16  # the default keeps its own
    with pytest.raises(ValueError, match=r"CPUAdam\(state_dtype=torch.bfloat16\).*'int8'"):
        resolve_state_dtype("int8", own, offload=True)


def test_strategies_take_the_setting():
    """Both strategies pass ``optimizer_state_dtype`` to the engine's config, and refuse a bad one when built."""
    from zeroshard import ZeroStrategy
    from zeroshard.strategies.fabric_strategy import ZeroFabricStrategy

    assert ZeroStrategy(optimizer_state_dtype="int8").zero_config.optimizer_state_dtype == "int8"
    fabric = ZeroFabricStrategy(optimizer_state_dtype=torch.bfloat16)
    assert fabric._core.config.optimizer_state_dtype == torch.bfloat16
    for cls in (ZeroStrategy, ZeroFabricStrategy):
        with pytest.raises(ValueError, match=r"optimizer_state_dtype='int4'.*'int8'"):
            cls(optimizer_state_dtype="int4")


@pytest.mark.parametrize("chunk", [1, 3000, 4096, 1 << 20])
def test_int8_offload_step_equals_one_kernel_call(chunk):
    """The offload pipeline's chunked host step of int8 state (``_C.HostAdamPipeline``; chunks rounded down to whole
    blocks) equals one ``adam_step`` over each whole segment bit for bit: weights, codes, absmax and the uploaded
    compute-dtype copy; an fp32 segment in the same step keeps ``chunk`` elements per chunk."""
    from zeroshard import _C
    from zeroshard.ops import adam_step, quantize_state

    g = torch.Generator().manual_seed(3)
    q = _C.make_copy_queue(torch.device("cpu"))
    step = _C.HostAdamPipeline(q, _C.make_copy_queue(torch.device("cpu")), chunk, False)
    assert step.int8_chunk_elems == max(2048, chunk // 2048 * 2048)
    segments, refs = [], []
    for n in (5000, 2048, 7):
        master = torch.randn(n, generator=g)
        grad = torch.randn(n, generator=g).bfloat16()
        mq, ma = quantize_state(torch.randn(n, generator=g) * 1e-2, signed=True)
        vq, va = quantize_state(torch.rand(n, generator=g) * 1e-4, signed=False)
        mine = [t.clone() for t in (master, mq, vq, ma, va)]
        out = torch.zeros(n, dtype=torch.bfloat16)
        hyper = (3, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, True, 1.0, 1.0)
        segments.append((mine[0], mine[1], mine[2], grad, 0, None, out, *hyper, mine[3], mine[4]))
        ref = [t.clone() for t in (master, mq, vq, ma, va)]
        ref_out = torch.zeros(n, dtype=torch.bfloat16)
        adam_step(ref[0], grad, ref[1], ref[2], step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                  adamw_mode=True, bias_correction=True, param_out=ref_out, exp_avg_absmax=ref[3],
                  exp_avg_sq_absmax=ref[4])  # fmt: skip
        refs.append((mine, out, ref, ref_out))
    n = 3001  # an fp32 segment between the int8 ones
    master, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    fp32 = [master.clone(), torch.zeros(n), torch.zeros(n)]
    segments.insert(1, (*fp32, grad, 0, None, None, *hyper))
    step.step(segments)
    ref = [master.clone(), torch.zeros(n), torch.zeros(n)]
    adam_step(*ref[:1], grad, *ref[1:], step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
              adamw_mode=True, bias_correction=True)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(fp32, ref))
    for mine, out, ref, ref_out in refs:
        for a, b in zip(mine, ref):
            assert torch.equal(a, b)
        assert torch.equal(out, ref_out) and out.abs().sum() > 0
    assert step.upload_buffer_bytes() == 2 * 4 * max(2048, chunk)

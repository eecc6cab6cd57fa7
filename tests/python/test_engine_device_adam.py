"""The ZeRO engine without offload stepping bf16 / int8 state with ``DeviceAdam`` (torch ops) or a swapped-in Adam.

On GPU master shards the engine replaces a ``CPUAdam`` and torch's Adam/AdamW with a bf16/int8 format by
``DeviceAdam``; on CPU master shards, torch's Adam/AdamW with a bf16/int8 format by ``CPUAdam``, and a ``DeviceAdam``
given by the user is kept. The multi-rank runs (2 gloo ranks, ``scripts/state_format_runs.py``) take the CPU path
with ``DeviceAdam`` given directly, at stages 1-3 and hybrid sharding, against single-process ``CPUAdam`` with the
same format: bit for bit, since ``DeviceAdam`` has the kernel's bits (``test_device_adam.py``). The GPU choice is
tested on the decision itself (:func:`adam_class_without_offload`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_ranks
from state_facts import assert_state_facts

from zeroshard import CPUAdam
from zeroshard.optim.device_adam import DeviceAdam
from zeroshard.optim.engine_state_format import adam_class_without_offload, resolve_state_dtype

SCRIPT = Path(__file__).parent / "scripts" / "state_format_runs.py"
CASES = [
    {"stage": 1, "fmt": "bf16", "optimizer": "device_adam"},
    {"stage": 2, "fmt": "int8", "optimizer": "device_adam"},
    {"stage": 3, "fmt": "int8", "optimizer": "device_adam"},
    {"stage": 3, "fmt": "bf16", "optimizer": "device_adam"},
    {"stage": 2, "fmt": "int8", "optimizer": "device_adam", "shard_group_size": 1},  # hybrid: 2 replicas
    {"stage": 2, "fmt": "bf16", "optimizer": "adamw"},  # swapped for CPUAdam on CPU masters
]
for _c in CASES:
    _hybrid = "_hybrid" if _c.get("shard_group_size") else ""
    _c.update(offload=False, bucket=5000, name=f"stage{_c['stage']}_{_c['fmt']}_{_c['optimizer']}{_hybrid}")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("device_adam")
    run_ranks(SCRIPT, [str(out), json.dumps(CASES)])
    return {c["name"]: torch.load(out / f"{c['name']}.pt") for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_engine_without_offload_matches_single_process_cpu_adam(results, case):
    r = results[case["name"]]
    facts = r["facts"]
    assert facts["optimizer"] == ("DeviceAdam" if case["optimizer"] == "device_adam" else "CPUAdam")
    assert_state_facts(case["fmt"], facts)
    if case["fmt"] == "bf16":
        torch.testing.assert_close(r["engine"], r["per_param"], rtol=0, atol=0)
    else:
        torch.testing.assert_close(r["engine"], r["same_shards"], rtol=0, atol=0)
    # the run trained: parameters moved from the initial ones
    torch.manual_seed(0)
    from tiny_lm import TinyLM

    init = TinyLM().state_dict()
    assert any(not torch.equal(init[k], r["engine"][k]) for k in init)


def test_which_adam_steps_without_offload():
    p = [torch.nn.Parameter(torch.zeros(3))]
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    adamw, adam = torch.optim.AdamW(p), torch.optim.Adam(p)
    for fmt in (torch.bfloat16, "int8"):
        assert adam_class_without_offload(adamw, fmt, cuda) is DeviceAdam
        assert adam_class_without_offload(adam, fmt, cuda) is DeviceAdam
        assert adam_class_without_offload(adamw, fmt, cpu) is CPUAdam
    assert adam_class_without_offload(adamw, torch.float32, cuda) is None  # torch's own step keeps fp32 state
    assert adam_class_without_offload(CPUAdam(p), torch.float32, cuda) is DeviceAdam  # the kernel needs CPU tensors
    assert adam_class_without_offload(CPUAdam(p), "int8", cpu) is None
    assert adam_class_without_offload(DeviceAdam(p), "int8", cpu) is None
    assert adam_class_without_offload(torch.optim.AdamW(p, amsgrad=True), torch.float32, cuda) is None
    assert adam_class_without_offload(torch.optim.SGD(p, lr=0.1), torch.float32, cuda) is None
    assert adam_class_without_offload(adamw, "int8", None) is None  # steps no shard


def test_torch_adamw_keeps_any_format_without_offload_and_others_are_refused():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert resolve_state_dtype("int8", torch.optim.AdamW(p), offload=False) == "int8"
    with pytest.raises(ValueError, match=r"torch.optim.adam.Adam\).*amsgrad/maximize"):
        resolve_state_dtype(torch.bfloat16, torch.optim.Adam(p, amsgrad=True), offload=False)
    with pytest.raises(ValueError, match=r"DeviceAdam\(state_dtype=torch.bfloat16\).*'int8'"):
        resolve_state_dtype("int8", DeviceAdam(p, state_dtype=torch.bfloat16), offload=False)


def test_swapped_adam_keeps_the_lr_scheduler(tmp_path):
    """AdamW with bf16 state and no offload becomes CPUAdam on CPU masters; a StepLR built on the AdamW, re-pointed as
    the strategies do, halves the replacement's lr each step, and the run equals single-process CPUAdam bit for bit."""
    run_ranks(Path(__file__).parent / "scripts" / "device_adam_scheduler.py", [str(tmp_path)])
    r = torch.load(tmp_path / "result.pt")
    assert r["optimizer"] == "CPUAdam" and r["scheduler_follows"]
    assert [lr[0] for lr in r["lrs"]] == [1e-2 * 0.5**k for k in range(len(r["lrs"]))]
    torch.testing.assert_close(r["engine"], r["reference"], rtol=0, atol=0)

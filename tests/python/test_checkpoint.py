"""Save and resume through the Trainer: a resumed run continues with the losses of an uninterrupted one.

The checkpoint's optimizer state is consolidated in torch's own format, so it also matches what Lightning's ``ddp``
writes, and a ``ddp`` checkpoint resumes under zeroshard (and a stage-2 one under stage 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from launch import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "fit_runs.py"
STEPS_PER_EPOCH = 32  # 256 samples / 2 ranks / batch 4


def _losses(tmp_path: Path, name: str, rank: int) -> torch.Tensor:
    return torch.tensor(json.loads((tmp_path / f"{name}_rank{rank}.json").read_text())["losses"], dtype=torch.float64)


def test_fit_save_resume_round_trip(tmp_path):
    z2, z3, ddp = str(tmp_path / "stage2.ckpt"), str(tmp_path / "stage3.ckpt"), str(tmp_path / "ddp.ckpt")
    zs = str(tmp_path / "stage2_sharded")
    runs = [
        {"name": "straight", "strategy": "zeroshard", "stage": 2, "max_epochs": 2},
        {"name": "first_half", "strategy": "zeroshard", "stage": 2, "max_epochs": 1, "save_ckpt": z2},
        {"name": "resumed", "strategy": "zeroshard", "stage": 2, "max_epochs": 2, "resume_from": z2},
        {"name": "resumed_stage1", "strategy": "zeroshard", "stage": 1, "max_epochs": 2, "resume_from": z2},
        {"name": "ddp_first_half", "strategy": "ddp", "max_epochs": 1, "save_ckpt": ddp},
        {"name": "from_ddp", "strategy": "zeroshard", "stage": 2, "max_epochs": 2, "resume_from": ddp},
        {"name": "first_half3", "strategy": "zeroshard", "stage": 3, "max_epochs": 1, "save_ckpt": z3},
        {"name": "resumed3", "strategy": "zeroshard", "stage": 3, "max_epochs": 2, "resume_from": z3},
        {"name": "stage3_from_stage2", "strategy": "zeroshard", "stage": 3, "max_epochs": 2, "resume_from": z2},
        {"name": "first_half_sharded", "strategy": "zeroshard", "max_epochs": 1, "save_ckpt": zs, "sharded": True},
        {"name": "resumed_sharded", "strategy": "zeroshard", "max_epochs": 2, "resume_from": zs, "sharded": True},
        {"name": "stage3_from_sharded", "strategy": "zeroshard", "stage": 3, "max_epochs": 2, "resume_from": zs},
    ]
    run_ranks(SCRIPT, [str(tmp_path), json.dumps(runs)])

    for rank in range(2):
        straight = _losses(tmp_path, "straight", rank)
        assert len(straight) == 2 * STEPS_PER_EPOCH
        torch.testing.assert_close(_losses(tmp_path, "first_half", rank), straight[:STEPS_PER_EPOCH], rtol=0, atol=0)
        torch.testing.assert_close(
            _losses(tmp_path, "first_half3", rank), straight[:STEPS_PER_EPOCH], rtol=1e-5, atol=1e-6
        )
        resumed_names = ("resumed", "resumed_stage1", "from_ddp", "resumed3", "stage3_from_stage2")
        resumed_names += ("resumed_sharded", "stage3_from_sharded")
        for name, rtol in zip(resumed_names, (1e-6, 1e-5, 1e-5, 1e-5, 1e-5, 1e-6, 1e-5)):
            resumed = _losses(tmp_path, name, rank)
            assert len(resumed) == STEPS_PER_EPOCH, name
            torch.testing.assert_close(
                resumed, straight[STEPS_PER_EPOCH:], rtol=rtol, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )

    final = torch.load(tmp_path / "straight.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    for k in final:
        torch.testing.assert_close(resumed[k], final[k], rtol=1e-6, atol=1e-7)

    # the optimizer state is torch's format, with the same numbers DDP's AdamW holds, whatever the stage
    zs, dd = torch.load(z2, weights_only=False), torch.load(ddp, weights_only=False)
    z3s = torch.load(z3, weights_only=False)
    assert z3s["state_dict"].keys() == dd["state_dict"].keys()
    for k, v in dd["state_dict"].items():
        torch.testing.assert_close(z3s["state_dict"][k], v, rtol=1e-5, atol=1e-6)
    for idx in dd["optimizer_states"][0]["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            got, ref = z3s["optimizer_states"][0]["state"][idx][key], dd["optimizer_states"][0]["state"][idx][key]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    zo, do = zs["optimizer_states"][0], dd["optimizer_states"][0]
    assert [g["params"] for g in zo["param_groups"]] == [g["params"] for g in do["param_groups"]]
    assert zo["state"].keys() == do["state"].keys()
    for idx in do["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(zo["state"][idx][key], do["state"][idx][key], rtol=1e-5, atol=1e-7)
    for k, v in dd["state_dict"].items():
        torch.testing.assert_close(zs["state_dict"][k], v, rtol=1e-5, atol=1e-6)

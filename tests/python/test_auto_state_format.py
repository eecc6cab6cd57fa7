"""``ZeroStrategy(stage="auto")`` chooses a state format when fp32 Adam moments fit no configuration.

The planner input: 8 Linear(1024, 1024, bias=False) layers (8.4M parameters; no tensor under int8's min_8bit_size,
so the formats differ only in the moments' bytes) on two CPU ranks whose host memory is set between
the least that fits with int8 (resp. bf16) moments and the least that fits with fp32 moments, each found by bisection
on the planner itself.
"""

from __future__ import annotations

import logging

import pytest
import torch

from zeroshard.engine.config import ZeroConfig
from zeroshard.plan import PRESETS, Training, choose, module_spec, plan
from zeroshard.strategies.auto_plan import auto_config


def _model():
    with torch.device("meta"):
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(8)])


BASE = PRESETS["cpu"].with_(gpus_per_node=2, host_baseline=0.0)


def _least_host_mem(fmt) -> float:
    """The least host memory with which some configuration fits with ``fmt`` moments (bisection, 1 KiB)."""
    spec, train = module_spec(_model()), Training(compute_dtype=torch.float32, optimizer_state_dtype=fmt)
    lo, hi = 1.0, float(2**40)
    while hi - lo > 1024:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if choose(plan(spec, train, BASE.with_(host_mem=mid)))[0] else (mid, hi)
    return hi


def _auto(host_mem, config=None, choose_state_dtype=True):
    return auto_config(_model(), config or ZeroConfig(), world_size=2, local_world_size=2, device="cpu",
                       compute_dtype=None, options={"cluster": BASE.with_(host_mem=host_mem)},
                       choose_state_dtype=choose_state_dtype)  # fmt: skip


@pytest.mark.parametrize("fmt", [torch.bfloat16, "int8"], ids=str)
def test_auto_picks_the_format_with_which_a_configuration_fits(fmt, caplog):
    need = {f: _least_host_mem(f) for f in (torch.float32, torch.bfloat16, "int8")}
    assert need["int8"] < need[torch.bfloat16] < need[torch.float32]
    # between this format's least and the next wider format's least: only this one (or narrower) fits
    wider = torch.float32 if fmt == torch.bfloat16 else torch.bfloat16
    host_mem = (need[fmt] + need[wider]) / 2
    with caplog.at_level(logging.INFO, logger="zeroshard.plan"):
        config, report = _auto(host_mem)
    assert config.optimizer_state_dtype == fmt and report["state_dtype"] == fmt
    rows = plan(module_spec(_model()), Training(compute_dtype=torch.float32, optimizer_state_dtype=fmt),
                BASE.with_(host_mem=host_mem))  # fmt: skip
    best, _ = choose(rows)
    assert report["choice"]["config"] == best["config"] and config.stage == best["stage"]
    line = report["message"]
    assert f"chose {best['config']} with optimizer_state_dtype={fmt!r}" in line
    assert "no configuration fits with fp32 Adam moments" in line
    assert line in caplog.text


def test_auto_keeps_fp32_when_it_fits_and_an_explicit_format_is_not_changed():
    need32 = _least_host_mem(torch.float32)
    config, report = _auto(need32 * 1.5)
    assert config.optimizer_state_dtype == torch.float32 and "optimizer_state_dtype" not in report["message"]
    host_mem = (_least_host_mem(torch.bfloat16) + need32) / 2  # fits with bf16 only
    with pytest.raises(ValueError, match="no configuration .* fits 2 ranks"):
        _auto(host_mem, choose_state_dtype=False)  # the user set fp32, or an optimizer keeps only fp32
    config, _ = _auto(host_mem, ZeroConfig(optimizer_state_dtype="int8"), choose_state_dtype=False)
    assert config.optimizer_state_dtype == "int8"
    with pytest.raises(ValueError, match="even with optimizer_state_dtype='int8'"):
        _auto(_least_host_mem("int8") * 0.9)


def test_strategies_let_auto_choose_only_an_unset_format():
    from zeroshard import ZeroStrategy
    from zeroshard.strategies.fabric_strategy import ZeroFabricStrategy

    assert not ZeroStrategy(stage="auto")._core.state_dtype_given
    assert ZeroStrategy(stage="auto", optimizer_state_dtype=torch.float32)._core.state_dtype_given
    assert ZeroFabricStrategy(stage="auto", optimizer_state_dtype="int8")._core.state_dtype_given

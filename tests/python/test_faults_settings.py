"""Issue 10, section 5: settings that used to be accepted silently and meant nothing.

Each now fails before training with an error naming the bad value and the fix (at construction, or at setup when the
model or the precision is needed), or, where running is reasonable, warns once. Both strategies (Trainer and Fabric)
share the checks (:mod:`zeroshard.strategies.strategy_settings`, :mod:`zeroshard.strategies.setup_checks`).
Single-process where possible; one 2-rank gloo run goes through ``Trainer.fit``.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import run_ranks
from tiny_lm import Block, TinyLM
from torch import nn

import zeroshard
from zeroshard import ZeroFabricStrategy, ZeroStrategy
from zeroshard.strategies import setup_checks
from zeroshard.strategies.activation_checkpointing import is_checkpointed

STRATEGIES = [ZeroStrategy, ZeroFabricStrategy]
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(autouse=True)
def fresh_warnings():
    setup_checks._WARNED.clear()  # the single-unit warning is once per process
    yield


def _setup(strategy, model: nn.Module, compute_dtype=None):
    """What both strategies do at setup: build the engine over the model and its optimizer."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return strategy._core.build_engine(model, [optimizer], compute_dtype=compute_dtype, local_world_size=1)


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    """Nothing was sharded, cast or checkpointed."""
    return (
        zeroshard.engine_of(model) is None
        and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        and not any(is_checkpointed(m) for m in model.modules())
    )


# -- at construction --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", STRATEGIES)
def test_float_stage_names_the_int(cls):
    with pytest.raises(ValueError, match=r"stage=2\.0\) is not a ZeRO stage \(a float: pass the int 2\).*'auto'"):
        cls(stage=2.0)
    with pytest.raises(ValueError, match=r"stage=2\.5\) is not a ZeRO stage: use 1 .*as an int"):
        cls(stage=2.5)
    assert cls(stage="auto")._core.auto  # still valid
    numpy_stage = cls(stage=np.int64(2))._core.config.stage
    assert numpy_stage == 2 and type(numpy_stage) is int


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize(
    "policy, match",
    [
        (-1, r"wrap_policy=-1\): a threshold must be >= 1"),
        (0, r"wrap_policy=0\): a threshold must be >= 1"),
        ("Block", r"wrap_policy='Block'\) is none of the accepted kinds"),
        (int, r"wrap_policy=<class 'int'>\) is none of the accepted kinds"),
        ((Block, "x"), r"a tuple must hold one or more nn.Module subclasses"),
        ((), r"a tuple must hold one or more nn.Module subclasses"),
    ],
)
def test_wrap_policy_of_another_kind_names_the_accepted_ones(cls, policy, match):
    kinds = r".*nn.Module subclass .*a non-empty tuple of them, a positive parameter-count threshold \(int\), or call"
    with pytest.raises(ValueError, match=match + kinds):
        cls(stage=3, wrap_policy=policy)


def _three_args(name, module, depth):
    return False


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize(
    "policy, shown",
    [(lambda module: isinstance(module, Block), r"\(module\)"), (_three_args, r"\(name, module, depth\)")],
)
def test_wrap_policy_callable_with_wrong_signature_names_name_module(cls, policy, shown):
    with pytest.raises(ValueError, match=r"called as policy\(name, module\) -> bool.*signature " + shown):
        cls(stage=3, wrap_policy=policy)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_callables_that_take_name_module_are_accepted(cls):
    for policy in (
        lambda name, module: isinstance(module, Block),
        lambda *args: isinstance(args[1], Block),
        functools.partial(_three_args, depth=1),
    ):
        assert cls(stage=3, wrap_policy=policy)._core.config.wrap_policy is policy


@pytest.mark.parametrize("cls", STRATEGIES)
def test_activation_checkpointing_policy_kind_and_signature(cls):
    with pytest.raises(ValueError, match=r"activation_checkpointing=5\): an int is not accepted.*nn.Module subclass"):
        cls(activation_checkpointing=5)
    with pytest.raises(ValueError, match=r"activation_checkpointing=.*called as policy\(name, module\)"):
        cls(activation_checkpointing=lambda m: True)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_negative_param_persistence_threshold(cls):
    with pytest.raises(ValueError, match=r"param_persistence_threshold=-5\) must be an int >= 0"):
        cls(stage=3, param_persistence_threshold=-5)
    with pytest.raises(ValueError, match=r"param_persistence_threshold=100\) only applies to stage=3.*stage=2"):
        cls(stage=2, param_persistence_threshold=100)
    assert cls(stage=3, param_persistence_threshold=100)._core.config.param_persistence_threshold == 100


@pytest.mark.parametrize("cls", STRATEGIES)
def test_prefetch_bucket_size(cls):
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=rf"prefetch_bucket_size={bad!r}\) must be an int >= 0 .* or None"):
            cls(stage=3, prefetch_bucket_size=bad)
    with pytest.raises(ValueError, match=r"prefetch_bucket_size=1000\) only applies to stage=3.*stage=2"):
        cls(stage=2, prefetch_bucket_size=1000)
    assert cls(stage=3)._core.config.prefetch_bucket_elems == 2_000_000  # the default, at stage 3 only
    assert cls(stage=2)._core.config.prefetch_bucket_elems == 0
    assert cls(stage=2, prefetch_bucket_size=0)._core.config.prefetch_bucket_elems == 0  # off: valid at any stage
    assert cls(stage=3, prefetch_bucket_size=0)._core.config.prefetch_bucket_elems == 0


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("stage", [1, 2])
def test_check_gather_order_below_stage_3(cls, stage):
    with pytest.raises(
        ValueError, match=rf"check_gather_order=True\) only applies to stage=3 .*at stage={stage}\); drop it"
    ):
        cls(stage=stage, check_gather_order=True)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_check_gather_order_at_stage_3_and_auto(cls):
    assert cls(stage=3, check_gather_order=True)._core.config.check_gather_order
    assert cls(stage="auto", check_gather_order=True)._core.config.check_gather_order  # dropped if auto picks 1-2


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize(
    "given, expected",
    [
        (20, timedelta(seconds=20)),
        (2.5, timedelta(seconds=2.5)),
        (timedelta(minutes=3), timedelta(minutes=3)),
        (None, None),
    ],
)
def test_timeout_takes_seconds(cls, given, expected):
    assert cls(timeout=given)._timeout == expected


@pytest.mark.parametrize("cls", STRATEGIES)
def test_bad_timeout_names_the_type(cls):
    with pytest.raises(TypeError, match=r"timeout='20'\) is a str: pass a datetime.timedelta .* or a number of sec"):
        cls(timeout="20")
    for bad in (0, -1, timedelta(0)):
        with pytest.raises(ValueError, match=r"timeout=.*must be positive"):
            cls(timeout=bad)
    with pytest.raises(ValueError, match=r"timeout=inf\) must be a finite number of seconds"):
        cls(timeout=math.inf)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_huge_timeout_is_refused_by_name(cls):
    # 1e300 seconds overflowed timedelta in C; a year and a day is accepted by torch but hangs a job in practice
    with pytest.raises(ValueError, match=r"timeout=1e\+300\) seconds is longer than 365 days"):
        cls(timeout=1e300)
    with pytest.raises(ValueError, match=r"timeout=datetime.timedelta\(days=366\)\) is longer than 365 days"):
        cls(timeout=timedelta(days=366))
    assert cls(timeout=timedelta(days=365))._timeout == timedelta(days=365)


@pytest.mark.parametrize("bad", [2**34, 2**22, True, 96, 32])
def test_align_bytes_is_bounded(bad):
    # 2**34 tried to allocate 256 GiB of padding before anything said no
    with pytest.raises(ValueError, match=rf"align_bytes={bad!r}\) must be a power of two from 64 .* to 2097152"):
        ZeroStrategy(align_bytes=bad)
    assert ZeroStrategy(align_bytes=2**21) is not None


def test_device_mesh_must_be_a_mesh():
    # "2x1" used to fail late, with an AttributeError from inside the hybrid-group code
    with pytest.raises(TypeError, match=r"device_mesh='2x1'\) is a str: pass a .*DeviceMesh, e.g. init_device_mesh"):
        ZeroStrategy(device_mesh="2x1")


# -- at setup (the model or the precision is needed): before anything changes ----------------------------------------


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize(
    "policy, match",
    [
        (nn.GRU, r"wrap_policy=GRU\) matches no module of the TinyLM \(at stage 3 the whole model would be one unit"
         r".*has no instance of GRU.*e\.g\. wrap_policy=Block \(the model's repeated block\)\. The model's "
         r"classes that hold parameters: Linear \(x5\), LayerNorm \(x3\), Block \(x2\)"),
        ((nn.GRU, nn.LSTM), r"wrap_policy=\(GRU, LSTM\)\) matches no module"),
        (10**9, r"wrap_policy=1000000000\) matches no module.*no submodule has 1,000,000,000 or more parameters "
         r"\(the largest, '.*', has [\d,]+\)\. Use a threshold of at most"),
        (lambda name, module: False, r"the callable returned False for every submodule.*policy\(name, module\)"),
        # arguments swapped: (module, name) binds, but isinstance(name, Block) is never true
        (lambda module, name: isinstance(module, Block), r"the callable returned False for every submodule"),
    ],
)  # fmt: skip
def test_wrap_policy_matching_no_module_fails_at_setup(cls, policy, match):
    model = TinyLM()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        _setup(cls(stage=3, wrap_policy=policy), model)
    assert _unchanged(model, before)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_wrap_policy_callable_errors_name_the_call(cls):
    with pytest.raises(TypeError, match=r"returned None for module 'embed' \(Embedding\).*must return True"):
        _setup(cls(stage=3, wrap_policy=lambda name, module: None), TinyLM())
    with pytest.raises(AttributeError) as info:
        _setup(cls(stage=3, wrap_policy=lambda name, module: module.weight.numel() > 0), TinyLM())
    assert "takes (name: str, module: nn.Module)" in "".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize(
    "policy, match",
    [
        (nn.GRU, r"activation_checkpointing=GRU\) matches no module of the TinyLM \(nothing would be recomputed"
         r".*has no instance of GRU.*e\.g\. activation_checkpointing=Block"),
        (lambda name, module: False, r"activation_checkpointing=.*the callable returned False for every submodule"),
    ],
)  # fmt: skip
def test_activation_checkpointing_naming_a_missing_class_fails_at_setup(cls, policy, match):
    model = TinyLM()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        _setup(cls(stage=2, activation_checkpointing=policy), model)
    assert _unchanged(model, before)


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("compute, precision", [(torch.bfloat16, "bf16-mixed"), (None, "32-true")])
def test_fp16_reduce_dtype_without_16_mixed_fails_at_setup(cls, compute, precision):
    model = TinyLM()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        ValueError, match=rf"reduce_dtype=torch.float16\) with precision='{precision}'.*reduce_dtype=torch.bfloat16"
    ):
        _setup(cls(stage=2, reduce_dtype=torch.float16), model, compute_dtype=compute)
    assert _unchanged(model, before)


def test_fp16_reduce_dtype_with_16_mixed_passes_the_check():
    config = ZeroStrategy(stage=2, reduce_dtype=torch.float16).zero_config
    setup_checks.check_model_settings("ZeroStrategy", TinyLM(), config, None, torch.float16)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_stage_3_without_wrap_policy_warns_once(cls, group):
    match = (
        rf"{cls.__name__}\(stage=3\) without wrap_policy: the whole TinyLM is one unit.*"
        rf"e\.g\. {cls.__name__}\(stage=3, wrap_policy=Block\)"
    )
    with pytest.warns(UserWarning, match=match):
        engine = _setup(cls(stage=3), TinyLM())
    assert len(engine.sharded.units) == 1  # what the warning says: one root unit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _setup(cls(stage=3), TinyLM())  # once per process
        setup_checks._WARNED.clear()
        engine = _setup(cls(stage=3, wrap_policy=Block, activation_checkpointing=Block), TinyLM())  # no warning
    assert len(engine.sharded.units) == 3


# -- through Trainer.fit, 2 gloo ranks --------------------------------------------------------------------------------


def test_setup_errors_and_the_warning_through_the_trainer(tmp_path):
    run_ranks(SCRIPTS / "settings_runs.py", [str(tmp_path)], timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, result in enumerate(ranks):
        assert result["group_started"]  # with timeout=20 (an int): torch alone would have refused it
        assert "activation_checkpointing=GRU) matches no module of the TinyLM" in result["checkpointing_error"]
        assert result["steps_before_error"] == 0
        assert result["steps_trained"] == 2
        # two fits of stage 3 without wrap_policy: one warning on rank 0, none on rank 1
        assert len(result["single_unit_warnings"]) == (1 if r == 0 else 0), result["single_unit_warnings"]

"""Bad settings fail when the strategy or the Trainer is built, with a message naming the setting and the fix."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import zeroshard
from zeroshard import ZeroStrategy


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stage": 4}, r"stage=4.*use 1.*3 \(parameters sharded too\)"),
        ({"stage": 0}, r"stage=0"),
        ({"stage": "2"}, r"stage='2'"),
        ({"stage": True}, r"stage=True"),
        ({"stage": 2, "wrap_policy": object}, r"wrap_policy=.*only applies to stage=3"),
        ({"stage": 3, "prefetch": "no"}, r"prefetch='no'"),
        ({"reduce_bucket_size": 0}, r"reduce_bucket_size=0.*positive integer"),
        ({"allgather_bucket_size": -5}, r"allgather_bucket_size=-5"),
        ({"allgather_bucket_size": 1.5}, r"allgather_bucket_size=1.5"),
        ({"max_inflight_buckets": 0}, r"max_inflight_buckets=0"),
        ({"offload_optimizer": "yes"}, r"offload_optimizer='yes'"),
        ({"stage": 2, "offload_optimizer": True, "offload_params": True}, r"offload_params=True\) needs stage=3"),
        ({"stage": 3, "offload_params": True}, r"offload_params=True\) needs offload_optimizer=True"),
        ({"stage": 3, "offload_optimizer": True, "offload_chunk_size": 0}, r"offload_chunk_size=0"),
        ({"reduce_dtype": torch.int32}, r"reduce_dtype=torch.int32.*floating"),
        ({"state_dict_type": "dcp"}, r"state_dict_type='dcp'.*'full' or 'sharded'"),
        ({"offload_activations": True}, r"offload_activations=True\) needs activation_checkpointing"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


def test_unsupported_precision_fails_when_trainer_is_built():
    with pytest.raises(ValueError, match=r"HalfPrecision \(precision='bf16-true'\).*'bf16-mixed'"):
        L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2), precision="bf16-true", logger=False)


@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_precision_flag_becomes_zero_precision(precision, dtype):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3), precision=precision, logger=False)
    assert isinstance(trainer.strategy.precision_plugin, zeroshard.ZeroPrecision)
    assert trainer.strategy.precision_plugin.compute_dtype == dtype


@pytest.mark.parametrize(
    "name, stage, offload, offload_params",
    [
        ("zeroshard_stage_1", 1, False, False),
        ("zeroshard_stage_2", 2, False, False),
        ("zeroshard_stage_2_offload", 2, True, False),
        ("zeroshard_stage_3", 3, False, False),
        ("zeroshard_stage_3_offload", 3, True, False),
        ("zeroshard_stage_3_offload_params", 3, True, True),
    ],
)
def test_registered_names(name, stage, offload, offload_params):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.zero_config.stage == stage
    assert trainer.strategy.zero_config.offload_optimizer is offload
    assert trainer.strategy.zero_config.offload_params is offload_params
    assert isinstance(trainer.strategy.precision_plugin, zeroshard.ZeroPrecision)
    assert trainer._accelerator_connector.is_distributed

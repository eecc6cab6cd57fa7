"""Settings users bring from Lightning's DeepSpeed and FSDP strategies: aliases with the same meaning, and errors that
name our setting for the ones without an equivalent. Both strategies (Trainer and Fabric) parse them the same way."""

from __future__ import annotations

import functools

import pytest
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

from zeroshard import ZeroFabricStrategy, ZeroStrategy


class Block(nn.Module):
    pass


@pytest.mark.parametrize("cls", [ZeroStrategy, ZeroFabricStrategy])
@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"stage": 3, "offload_optimizer": True, "offload_parameters": True}, {"offload_params": True}),
        ({"stage": 3, "auto_wrap_policy": {Block}}, {"wrap_policy": (Block,)}),
        ({"stage": 3, "auto_wrap_policy": ModuleWrapPolicy({Block})}, {"wrap_policy": (Block,)}),
        (
            {
                "stage": 3,
                "auto_wrap_policy": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            },
            {"wrap_policy": (Block,)},
        ),
        ({"stage": 2, "offload_optimizer": True, "offload_optimizer_device": "cpu"}, {"offload_optimizer": True}),
    ],
)
def test_deepspeed_and_fsdp_spellings_are_aliases(cls, kwargs, expected):
    config = cls(**kwargs)._core.config
    for name, value in expected.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize("cls", [ZeroStrategy, ZeroFabricStrategy])
def test_activation_checkpointing_aliases(cls):
    core = cls(activation_checkpointing_policy={Block}, cpu_checkpointing=True)._core
    assert core.activation_checkpointing == (Block,) and core.offload_activations


@pytest.mark.parametrize("cls", [ZeroStrategy, ZeroFabricStrategy])
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cpu_offload": True}, r"cpu_offload=.*offload_optimizer=True.*offload_params=True"),
        ({"sharding_strategy": "FULL_SHARD"}, r"sharding_strategy=.*stage=3 for FULL_SHARD"),
        ({"mixed_precision": object()}, r"mixed_precision=.*precision='bf16-mixed'"),
        ({"partition_activations": True}, r"partition_activations=.*activation_checkpointing="),
        ({"config": "ds.json"}, r"config=.*pass its settings as arguments"),
        ({"offload_optimizer_device": "nvme"}, r"offload_optimizer_device='nvme'.*host memory only"),
        (
            {"stage": 3, "offload_params": True, "offload_parameters": False},
            r"offload_parameters=.*pass only offload_params",
        ),
        ({"stage": 3, "auto_wrap_policy": lambda module, recurse, nonwrapped_numel: True}, r"FSDP policy function"),
    ],
)
def test_spellings_without_an_equivalent_name_our_setting(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("cls", [ZeroStrategy, ZeroFabricStrategy])
def test_unknown_setting_lists_the_accepted_ones(cls):
    with pytest.raises(TypeError, match=r"unexpected setting 'wrap_polcy'.*wrap_policy.*offload_parameters"):
        cls(wrap_polcy=Block)

"""The planner: per-GPU and per-host bytes, whether it fits, and a predicted step time, for every configuration
(ZeRO stage 1/2/3 x optimizer offload x parameter offload x hybrid shard group size) of a model on a cluster, before
anything is allocated. ``python -m zeroshard.plan --help``; ``ZeroStrategy(stage="auto")`` uses it at setup.

Modules: :mod:`~zeroshard.plan.model_spec` (the model, built on the meta device), :mod:`~zeroshard.plan.cluster`
(memory and rates), :mod:`~zeroshard.plan.memory` (itemised bytes), :mod:`~zeroshard.plan.step_time` (seconds),
:mod:`~zeroshard.plan.planner` (every configuration, the choice).
"""

from zeroshard.plan.cluster import PRESETS, Cluster
from zeroshard.plan.memory import Layout, Training, memory
from zeroshard.plan.model_spec import ModelSpec, callable_spec, gpt_spec, hf_config_spec, module_spec
from zeroshard.plan.planner import DEFAULT_MARGIN, choose, evaluate, largest_gpt, plan
from zeroshard.plan.step_time import step_time

__all__ = [
    "DEFAULT_MARGIN",
    "PRESETS",
    "Cluster",
    "Layout",
    "ModelSpec",
    "Training",
    "callable_spec",
    "choose",
    "evaluate",
    "gpt_spec",
    "hf_config_spec",
    "largest_gpt",
    "memory",
    "module_spec",
    "plan",
    "step_time",
]

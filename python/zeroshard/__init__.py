"""zeroshard: ZeRO stage 1/2/3 sharding, CPU offload and a fused CPU Adam for PyTorch Lightning.

Public API:
    ZeroStrategy: the strategy for ``lightning.Trainer`` (registered as ``zeroshard_stage_1``, ``zeroshard_stage_2``,
        ``zeroshard_stage_2_offload``, ``zeroshard_stage_3``, ``zeroshard_stage_3_offload``,
        ``zeroshard_stage_3_offload_params``).
    ZeroFabricStrategy: the same for ``lightning.Fabric`` (the same names, registered for Fabric).
    gathered_parameters: a context manager giving whole parameters at stage 3 (generation, inspection).
    init_meta_context: build a model on the meta device (nothing allocated until the strategy shards it).
    load_pretrained: load a safetensors checkpoint, each rank reading only the slices its shards need.
    load_from_checkpoint: ``cls.load_from_checkpoint`` that also reads sharded checkpoint directories (in memory).
    CPUAdam: fused Adam/AdamW for CPU tensors (AVX-512 / AVX2 / scalar, chosen at run time).
    DeviceAdam: the same step and state formats in torch ops, for parameters on any device (GPU master shards).
    cpu_isa: the instruction set CPUAdam uses on this machine.
    ZeroEngine, ZeroConfig: the engine without Lightning; engine_of(module): the engine built on a module, or None.
    CollectiveError, DivergedRanksError: what a failed or timed-out collective and ranks on different code paths raise.
    ops: functional entry points of the compiled core (``zeroshard.ops.adam_step``).
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from zeroshard import _C, ops  # noqa: F401
from zeroshard.checkpoint.load_from_checkpoint import load_from_checkpoint
from zeroshard.checkpoint.safe_paths import CheckpointError
from zeroshard.engine.config import ZeroConfig
from zeroshard.engine.engine import ZeroEngine
from zeroshard.engine.step_flags import NonFiniteGradientError
from zeroshard.gathered import gathered_parameters
from zeroshard.isa import cpu_isa, supported_cpu_isas
from zeroshard.meta_init import init_meta_context
from zeroshard.optim.cpu_adam import CPUAdam
from zeroshard.optim.device_adam import DeviceAdam
from zeroshard.optim.restore_checks import OptimizerRestoreError
from zeroshard.pretrained import load_pretrained
from zeroshard.sharding.collective_errors import CollectiveError, DivergedRanksError
from zeroshard.sharding.managed import engine_of
from zeroshard.strategies.fabric_precision import ZeroFabricPrecision
from zeroshard.strategies.fabric_strategy import ZeroFabricStrategy
from zeroshard.strategies.precision import ZeroPrecision
from zeroshard.strategies.strategy import ZeroStrategy

__version__ = "0.1.0"

__all__ = [
    "CPUAdam",
    "CheckpointError",
    "CollectiveError",
    "DeviceAdam",
    "DivergedRanksError",
    "NonFiniteGradientError",
    "OptimizerRestoreError",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroStrategy",
    "cpu_isa",
    "engine_of",
    "gathered_parameters",
    "init_meta_context",
    "load_from_checkpoint",
    "load_pretrained",
    "ops",
    "supported_cpu_isas",
]


def _register_strategies() -> None:
    # Lightning discovers only its own strategies; an external one registers its names when imported, in the Trainer's
    # registry and in Fabric's (two registries, as Lightning's own strategies have).
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    ZeroStrategy.register_strategies(StrategyRegistry)
    ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)


_register_strategies()

"""Settings that can only be judged at setup, once the model and the precision are known; run before anything changes.

Both strategies (:class:`zeroshard.ZeroStrategy`, :class:`zeroshard.ZeroFabricStrategy`) call these from
:meth:`zeroshard.strategies.strategy_core.StrategyCore.build_engine`, before the model is touched or sharded:

* :func:`check_model_settings` (errors): a ``wrap_policy`` or ``activation_checkpointing`` that selects no module of
  the model (:func:`zeroshard.engine.policy_check.check_policy_matches`), and ``reduce_dtype=torch.float16`` without
  ``precision="16-mixed"`` (fp16 gradients overflow above 65504, and only 16-mixed runs the loss scaler).
* :func:`check_callbacks` (errors, Trainer): Lightning's ``ModelPruning`` at stage 3 (pruning re-registers each
  pruned ``weight`` as ``weight_orig`` times a mask, which a sharded parameter cannot follow).
* :func:`warn_single_unit` (a warning, once per process, on rank 0): stage 3 with no ``wrap_policy`` makes the whole
  model one unit, all-gathered whole for every forward and backward. It runs (a small model may want exactly that),
  but a large one then holds every parameter on every rank at once.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from zeroshard.engine.config import ZeroConfig
from zeroshard.engine.policy_check import check_policy_matches, repeated_block
from zeroshard.sharding.units import wrap_predicate
from zeroshard.strategies.activation_checkpointing import policy_predicate

_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """``rank_zero_warn(message)`` the first time this process sees ``message``."""
    if message not in _WARNED:
        _WARNED.add(message)
        rank_zero_warn(message)


def check_model_settings(
    owner: str,
    module: nn.Module,
    config: ZeroConfig,
    activation_checkpointing,
    compute_dtype: torch.dtype | None,
) -> None:
    """Raises for a setting that means nothing for this model or precision.

    Args:
        owner: the strategy's class name, for messages.
        module: the model (on the meta device or not; only its module tree is read).
        config: the validated settings (with ``stage="auto"``, before the planner chooses: the user's ``wrap_policy``).
        activation_checkpointing: the strategy's policy, or ``None``.
        compute_dtype: the precision plugin's compute dtype (``None`` or ``torch.float32`` for ``32-true``).

    Raises:
        ValueError: a policy that selects no module (naming it and the model's candidate classes); fp16
            ``reduce_dtype`` with another compute dtype (naming both and the fix).
    """
    if config.wrap_policy is not None:
        check_policy_matches(
            owner,
            "wrap_policy",
            config.wrap_policy,
            module,
            wrap_predicate(config.wrap_policy),
            include_root=False,
            consequence="at stage 3 the whole model would be one unit, gathered whole for every forward and backward",
        )
    if activation_checkpointing is not None:
        check_policy_matches(
            owner,
            "activation_checkpointing",
            activation_checkpointing,
            module,
            policy_predicate(activation_checkpointing),
            include_root=True,
            consequence="nothing would be recomputed, and no activation memory saved",
        )
    compute = compute_dtype or torch.float32
    if config.reduce_dtype == torch.float16 and compute != torch.float16:
        precision = {torch.bfloat16: "bf16-mixed", torch.float32: "32-true"}.get(compute, str(compute))
        raise ValueError(
            f"{owner}(reduce_dtype=torch.float16) with precision='{precision}' (compute dtype {compute}): fp16 "
            "gradients overflow above 65504 and underflow below 6e-8, and only precision='16-mixed' runs the loss "
            f"scaler that keeps them in range. Use reduce_dtype=torch.bfloat16 (half the traffic, fp32's range) or "
            "reduce_dtype=None (fp32, the default); or train with precision='16-mixed'."
        )


def warn_single_unit(owner: str, module: nn.Module, config: ZeroConfig) -> None:
    """Stage 3 without ``wrap_policy``: warns once that the model is one unit, and how to set ``wrap_policy``."""
    if config.stage != 3 or config.wrap_policy is not None:
        return
    block = repeated_block(module)
    example = block.__qualname__ if block is not None else "<your transformer block class>"
    warn_once(
        f"{owner}(stage=3) without wrap_policy: the whole {type(module).__name__} is one unit, all-gathered before "
        "every forward and backward, so each rank holds all its parameters at once (stage 3 then saves no parameter "
        f"memory over stage 2). Set wrap_policy to the model's repeated block class, e.g. {owner}(stage=3, "
        f"wrap_policy={example}), a tuple of classes, a parameter-count threshold, or callable(name, module) -> bool."
    )


def check_callbacks(owner: str, stage: int, callbacks: list) -> None:
    """Raises for a Trainer callback this stage cannot serve: ``ModelPruning`` at stage 3.

    Raises:
        ValueError: naming the callback, the stage and the fix, before the first training step.
    """
    from lightning.pytorch.callbacks import ModelPruning

    pruning = [type(cb).__name__ for cb in callbacks if isinstance(cb, ModelPruning)]
    if stage == 3 and pruning:
        raise ValueError(
            f"{owner}(stage=3) cannot run the {pruning[0]} callback: pruning (torch.nn.utils.prune) replaces each "
            "pruned parameter 'weight' by 'weight_orig' times a mask, computed outside the module's forward, while at "
            "ZeRO stage 3 a parameter exists only as shards gathered inside its unit's forward. Prune at stage 1 or 2 "
            f"({owner}(stage=2): parameters stay whole on every rank), or prune before sharding and train the pruned "
            "model with the masks applied (torch.nn.utils.prune.remove)."
        )

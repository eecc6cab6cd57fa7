"""The settings of zeroshard's Lightning strategies, and the spellings users bring from Lightning's DeepSpeed and FSDP.

Both strategies (:class:`zeroshard.ZeroStrategy` for the Trainer, :class:`zeroshard.ZeroFabricStrategy` for Fabric)
take the same keyword settings: every :class:`~zeroshard.engine.config.ZeroConfig` field, plus
``activation_checkpointing``, ``offload_activations`` and ``state_dict_type``. Users switching from
``DeepSpeedStrategy`` or ``FSDPStrategy`` type those strategies' argument names; the ones with the same meaning here are
accepted as aliases, the ones without an equivalent fail at construction with an error naming the setting to use instead
(never silently ignored).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from zeroshard.engine.config import ZeroConfig
from zeroshard.engine.policy_check import check_policy

STATE_DICT_TYPES = ("full", "sharded")
MAX_TIMEOUT = timedelta(days=365)  # longer waits hang a job in practice; 1e300 s overflowed timedelta
_STRATEGY_LEVEL = {"activation_checkpointing": None, "offload_activations": False, "state_dict_type": "sharded"}


def _module_classes(name: str, value: Any) -> Any:
    """FSDP-style wrap policies -> ours: a set/list of module classes, ``ModuleWrapPolicy`` or
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=...)`` become a tuple of classes."""
    if isinstance(value, (set, frozenset, list)) and all(isinstance(c, type) for c in value):
        return tuple(sorted(value, key=lambda c: c.__qualname__))
    classes = getattr(value, "_module_classes", None)  # torch.distributed.fsdp.wrap.ModuleWrapPolicy
    if classes is not None:
        return tuple(classes)
    if isinstance(value, functools.partial) and "transformer_layer_cls" in value.keywords:
        return tuple(value.keywords["transformer_layer_cls"])
    if callable(value) and not isinstance(value, type):
        params = list(inspect.signature(value).parameters)
        if "recurse" in params or "nonwrapped_numel" in params:
            raise ValueError(
                f"{name}={value!r} is an FSDP policy function (module, recurse, nonwrapped_numel); zeroshard takes "
                "module classes (a class, a tuple or set of them) or callable(name, module) -> bool."
            )
    return value


def _same(name: str, value: Any) -> Any:
    return value


def _cpu_only(name: str, value: Any) -> None:
    if value != "cpu":
        raise ValueError(f"{name}={value!r}: zeroshard offloads to host memory only; drop it or use {name}='cpu'.")
    return None


# Lightning's DeepSpeed/FSDP argument -> (our setting, where it comes from, value conversion). ``None`` as our setting:
# accepted for its one value that describes what zeroshard does anyway, then dropped.
ALIASES: dict[str, tuple[str | None, str, Callable[[str, Any], Any]]] = {
    "offload_parameters": ("offload_params", "DeepSpeedStrategy", _same),
    "cpu_checkpointing": ("offload_activations", "DeepSpeedStrategy", _same),
    "offload_optimizer_device": (None, "DeepSpeedStrategy", _cpu_only),
    "offload_params_device": (None, "DeepSpeedStrategy", _cpu_only),
    "auto_wrap_policy": ("wrap_policy", "FSDPStrategy", _module_classes),
    "activation_checkpointing_policy": ("activation_checkpointing", "FSDPStrategy", _module_classes),
}

# Lightning's DeepSpeed/FSDP arguments that have no equivalent here: what to use instead.
REJECTED = {
    "cpu_offload": "FSDP's cpu_offload moves parameters, gradients and the step to the CPU; here use "
    "offload_optimizer=True (master weights, optimizer state and the step on the host) and, at stage=3, "
    "offload_params=True (parameter shards in host memory too)",
    "sharding_strategy": "use stage=3 for FULL_SHARD, stage=2 for SHARD_GRAD_OP (stage=1 shards the optimizer "
    "state only; NO_SHARD is strategy='ddp')",
    "mixed_precision": "set precision='bf16-mixed' or '16-mixed' on the Trainer/Fabric; reduce_dtype= sets the "
    "dtype gradients are reduced in",
    "partition_activations": "activations are not partitioned across ranks; activation_checkpointing= (with "
    "offload_activations=True) recomputes them and keeps their inputs on the host",
    "config": "DeepSpeed's JSON config is not read: pass its settings as arguments (stage=, offload_optimizer=, "
    "offload_params=, reduce_bucket_size=, allgather_bucket_size=)",
    "zero_optimization": "pass stage= (1, 2 or 3)",
}


def setting_defaults() -> dict[str, Any]:
    """Every setting's name and default value."""
    return {f.name: f.default for f in dataclasses.fields(ZeroConfig)} | _STRATEGY_LEVEL


def parse_settings(owner: str, settings: dict[str, Any]) -> tuple[ZeroConfig, dict[str, Any]]:
    """Splits keyword settings into a validated :class:`ZeroConfig` and the strategy-level settings.

    Args:
        owner: the strategy's class name, for messages.
        settings: our settings and accepted aliases, by keyword.

    Returns:
        ``(config, {"activation_checkpointing", "offload_activations", "state_dict_type"})``.

    Raises:
        ValueError: for a rejected DeepSpeed/FSDP argument (naming ours), an alias given together with a non-default
            value of our setting, or an invalid value (from :class:`ZeroConfig`, or of a strategy-level setting).
        TypeError: for an unknown setting, listing the accepted ones.
    """
    defaults = setting_defaults()
    for name in settings:
        if name in REJECTED:
            raise ValueError(f"{owner}({name}=...) is not a zeroshard setting: {REJECTED[name]}.")
        if name not in defaults and name not in ALIASES:
            raise TypeError(
                f"{owner} got an unexpected setting {name!r}. Settings: {', '.join(defaults)}; also accepted from "
                f"Lightning's DeepSpeed/FSDP strategies: {', '.join(ALIASES)}."
            )
    ours = {name: value for name, value in settings.items() if name in defaults}
    for name, value in settings.items():
        if name not in ALIASES:
            continue
        target, origin, convert = ALIASES[name]
        value = convert(name, value)
        if target is None:
            continue
        if target in ours and ours[target] != defaults[target]:
            raise ValueError(
                f"{owner}: {name}= ({origin}'s name) and {target}= set the same thing; pass only {target}=."
            )
        ours[target] = value
    for name in ("wrap_policy", "activation_checkpointing"):
        if name in ours:
            ours[name] = _module_classes(name, ours[name])
    extra = {k: ours.pop(k, default) for k, default in _STRATEGY_LEVEL.items()}
    config = ZeroConfig(**ours)
    check_policy(owner, "activation_checkpointing", extra["activation_checkpointing"], threshold=False)
    if extra["activation_checkpointing"] is None and extra["offload_activations"]:
        raise ValueError(f"{owner}(offload_activations=True) needs activation_checkpointing=<module class or policy>.")
    if extra["state_dict_type"] not in STATE_DICT_TYPES:
        raise ValueError(f"{owner}(state_dict_type={extra['state_dict_type']!r}) must be 'full' or 'sharded'.")
    return config, extra


def as_timeout(owner: str, timeout: Any) -> timedelta | None:
    """The strategies' ``timeout=`` as torch wants it: a ``timedelta`` (or ``None``, torch's default) as given, a
    number as seconds.

    Raises:
        TypeError: for another type, naming it and the accepted ones.
        ValueError: for a timeout that is not a positive duration of at most ``MAX_TIMEOUT`` (365 days).
    """
    if timeout is None:
        return None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if not math.isfinite(timeout):
            raise ValueError(f"{owner}(timeout={timeout!r}) must be a finite number of seconds or a timedelta.")
        if timeout > MAX_TIMEOUT.total_seconds():  # before timedelta(), which overflows from 1e14 seconds
            raise ValueError(
                f"{owner}(timeout={timeout!r}) seconds is longer than {MAX_TIMEOUT.days} days, the longest accepted: "
                "a collective that waits longer hangs the job in practice. Pass e.g. 7200 (two hours)."
            )
        timeout = timedelta(seconds=timeout)
    elif not isinstance(timeout, timedelta):
        raise TypeError(
            f"{owner}(timeout={timeout!r}) is a {type(timeout).__name__}: pass a datetime.timedelta (e.g. "
            "timedelta(minutes=10)) or a number of seconds."
        )
    if timeout > MAX_TIMEOUT:
        raise ValueError(
            f"{owner}(timeout={timeout!r}) is longer than {MAX_TIMEOUT.days} days, the longest accepted: a collective "
            "that waits longer hangs the job in practice. Pass e.g. timedelta(hours=2)."
        )
    if timeout.total_seconds() <= 0:
        raise ValueError(
            f"{owner}(timeout={timeout!r}) must be positive: it is how long a collective waits for the other ranks "
            "before the job ends with an error (e.g. timedelta(minutes=10), or 600 seconds)."
        )
    return timeout


# Names registered for both lightning.Trainer(strategy=...) and lightning.Fabric(strategy=...). Unlike
# ``deepspeed_stage_3_offload``, which offloads parameters too, ``zeroshard_stage_3_offload`` offloads the optimizer
# only; ``zeroshard_stage_3_offload_params`` offloads both.
REGISTERED_NAMES = (
    ("zeroshard_stage_1", "ZeRO stage 1: optimizer state sharded", {"stage": 1}),
    ("zeroshard_stage_2", "ZeRO stage 2: optimizer state and gradients sharded", {"stage": 2}),
    (
        "zeroshard_stage_2_offload",
        "ZeRO stage 2 with master weights and optimizer state offloaded to the CPU (fused CPUAdam)",
        {"stage": 2, "offload_optimizer": True},
    ),
    ("zeroshard_stage_3", "ZeRO stage 3: parameters, gradients and optimizer state sharded", {"stage": 3}),
    (
        "zeroshard_stage_3_offload",
        "ZeRO stage 3 with master weights and optimizer state offloaded to the CPU (pipelined fused CPU Adam); "
        "parameters stay on the device (deepspeed_stage_3_offload offloads them too: zeroshard_stage_3_offload_params)",
        {"stage": 3, "offload_optimizer": True},
    ),
    (
        "zeroshard_stage_3_offload_params",
        "ZeRO stage 3 with the optimizer and the parameter shards offloaded to (pinned) host memory",
        {"stage": 3, "offload_optimizer": True, "offload_params": True},
    ),
)


def register_names(cls: type, registry) -> None:
    """Registers :data:`REGISTERED_NAMES` for ``cls`` in a Lightning (Trainer or Fabric) strategy registry."""
    for name, description, params in REGISTERED_NAMES:
        registry.register(name, cls, description=description, override=True, **params)

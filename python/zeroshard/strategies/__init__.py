"""The Lightning side: :class:`~zeroshard.strategies.strategy.ZeroStrategy` (Trainer) and
:class:`~zeroshard.strategies.fabric_strategy.ZeroFabricStrategy` (Fabric) over one shared
:class:`~zeroshard.strategies.strategy_core.StrategyCore`, their settings, setup checks, precision plugins,
``stage="auto"`` (the planner's choice), activation checkpointing and the process group's lifetime.

The top layer: may import any other zeroshard layer; nothing below imports it (only ``zeroshard/__init__.py``, which
re-exports the public strategies and precision plugins).
"""

"""The ZeRO engine without Lightning: :class:`~zeroshard.engine.engine.ZeroEngine` (stages 1-3 for one module and its
optimizers), its :class:`~zeroshard.engine.config.ZeroConfig` and policy checks, and the shard-aware fp16 loss scaler.

May import every layer below it: :mod:`zeroshard.plan` (the default unit class), the init layer
(:mod:`zeroshard.meta_init`, :mod:`zeroshard.pretrained`, :mod:`zeroshard.init`), :mod:`zeroshard.offload`,
:mod:`zeroshard.optim`, :mod:`zeroshard.sharding` and ``zeroshard._C``; never :mod:`zeroshard.checkpoint` or
:mod:`zeroshard.strategies`.
"""

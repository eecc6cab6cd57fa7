"""Optimizers over the shards: the fused :class:`~zeroshard.optim.cpu_adam.CPUAdam`, a user optimizer pointed at the
fp32 master shards, and consolidated optimizer state in torch's format.

May import ``zeroshard._C`` and :mod:`zeroshard.sharding`; never the engine, offload, checkpoint or strategies.
"""

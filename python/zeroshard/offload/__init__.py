"""ZeRO-Offload: optimizer state (and parameters) on the host, the CPU step pipelined with the copies and overlapped
with backward.

May import ``zeroshard._C``, :mod:`zeroshard.optim` and :mod:`zeroshard.sharding`; never the engine, checkpoint or
strategies.
"""

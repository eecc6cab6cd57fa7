"""Sharded state and its collectives: flat parameters cut into one shard per rank, stage-3 units and their
placeholders, gradient reduction, hybrid-sharding groups, the gather tag check, collective errors, communication volume.

The lowest layer above the compiled core: imports only ``zeroshard._C`` (and torch), never another zeroshard
subpackage.
"""

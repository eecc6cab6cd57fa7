"""Sharded checkpoints: each rank's flat shards, the versioned directory and its commit protocol, verification before
loading, Lightning's trainer state without pickle, and the Hugging Face export map. ``python -m zeroshard.consolidate``
(top level, the user's command) reads them back into plain files.

Self-contained: imports no other zeroshard layer (torch, safetensors, numpy and Lightning's ``rank_zero_info``), so a
checkpoint can be read without the engine.
"""

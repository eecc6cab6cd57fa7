"""The process group a zeroshard strategy creates is destroyed at exit (``zeroshard.strategies.process_group``).

A gloo group left alive at interpreter shutdown can abort the process (exit -6, pytorch/pytorch#190489): seen on CI at
the end of a 2-rank fit. Both loops here must leave the group usable after training and gone before shutdown.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import run_ranks


@pytest.mark.parametrize("loop", ["trainer", "fabric"])
def test_group_created_by_the_strategy_is_destroyed_at_exit(tmp_path, loop):
    run_ranks(Path(__file__).parent / "scripts" / "exit_clean.py", [str(tmp_path), loop], timeout=300)
    for rank in range(2):
        assert json.loads((tmp_path / f"exit_rank{rank}.json").read_text()) == {"alive_at_exit": False}, rank

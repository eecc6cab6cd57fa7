"""ZeRO stage 3 beyond parity: ranks that take different code paths end the job with an error, never a hang."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_ranks

SCRIPTS = Path(__file__).parent / "scripts"


def test_divergent_ranks_are_named_with_check_gather_order():
    with pytest.raises(AssertionError) as info:
        run_ranks(SCRIPTS / "diverge.py", ["1"], timeout=120)
    report = str(info.value)
    assert report.count("zeroshard: ranks diverged at all-gather") >= 2, report[-4000:]  # both ranks name it
    assert "'blocks.1'" in report and "'blocks.0'" in report


def test_divergent_ranks_end_the_job_without_the_check():
    # without the debug check the mismatched collective still fails fast (gloo names the mismatch); what must not
    # happen is a hang until the deadline
    with pytest.raises(AssertionError) as info:
        run_ranks(SCRIPTS / "diverge.py", ["0"], timeout=120)
    assert "killed after" not in str(info.value)

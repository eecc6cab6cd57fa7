"""Checks of what an engine's optimizer holds per flat parameter under a state format (``scripts/state_format_runs.py``
writes the facts): moment dtypes, absmax presence and the bytes, from the parameters' sizes alone."""

from __future__ import annotations

MIN_8BIT_SIZE = 4096  # bitsandbytes' default and CPUAdam's: smaller tensors keep fp32 moments under int8


def assert_state_facts(fmt: str, facts: dict) -> None:
    """bf16: every flat parameter's moments bf16 (4 bytes per element). int8: each flat parameter holds only small
    (fp32 moments, 8 bytes) or only large parameters (uint8 codes + an fp32 absmax per 2048-element block)."""
    numel = sum(facts["shard_numels"])
    if fmt == "bf16":
        assert set(facts["moment_dtypes"]) == {"torch.bfloat16"} and not any(facts["absmax"])
        assert facts["optimizer_state_bytes"] == 4 * numel  # the fp32 format would hold 8
        return
    small = [all(n < MIN_8BIT_SIZE for n in numels) for numels in facts["param_numels"]]
    assert [not any(n < MIN_8BIT_SIZE for n in numels) for numels in facts["param_numels"]] == [not s for s in small]
    assert any(small) and not all(small)
    assert facts["moment_dtypes"] == ["torch.float32" if s else "torch.uint8" for s in small]
    assert facts["absmax"] == [not s for s in small]
    q = [n for n, s in zip(facts["shard_numels"], small) if not s]
    fp32 = sum(n for n, s in zip(facts["shard_numels"], small) if s)
    assert facts["optimizer_state_bytes"] == 2 * sum(q) + 8 * sum(-(-n // 2048) for n in q) + 8 * fp32

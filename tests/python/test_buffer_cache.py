"""The CPU buffer cache (``_C.cached_empty``) that stage 3's gathered buffers, all-gather staging and full gradients
come from: memory freed by a buffer is handed to the next buffer of the same byte size, within the limit, and a
stage-3 full buffer keeps its storage object across free and re-gather (what autograd saved in forward points into
it)."""

from __future__ import annotations

import pytest
import torch

from zeroshard import _C

N = 1 << 18  # 1 MiB of fp32


@pytest.fixture
def limit():
    before = _C.buffer_cache_stats()["limit_bytes"]
    _C.set_buffer_cache_limit(0)  # start empty: drop what earlier tests left
    yield _C.set_buffer_cache_limit
    _C.set_buffer_cache_limit(before)


def test_a_freed_block_serves_the_next_allocation_of_its_size(limit):
    limit(4 * N)
    a = _C.cached_empty(N, torch.float32)
    ptr = a.data_ptr()
    del a  # back to the cache
    assert _C.buffer_cache_stats()["cached_bytes"] == 4 * N
    hits = _C.buffer_cache_stats()["hits"]
    b = _C.cached_empty(N, torch.float32)
    assert b.data_ptr() == ptr and _C.buffer_cache_stats()["hits"] == hits + 1
    c = _C.cached_empty(N // 2, torch.float32)  # another size: fresh memory
    assert c.data_ptr() != ptr
    assert _C.buffer_cache_stats()["cached_bytes"] == 0


def test_nothing_is_kept_beyond_the_limit(limit):
    limit(4 * N)
    a, b = _C.cached_empty(N, torch.float32), _C.cached_empty(N, torch.float32)
    del a, b  # the second does not fit
    assert _C.buffer_cache_stats()["cached_bytes"] == 4 * N
    limit(0)  # lowering frees
    assert _C.buffer_cache_stats()["cached_bytes"] == 0
    with pytest.raises(ValueError, match="must be >= 0"):
        limit(-1)
    with pytest.raises(ValueError, match="negative"):
        _C.cached_empty(-1, torch.float32)


def test_a_resized_storage_keeps_its_identity_and_reuses_memory(limit):
    limit(4 * N)
    full = _C.cached_empty(N, torch.float32).fill_(1.0)
    saved = full[10:20].view(2, 5)  # as autograd keeps a view of a gathered weight from forward
    storage = full.untyped_storage()
    ptr = storage.data_ptr()
    storage.resize_(0)  # stage 3 frees the unit
    assert _C.buffer_cache_stats()["cached_bytes"] == 4 * N
    storage.resize_(4 * N)  # and gathers it again
    assert storage.data_ptr() == ptr and _C.buffer_cache_stats()["cached_bytes"] == 0
    full.fill_(2.0)  # the all-gather's new values
    assert torch.equal(saved, torch.full((2, 5), 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cached_buffers_are_ordinary_cpu_tensors(limit, dtype):
    t = _C.cached_empty(1000, dtype)
    assert t.shape == (1000,) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % 64 == 0
    t.copy_(torch.arange(1000, dtype=dtype))
    assert torch.equal(t, torch.arange(1000, dtype=dtype))
    assert _C.cached_empty(0, dtype).numel() == 0

"""The small per-layer append cache: appends, growth, limits, typed errors, byte counts."""

from __future__ import annotations

import pytest
import torch

from kvcache import KVCache
from kvcache.errors import CacheFullError, DimensionMismatchError, InvalidArgumentError


def test_append_and_get_views_in_order():
    cache = KVCache(num_layers=2, num_heads=3, head_dim=4, max_seq_len=100)
    chunks = [torch.randn(n, 3, 4, dtype=torch.float64) for n in (5, 1, 30, 1)]
    for c in chunks:
        cache.append_kv(0, c, 2 * c)
    k, v = cache.get_kv(0)
    assert torch.equal(k, torch.cat(chunks)) and torch.equal(v, 2 * torch.cat(chunks))
    assert cache.current_len() == cache.seq_len == 37
    assert cache.get_kv(1)[0].shape == (0, 3, 4)
    assert cache.get_kv(2) is None and cache.get_kv(-1) is None
    assert cache.keys[0].shape == (37, 3, 4) and len(cache.values) == 2
    assert (cache.max_seq_len, cache.num_layers, cache.num_heads) == (100, 2, 3)


def test_growth_is_geometric_not_per_append():
    cache = KVCache(1, 1, 8, max_seq_len=10_000)
    ptrs = set()
    for _ in range(1000):
        cache.append_kv(0, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8))
        ptrs.add(cache._k[0].data_ptr())
    assert len(ptrs) <= 8  # 16 -> 32 -> ... -> 1024: 7 buffers, not 1000


def test_exceeding_max_len_appends_nothing():
    cache = KVCache(1, 2, 2, max_seq_len=4)
    cache.append_kv(0, torch.ones(3, 2, 2), torch.ones(3, 2, 2))
    with pytest.raises(CacheFullError) as err:
        cache.append_kv(0, torch.ones(2, 2, 2), torch.ones(2, 2, 2))
    assert (err.value.needed, err.value.free, err.value.capacity) == (2, 1, 4)
    assert cache.current_len() == 3
    cache.append_kv(0, torch.ones(1, 2, 2), torch.ones(1, 2, 2))
    assert cache.current_len() == 4


@pytest.mark.parametrize(
    "layer, k, v, error",
    [
        (2, torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), InvalidArgumentError),
        (-1, torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), InvalidArgumentError),
        ("0", torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), InvalidArgumentError),
        (0, torch.zeros(1, 3, 2), torch.zeros(1, 3, 2), DimensionMismatchError),
        (0, torch.zeros(2, 2), torch.zeros(2, 2), DimensionMismatchError),
        (0, torch.zeros(1, 2, 2), torch.zeros(2, 2, 2), DimensionMismatchError),
        (0, torch.zeros(1, 2, 2, dtype=torch.int32), torch.zeros(1, 2, 2), InvalidArgumentError),
        (0, [[0.0]], torch.zeros(1, 2, 2), InvalidArgumentError),
    ],
)
def test_bad_input_is_typed_and_appends_nothing(layer, k, v, error):
    cache = KVCache(2, 2, 2, max_seq_len=8)
    with pytest.raises(error):
        cache.append_kv(layer, k, v)
    assert cache.current_len() == 0 and cache.memory_usage_bytes() == 0


def test_memory_usage_honours_element_size():
    for dtype, size in ((torch.float64, 8), (torch.float32, 4), (torch.bfloat16, 2)):
        cache = KVCache(3, 2, 16, max_seq_len=64, dtype=dtype)
        cache.append_kv(1, torch.zeros(5, 2, 16), torch.zeros(5, 2, 16))
        assert cache.memory_usage_bytes() == 2 * 5 * 2 * 16 * size
        assert cache.allocated_bytes() >= cache.memory_usage_bytes()
    with pytest.raises(InvalidArgumentError):
        KVCache(0, 2, 2, 8)

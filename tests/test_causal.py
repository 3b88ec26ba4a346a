"""Exact-state scenarios for the causal cell cache: masks, placement, eviction, sharing,
removal with shifting, cache full and every typed error."""

from __future__ import annotations

import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.errors import (
    CacheFullError,
    CallOrderError,
    DimensionMismatchError,
    InvalidArgumentError,
    InvalidConfigError,
    KVCacheError,
    NotSupportedError,
)
from support import add_shift, kv, render, stored_keys


def step(cache: CausalCache, positions, seqs, keys=None, layer=0):
    """One forward of one layer: returns (keys[:, 0, 0] list, mask strings)."""
    cache.start_forward(Batch(positions, seqs))
    k, v = kv(keys if keys is not None else [float(p) for p in positions])
    keys_out, values_out, mask = cache.update(layer, k, v)
    return keys_out[:, 0, 0].tolist(), render(mask)


def test_full_causal_prefill_then_decode():
    cache = CausalCache(8, dtype=torch.float64)
    keys, mask = step(cache, [0, 1, 2], [0, 0, 0])
    assert keys == [0.0, 1.0, 2.0]
    assert mask == ["0 x x", "0 0 x", "0 0 0"]
    keys, mask = step(cache, [3], [0])
    assert keys == [0.0, 1.0, 2.0, 3.0]
    assert mask == ["0 0 0 0"]
    assert cache.positions(0) == [0, 1, 2, 3]


def test_two_sequences_one_batch_do_not_see_each_other():
    cache = CausalCache(4, max_sequences=2, dtype=torch.float64)
    _, mask = step(cache, [0, 1, 0, 1], [0, 0, 1, 1])
    assert mask == ["0 x x x", "0 0 x x", "x x 0 x", "x x 0 0"]
    _, mask = step(cache, [2, 2], [1, 0])
    assert mask == ["x x 0 0 0 x", "0 0 x x x 0"]


def test_sliding_window_evicts_and_reuses_cells():
    # W=1: memory 1, cells = 1 * 1 + max_batch 4 = 5
    cache = CausalCache(16, window=1, max_batch=4, dtype=torch.float64)
    assert cache.num_cells == 5
    _, mask = step(cache, [0, 1, 2, 3], [0, 0, 0, 0])
    assert mask == ["0 x x x", "0 0 x x", "x 0 0 x", "x x 0 0"]
    # pos 4 evicts pos < 4 - 1: cells 0..2 are free; 4, 5 land in cells 0, 1
    keys, mask = step(cache, [4, 5], [0, 0])
    assert keys[:2] == [4.0, 5.0] and keys[3] == 3.0  # cell 2 is stale (pos 2), masked
    assert mask == ["0 x x 0", "0 0 x x"]
    assert cache.positions(0) == [3, 4, 5]


def test_window_with_memory_two_sequences():
    # W=1, 2 sequences: memory >= W + 1 = 2; cells = 2 * 2 + 2 = 6 (Ollama's example)
    cache = CausalCache(16, max_sequences=2, window=1, max_batch=2, dtype=torch.float64)
    assert (cache.memory, cache.num_cells) == (2, 6)
    _, mask = step(cache, [0, 1, 0, 1], [0, 0, 1, 1])
    assert mask == ["0 x x x", "0 0 x x", "x x 0 x", "x x 0 0"]
    _, mask = step(cache, [2], [0])  # cell 4; history = cells 1..4 (pos >= 2 - 1)
    assert mask == ["0 x x 0"]
    # s0 pos 3 evicts its pos 0 (< 3 - 2) -> cell 0; s1 pos 2 -> cell 5
    keys, mask = step(cache, [3, 2], [0, 1], keys=[30.0, 21.0])
    assert keys[0] == 30.0 and keys[5] == 21.0
    assert mask == ["0 x x x 0 x", "x x x 0 x 0"]
    assert cache.positions(0) == [1, 2, 3] and cache.positions(1) == [0, 1, 2]
    assert [cache.can_resume(0, p) for p in range(6)] == [False, False, True, True, True, False]
    assert cache.can_resume(1, 1) and not cache.can_resume(1, 4)
    assert not cache.can_resume(5, 0)  # unknown sequence, limited memory


def test_can_resume_after_eviction_like_ollama():
    cache = CausalCache(16, window=4, max_batch=8, dtype=torch.float64)
    step(cache, [0, 1, 2, 3, 4], [0] * 5)
    assert all(cache.can_resume(0, p) for p in range(5))
    step(cache, [5], [0])  # evicts pos 0 (< 5 - 4)
    assert [cache.can_resume(0, p) for p in range(6)] == [False] * 5 + [True]
    unlimited = CausalCache(16)
    assert unlimited.can_resume(3, 100)  # no eviction: always resumable


def test_memory_larger_than_window_keeps_more():
    cache = CausalCache(16, window=4, memory=5, max_batch=8, dtype=torch.float64)
    step(cache, list(range(7)), [0] * 7)
    step(cache, [7], [0])  # evicts pos < 7 - 5 = 2
    assert cache.positions(0) == [2, 3, 4, 5, 6, 7]
    assert [cache.can_resume(0, p) for p in range(10)][:9] == [False] * 6 + [True, True, True]


def test_chunked_attention():
    cache = CausalCache(8, chunk=2, dtype=torch.float64)
    _, mask = step(cache, [0, 1, 2, 3, 4], [0] * 5)
    assert mask == [
        "0 x x x x",
        "0 0 x x x",
        "x x 0 x x",
        "x x 0 0 x",
        "x x x x 0",
    ]


def test_set_causal_exempts_rows_but_keeps_window():
    cache = CausalCache(8, window=1, memory=8, dtype=torch.float64)
    cache.start_forward(Batch([0, 1, 2], [0, 0, 0]))
    k, v = kv([0.0, 1.0, 2.0])
    cache.put(0, k, v)
    cache.set_causal([1])
    assert render(cache.get(0)[2]) == ["0 x x", "0 0 0", "x 0 0"]
    cache.set_causal([])
    assert render(cache.get(0)[2]) == ["0 x x", "0 0 x", "x 0 0"]
    with pytest.raises(InvalidArgumentError, match="except_rows"):
        cache.set_causal([3])
    cache.start_forward(Batch([3], [0]))  # start_forward clears the exceptions
    cache.put(0, *kv([3.0]))
    assert render(cache.get(0)[2]) == ["x x 0 0"]


def test_copy_prefix_shares_cells_then_diverges():
    cache = CausalCache(8, max_sequences=2, dtype=torch.float64)
    step(cache, [0, 1, 2, 3], [0] * 4, keys=[10.0, 11.0, 12.0, 13.0])
    cache.copy_prefix(0, 1, 2)
    assert cache.positions(1) == [0, 1]
    assert cache.used_cells() == 4  # shared, not copied
    keys, mask = step(cache, [4, 2], [0, 1], keys=[14.0, 22.0])
    assert keys == [10.0, 11.0, 12.0, 13.0, 14.0, 22.0]
    assert mask == ["0 0 0 0 0 x", "0 0 x x x 0"]
    # seq 1 drops its cells (shared ones stay with seq 0) when it copies again
    cache.copy_prefix(0, 1, 1)
    assert cache.positions(1) == [0] and cache.used_cells() == 5
    cache.copy_prefix(0, 0, 2)  # keeps seq 0's positions < 2 (Ollama would wipe it)
    assert cache.positions(0) == [0, 1] and cache.used_cells() == 2
    cache.copy_prefix(7, 1, 5)  # from an unknown sequence: dst becomes known but empty
    assert cache.positions(1) == [] and cache.used_cells() == 2


def test_remove_middle_shifts_later_keys():
    cache = CausalCache(8, shift=add_shift, dtype=torch.float64)
    cache.start_forward(Batch([0, 1, 2, 3, 4], [0] * 5))
    cache.put(0, *kv([0.0, 10.0, 20.0, 30.0, 40.0]))
    cache.put(1, *kv([0.5] * 5))
    cache.remove(0, 1, 3)
    assert cache.positions(0) == [0, 1, 2]
    # cells 3, 4 moved from pos 3, 4 down by 2 in every layer; cells 1, 2 are free
    assert stored_keys(cache, 1)[:, 0, 0].tolist()[:5] == [0.5, 0.5, 0.5, -1.5, -1.5]
    keys, mask = step(cache, [3], [0], keys=[99.0])
    assert keys == [0.0, 99.0, 20.0, 28.0, 38.0]
    assert mask == ["0 0 x 0 0"]


def test_remove_like_ollama_test_remove():
    cache = CausalCache(16, max_sequences=2, shift=add_shift, dtype=torch.float64)
    step(cache, [0, 1, 0, 1], [0, 0, 1, 1], keys=[1.0, 5.0, 3.0, 4.0])
    cache.remove(0, 1)  # frees cell 1
    keys, _ = step(cache, [1, 2], [0, 1], keys=[5.0, 7.0])
    assert keys[1] == 5.0 and keys[4] == 7.0  # cells 1 and 4
    cache.remove(0, 0, 1)  # frees cell 0, moves cell 1 from pos 1 to 0: key 5 -> 4
    assert cache.positions(0) == [0]
    assert stored_keys(cache, 0)[1, 0, 0].item() == 4.0
    assert stored_keys(cache, 0)[4, 0, 0].item() == 7.0  # seq 1 untouched


def test_failed_remove_changes_nothing():
    cache = CausalCache(8, max_sequences=2, dtype=torch.float64)
    step(cache, [0, 1, 2, 3], [0] * 4)
    before = stored_keys(cache, 0).clone()
    with pytest.raises(NotSupportedError, match="shift"):
        cache.remove(0, 1, 2)
    assert cache.positions(0) == [0, 1, 2, 3]
    assert torch.equal(stored_keys(cache, 0), before)
    cache.remove(0, 2, 9)  # nothing after end moves: no shift needed
    assert cache.positions(0) == [0, 1]
    shifting = CausalCache(8, max_sequences=2, shift=add_shift, dtype=torch.float64)
    step(shifting, [0, 1, 2, 3], [0] * 4)
    shifting.copy_prefix(0, 1, 4)
    with pytest.raises(NotSupportedError, match="shared"):
        shifting.remove(0, 0, 1)
    assert shifting.positions(0) == [0, 1, 2, 3] and shifting.positions(1) == [0, 1, 2, 3]
    shifting.remove(0, 2)  # to the end never fails, shared or not
    assert shifting.positions(0) == [0, 1] and shifting.positions(1) == [0, 1, 2, 3]
    assert isinstance(NotSupportedError("x"), KVCacheError)


def test_shift_error_leaves_cache_unchanged():
    def broken(layer, keys, offsets):
        raise RuntimeError("rope exploded")

    cache = CausalCache(8, shift=broken, dtype=torch.float64)
    step(cache, [0, 1, 2], [0] * 3)
    with pytest.raises(RuntimeError, match="rope exploded"):
        cache.remove(0, 0, 1)
    assert cache.positions(0) == [0, 1, 2]


def test_shift_is_called_in_chunks_of_max_batch():
    calls = []

    def record(layer, keys, offsets):
        calls.append((layer, len(keys), offsets.tolist()))
        return keys

    cache = CausalCache(16, max_batch=2, shift=record, dtype=torch.float64)
    step(cache, list(range(6)), [0] * 6)
    cache.remove(0, 0, 1)
    assert calls == [(0, 2, [-1, -1]), (0, 2, [-1, -1]), (0, 1, [-1])]


def test_cache_full_changes_nothing():
    cache = CausalCache(4, dtype=torch.float64)
    step(cache, [0, 1, 2], [0] * 3)
    with pytest.raises(CacheFullError) as err:
        cache.start_forward(Batch([3, 4], [0, 0]))
    assert (err.value.needed, err.value.free, err.value.capacity) == (2, 1, 4)
    assert "needs 2 cells, 1 free" in str(err.value)
    assert cache.positions(0) == [0, 1, 2] and cache.used_cells() == 3
    with pytest.raises(CallOrderError):
        cache.get(0)  # the failed forward is not in progress


def test_cache_full_does_not_evict():
    cache = CausalCache(16, window=1, max_batch=1, dtype=torch.float64)
    assert cache.num_cells == 2
    step(cache, [0], [0])
    step(cache, [1], [0])
    with pytest.raises(CacheFullError):
        cache.start_forward(Batch([2, 3], [0, 0]))  # would evict pos 0, still one short
    assert cache.positions(0) == [0, 1]
    step(cache, [2], [0])  # evicts pos 0 and reuses its cell
    assert cache.positions(0) == [1, 2]


def test_padding_rounds_cells_and_history():
    cache = CausalCache(5, padding=4, dtype=torch.float64)
    assert cache.num_cells == 8
    _, mask = step(cache, [0, 1], [0, 0])
    assert mask == ["0 x x x", "0 0 x x"]


def test_get_returns_views_not_copies():
    cache = CausalCache(64, dtype=torch.float64)
    step(cache, list(range(10)), [0] * 10)
    cache.start_forward(Batch([10], [0]))
    k, v = kv([10.0])
    keys, values, _ = cache.update(0, k, v)
    storage = cache.storage.layers[0]
    assert keys.data_ptr() == storage.keys.data.data_ptr()
    assert values.data_ptr() == storage.values.data.data_ptr()


def test_reserve_touches_no_bookkeeping():
    cache = CausalCache(8, dtype=torch.float64)
    step(cache, [0, 1], [0, 0], keys=[5.0, 6.0])
    cache.start_forward(Batch(list(range(4)), [0] * 4), reserve=True)
    cache.put(0, *kv([9.0] * 4))
    cache.put(3, *kv([9.0] * 4))  # allocates layer 3
    keys, _, mask = cache.get(0)
    assert keys.shape[0] == 8 and keys[0, 0, 0].item() == 5.0  # nothing written
    assert mask.shape == (4, 8)
    assert cache.positions(0) == [0, 1] and 3 in cache.storage.layers


def test_memory_usage_counts_allocated_layers():
    cache = CausalCache(10, max_sequences=2, dtype=torch.float16)
    assert cache.memory_usage_bytes() == 0
    cache.start_forward(Batch([0], [0]))
    cache.put(0, torch.zeros(1, 3, 64), torch.zeros(1, 3, 32))
    assert cache.memory_usage_bytes() == 20 * 3 * (64 + 32) * 2
    cache.close()
    assert cache.memory_usage_bytes() == 0
    with pytest.raises(CallOrderError, match="closed"):
        cache.start_forward(Batch([1], [0]))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": -3}, "capacity"),
        ({"capacity": 8, "window": 4, "memory": 2}, "memory"),
        ({"capacity": 8, "memory": 2}, "memory"),
        ({"capacity": 8, "chunk": 0}, "chunk"),
        ({"capacity": 8, "padding": 0}, "padding"),
        ({"capacity": 8, "max_sequences": 0}, "max_sequences"),
        ({"capacity": 8, "dtype": torch.int32}, "dtype"),
        ({"capacity": 2.5}, "capacity"),
    ],
)
def test_bad_config_is_a_typed_error(kwargs, name):
    with pytest.raises(InvalidConfigError, match=name) as err:
        CausalCache(**kwargs)
    assert isinstance(err.value, ValueError) and err.value.name == name


def test_bad_input_is_a_typed_error_and_changes_nothing():
    cache = CausalCache(8, dtype=torch.float64)
    with pytest.raises(CallOrderError, match="start_forward"):
        cache.put(0, *kv([1.0]))
    step(cache, [0, 1], [0, 0])
    cache.start_forward(Batch([2], [0]))
    with pytest.raises(InvalidArgumentError, match="layer"):
        cache.put(-1, *kv([1.0]))
    with pytest.raises(DimensionMismatchError, match="tokens"):
        cache.put(0, *kv([1.0, 2.0]))  # T=2 but the batch has 1 token
    with pytest.raises(DimensionMismatchError, match="rank"):
        cache.put(0, torch.zeros(1, 2), torch.zeros(1, 2))
    with pytest.raises(DimensionMismatchError, match="head_dim"):
        cache.put(0, torch.zeros(1, 1, 3), torch.zeros(1, 1, 2))  # layer 0 holds dim 2
    with pytest.raises(InvalidArgumentError, match="dtype"):
        cache.put(0, torch.zeros(1, 1, 2, dtype=torch.int64), torch.zeros(1, 1, 2))
    with pytest.raises(CallOrderError, match="put"):
        cache.get(5)
    assert cache.positions(0) == [0, 1, 2]
    assert stored_keys(cache, 0)[2].abs().sum().item() == 0  # nothing was written
    with pytest.raises(InvalidArgumentError, match="sequences"):
        Batch([0], ["a"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="positions"):
        Batch([-1], [0])
    with pytest.raises(InvalidArgumentError, match="one per position"):
        Batch([0, 1], [0])
    with pytest.raises(InvalidArgumentError, match="already|not yet stored"):
        cache.start_forward(Batch([1], [0]))  # position 1 is stored: remove it first
    with pytest.raises(InvalidArgumentError, match="distinct"):
        cache.start_forward(Batch([5, 5], [0, 0]))
    with pytest.raises(InvalidArgumentError, match="end"):
        cache.remove(0, 3, 1)
    with pytest.raises(InvalidArgumentError, match="seq"):
        cache.remove("0", 0)  # type: ignore[arg-type]
    assert cache.positions(0) == [0, 1, 2] and cache.used_cells() == 3


def test_put_converts_to_cache_dtype():
    cache = CausalCache(4, dtype=torch.float16)
    cache.start_forward(Batch([0, 1], [0, 0]))
    keys, values, _ = cache.update(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    assert keys.dtype == torch.float16 and keys[:2].eq(1).all()
    cache.start_forward(Batch([2], [0]))  # single token, slice path
    keys, _, _ = cache.update(0, torch.full((1, 1, 2), 2.0), torch.ones(1, 1, 2))
    assert keys[2, 0, 0].item() == 2.0

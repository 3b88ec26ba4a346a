"""Encoder cache (cross-attention K/V stored once) and wrapper cache (per-layer routing,
unwinding a failed start_forward)."""

from __future__ import annotations

import pytest
import torch

from kvcache import Batch, CausalCache, EncoderCache, WrapperCache
from kvcache.errors import CacheFullError, CallOrderError, InvalidArgumentError
from kvcache.models.rope import Rope
from support import kv, render


def test_encoder_cache_stores_once_and_invalidates_on_remove():
    enc = EncoderCache()
    assert not enc.encoder_cached
    with pytest.raises(CallOrderError):
        enc.put(0, torch.zeros(4, 2, 8), torch.zeros(4, 2, 8))
    enc.start_forward(Batch([0, 1, 2], [0, 0, 0], encoder_inputs=[1]))
    k = torch.randn(1500, 6, 64)
    enc.put(0, k, -k)
    keys, values, mask = enc.get(0)
    assert enc.encoder_cached and mask is None
    assert torch.equal(keys, k) and torch.equal(values, -k)
    k[0] = 99.0  # the cache keeps its own copy
    assert keys[0, 0, 0].item() != 99.0
    with pytest.raises(CallOrderError, match="put"):
        enc.get(1)
    enc.start_forward(Batch([3], [0]))  # no encoder input: the encoder position stays 1
    enc.remove(0, 2)
    assert enc.encoder_cached
    enc.remove(0, 1, 2)
    assert not enc.encoder_cached
    assert enc.can_resume(0, 50)
    assert enc.memory_usage_bytes() == 2 * 1500 * 6 * 64 * 4


def test_encoder_put_reuses_buffer_in_place():
    enc = EncoderCache()
    enc.start_forward(Batch([0], [0], encoder_inputs=[0]))
    enc.put(0, torch.zeros(3, 1, 2), torch.zeros(3, 1, 2))
    first = enc.get(0)[0]
    enc.start_forward(Batch([5], [0], encoder_inputs=[0]))
    enc.put(0, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    assert enc.get(0)[0].data_ptr() == first.data_ptr() and first.eq(1).all()
    enc.remove(0, 0, 5)  # new encoder position is 5: not covered
    assert enc.encoder_cached


def test_encoder_put_item_replaces_one_input_in_place():
    """One of several inputs held side by side (e.g. one file's audio window) is replaced;
    the others and the buffer stay; a bad call changes nothing."""
    enc = EncoderCache()
    enc.start_forward(Batch([0], [0], encoder_inputs=[0]))
    k = torch.arange(24.0).view(3, 2, 4)  # 3 inputs of [2, 4]
    enc.put(0, k, -k)
    buf = enc.get(0)[0].data_ptr()
    enc.put_item(0, 1, torch.full((2, 4), 7.0), torch.full((2, 4), -7.0))
    keys, values, _ = enc.get(0)
    assert keys.data_ptr() == buf
    assert torch.equal(keys[1], torch.full((2, 4), 7.0)) and torch.equal(values[1], -keys[1])
    assert torch.equal(keys[0], k[0]) and torch.equal(keys[2], k[2])
    with pytest.raises(InvalidArgumentError, match="item"):
        enc.put_item(0, 3, torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(InvalidArgumentError, match="value"):
        enc.put_item(0, 0, torch.zeros(2, 4), torch.zeros(4, 2))
    assert torch.equal(enc.get(0)[0][0], k[0])  # the key was not written either
    with pytest.raises(CallOrderError, match="put"):
        enc.put_item(1, 0, torch.zeros(2, 4), torch.zeros(2, 4))


def test_wrapper_routes_layers_and_forwards_bookkeeping():
    enc, self_attn = EncoderCache(), CausalCache(8, max_sequences=2, dtype=torch.float64)
    cache = WrapperCache(enc, self_attn)
    cache.start_forward(Batch([0, 1], [0, 0], encoder_inputs=[0]))
    cache.set_layer_type(0)
    assert cache.underlying is enc
    _, _, mask = cache.update(0, torch.ones(5, 1, 2), torch.ones(5, 1, 2))
    assert mask is None
    cache.set_layer_type(1)
    assert cache.underlying is self_attn
    _, _, mask = cache.update(0, *kv([0.0, 1.0]))
    assert mask is not None and render(mask) == ["0 x", "0 0"]
    cache.copy_prefix(0, 1, 1)
    assert self_attn.positions(1) == [0]
    cache.remove(0, 0)
    assert self_attn.positions(0) == [] and not enc.encoder_cached
    assert cache.memory_usage_bytes() == enc.memory_usage_bytes() + self_attn.memory_usage_bytes()
    with pytest.raises(InvalidArgumentError, match="layer_type"):
        cache.set_layer_type(2)
    with pytest.raises(InvalidArgumentError):
        WrapperCache()


def test_wrapper_unwinds_started_caches_when_one_is_full():
    big = CausalCache(8, dtype=torch.float64)
    small = CausalCache(2, dtype=torch.float64)
    cache = WrapperCache(big, small)
    cache.start_forward(Batch([0], [0]))
    for layer_type in (0, 1):
        cache.set_layer_type(layer_type)
        cache.put(0, *kv([0.0]))
    with pytest.raises(CacheFullError):
        cache.start_forward(Batch([1, 2], [0, 0]))  # fits big, not small
    assert big.positions(0) == [0] and small.positions(0) == [0]


def test_wrapper_can_resume_is_the_and():
    window = CausalCache(16, window=2, max_batch=4, dtype=torch.float64)
    full = CausalCache(16, dtype=torch.float64)
    cache = WrapperCache(window, full)
    cache.start_forward(Batch([0, 1, 2, 3], [0] * 4))
    cache.set_layer_type(0)
    cache.put(0, *kv([0.0, 1.0, 2.0, 3.0]))
    cache.set_layer_type(1)
    cache.put(0, *kv([0.0, 1.0, 2.0, 3.0]))
    cache.start_forward(Batch([4], [0]))  # the window cache evicts pos < 2
    assert full.can_resume(0, 2) and not window.can_resume(0, 3)
    assert not cache.can_resume(0, 3) and cache.can_resume(0, 4)


def test_wrapper_attention_passes_keys_given_before_rope_on():
    rope = Rope(8, 10000.0)
    causal = CausalCache(8, shift=rope, key_rope="pre")
    wrapper = WrapperCache(EncoderCache(), causal)
    wrapper.start_forward(Batch.single(0, 0, 3))
    wrapper.set_layer_type(1)
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    wrapper.attention(0, x, x, x, keys_rotated=False)
    assert torch.equal(causal.storage.read(0, torch.arange(3))[0], x)  # held as given
    with pytest.raises(InvalidArgumentError, match="keys_rotated"):
        wrapper.attention(0, x, x, x, keys_rotated="no")  # type: ignore[arg-type]

"""Gemma 3 270M on the wrapper cache against transformers' Gemma3ForCausalLM (real weights,
the same GGUF dequantized to float32 by both), and cached decoding against a full forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache import CausalCache
from kvcache.batch import Batch
from kvcache.errors import InvalidArgumentError
from kvcache.generate import GenerationConfig, stream_tokens
from kvcache.models.gemma3 import GLOBAL, SLIDING, Gemma3
from kvcache.text.tokenizer import Tokenizer
from kvcache.wrapper import WrapperCache

GPL3 = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files: long real English text


@pytest.fixture(scope="module")
def long_prompt(gemma3_tokenizer: Tokenizer) -> list[int]:
    """1,600 tokens of the GPL-3 text (BOS first): three windows of the sliding layers."""
    ids = gemma3_tokenizer.encode(GPL3.read_text())
    assert len(ids) > 1600, len(ids)
    return ids[:1600]


def _greedy(model: Gemma3, prompt: list[int], n: int, **kw: Any) -> list[int]:
    cache = model.new_cache(len(prompt) + n)
    try:
        config = GenerationConfig(max_new_tokens=n, ignore_eos=True)
        return list(stream_tokens(model, cache, prompt, config, **kw))
    finally:
        cache.close()


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_config_from_the_file(gemma3: Gemma3):
    c = gemma3.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        18,
        640,
        4,
        1,
        256,
    )
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta) == (512, 1e6, 1e4)
    assert [i for i in range(18) if c.layer_type(i) == GLOBAL] == [5, 11, 17]


def test_short_prompt_logits_and_greedy_equal_transformers(
    gemma3: Gemma3, gemma3_hf: Any, gemma3_tokenizer: Tokenizer
):
    prompt = gemma3_tokenizer.encode("The capital of France is")
    with torch.no_grad():
        ref = gemma3_hf(torch.tensor([prompt])).logits[0]  # [T, V]
    cache = gemma3.new_cache(64)
    ours = gemma3.forward(prompt, Batch.single(0, 0, len(prompt)), cache)
    cache.close()
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)
    assert _greedy(gemma3, prompt, 16) == _hf_greedy(gemma3_hf, prompt, 16)


def test_past_the_window_equals_transformers(
    gemma3: Gemma3, gemma3_hf: Any, long_prompt: list[int]
):
    """1,600 tokens prefilled in chunks of 384 (every chunk after the first sees evicted
    history), then 8 greedy steps: the greedy tokens equal transformers', and so do the
    logits of every decode step on the cache and of the uncached forward at rows across all
    three windows (transformers' sliding layers see 512 tokens, the row included)."""
    n, steps = len(long_prompt), 8
    cache = gemma3.new_cache(n + steps)
    decoded = []
    for begin in range(0, n, 384):
        part = long_prompt[begin : begin + 384]
        last = [len(part) - 1] if begin + len(part) == n else []
        out = gemma3.forward(part, Batch.single(0, begin, len(part)), cache, outputs=last)
    tokens = [int(out[-1].argmax())]
    decoded.append(out[-1])
    for i in range(steps - 1):
        out = gemma3.forward(tokens[-1:], Batch.single(0, n + i, 1), cache)
        decoded.append(out[-1])
        tokens.append(int(out[-1].argmax()))
    cache.close()
    assert tokens == _hf_greedy(gemma3_hf, long_prompt, steps)
    seq = long_prompt + tokens[:-1]
    with torch.no_grad():
        ref = gemma3_hf(torch.tensor([seq])).logits[0]  # [n + steps - 1, V]
    torch.testing.assert_close(torch.stack(decoded), ref[n - 1 :], atol=2e-3, rtol=1e-4)
    rows = [100, 511, 512, 513, 1000, 1024, 1300, n - 1]
    ours = gemma3.forward_full(long_prompt, outputs=rows)
    torch.testing.assert_close(ours, ref[rows], atol=2e-3, rtol=1e-4)


def test_cached_decoding_equals_full_forward_and_local_cells_stay_bounded(
    gemma3: Gemma3, long_prompt: list[int]
):
    """Two sequences in one wrapper cache (one prefilled in chunks past the window, one short),
    then decode steps of both in one batch: every row's logits equal the uncached forward's,
    and after every forward each sequence holds at most window (512) + T cells in the sliding
    cache and all its tokens in the global one."""
    n_long, steps = 800, 6
    a = long_prompt[:n_long]
    b = long_prompt[:1] + long_prompt[700:740]
    full_a = gemma3.forward_full(a, outputs=[599, n_long - 1])
    cache = gemma3.new_cache(n_long + steps + 1, max_sequences=2)
    sliding, full = cache.caches
    w = gemma3.config.sliding_window

    def check(batch: Batch) -> None:
        t = len(batch)
        for seq, count in ((0, next_pos[0]), (1, next_pos[1])):
            assert len(sliding.cells_of(seq)) <= w + t, (seq, len(sliding.cells_of(seq)))
            assert len(full.cells_of(seq)) == count
            if count >= w:
                assert len(sliding.cells_of(seq)) >= w - 1  # the window is still all there

    next_pos = [0, 0]
    chunks = [(0, 0, 300), (0, 300, 300), (1, 0, len(b)), (0, 600, n_long - 600)]
    logits = {}
    for seq, start, length in chunks:
        toks = (a if seq == 0 else b)[start : start + length]
        out = gemma3.forward(toks, Batch.single(seq, start, length), cache)
        next_pos[seq] = start + length
        check(Batch.single(seq, start, length))
        logits[(seq, start + length - 1)] = out[-1]
    torch.testing.assert_close(logits[(0, n_long - 1)], full_a[1], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(logits[(0, 599)], full_a[0], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(
        logits[(1, len(b) - 1)], gemma3.forward_full(b)[-1], atol=1e-3, rtol=1e-4
    )
    seqs = {0: list(a), 1: list(b)}
    last = {0: logits[(0, n_long - 1)], 1: logits[(1, len(b) - 1)]}
    decoded: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for _ in range(steps):
        nxt = [int(torch.argmax(last[s])) for s in (0, 1)]
        batch = Batch((len(seqs[0]), len(seqs[1])), (0, 1))
        out = gemma3.forward(nxt, batch, cache)
        for row, s in enumerate((0, 1)):
            seqs[s].append(nxt[row])
            next_pos[s] += 1
            last[s] = out[row]
            decoded[s].append(out[row])
        check(batch)
    for s in (0, 1):  # the uncached forward of each final sequence, at the decoded rows
        n = len(seqs[s])
        ref = gemma3.forward_full(seqs[s], outputs=range(n - steps, n))
        torch.testing.assert_close(torch.stack(decoded[s]), ref, atol=1e-3, rtol=1e-4)
    assert cache.memory_usage_bytes() == sliding.memory_usage_bytes() + full.memory_usage_bytes()
    cache.close()


def test_every_forward_keeps_sliding_cells_within_window_plus_batch(
    gemma3: Gemma3, long_prompt: list[int]
):
    """stream_tokens' forwards (chunked prefill of 1,200 tokens, then decode)."""
    cache = gemma3.new_cache(1300)
    sliding = cache.caches[SLIDING]
    seen: list[tuple[int, int]] = []

    def check(batch: Batch) -> None:
        held = len(sliding.cells_of(0))
        seen.append((held, len(batch)))
        assert held <= gemma3.config.sliding_window + len(batch), (held, len(batch))

    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    list(stream_tokens(gemma3, cache, long_prompt[:1200], config, chunk=500, on_forward=check))
    assert [t for _, t in seen] == [500, 500, 200, 1, 1, 1]
    # one sequence keeps the window's 511 earlier tokens (Ollama's rule), + the new one
    assert seen[-1][0] == gemma3.config.sliding_window
    cache.close()


def test_a_cache_without_the_window_is_refused(gemma3: Gemma3):
    plain = CausalCache(16)
    with pytest.raises(InvalidArgumentError, match="cache"):
        gemma3.forward([2, 3], Batch.single(0, 0, 2), plain)
    wrong = WrapperCache(CausalCache(16, window=100), CausalCache(16))
    with pytest.raises(InvalidArgumentError, match="window=511"):
        gemma3.forward([2, 3], Batch.single(0, 0, 2), wrong)
    assert wrong.caches[0].used_cells() == 0  # nothing placed

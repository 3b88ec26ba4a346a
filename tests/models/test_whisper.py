"""Whisper on the library's caches with random weights: cached steps equal the full decoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from whisper_reference import beam_uncached, greedy_uncached

from kvcache import CausalCache, EncoderCache, WrapperCache
from kvcache.errors import CacheFullError, DimensionMismatchError, InvalidArgumentError
from kvcache.models.whisper import Whisper, WhisperConfig
from kvcache.models.whisper_decode import (
    WhisperKVCache,
    forward_decoder_cached,
    forward_decoder_step,
)
from kvcache.text.whisper_tokenizer import SpecialTokens
from kvcache.transcription.rules import LogitRules
from kvcache.transcription.search import BeamSearch, SampleSearch, SearchSpec, run_search

PROMPT = [50258, 50259, 50359, 50363]
SMALL = WhisperConfig(
    n_mels=8, n_audio_ctx=24, n_audio_state=32, n_audio_head=4, n_audio_layer=2,
    n_vocab=97, n_text_ctx=40, n_text_state=32, n_text_head=4, n_text_layer=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_en() -> Whisper:
    return WhisperConfig.tiny_en().init(dtype=torch.float32, seed=0)


@pytest.fixture(scope="module")
def small64() -> Whisper:
    return SMALL.init(dtype=torch.float64, seed=1)


def _audio(
    cfg: WhisperConfig, windows: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(windows, cfg.n_audio_ctx, cfg.n_text_state, generator=g).to(dtype)


def test_tiny_en_dimensions() -> None:
    cfg = WhisperConfig.tiny_en()
    assert (cfg.n_vocab, cfg.n_audio_ctx, cfg.n_audio_state, cfg.n_text_ctx, cfg.n_mels) == (
        51864,
        1500,
        384,
        448,
        80,
    )
    assert (cfg.n_audio_layer, cfg.n_text_layer, cfg.n_audio_head, cfg.n_text_head) == (4, 4, 6, 6)


def test_step_counts_and_logits_length(tiny_en: Whisper) -> None:
    cache = WhisperKVCache(tiny_en, _audio(tiny_en.config))
    assert cache.step == 0
    logits = forward_decoder_cached(tiny_en, PROMPT[0], cache)
    assert cache.step == 1
    logits = forward_decoder_cached(tiny_en, PROMPT[1], cache)
    assert cache.step == 2
    assert logits.shape == (51864,)
    assert torch.isfinite(logits).all()


def test_cache_is_built_from_the_library_caches(tiny_en: Whisper) -> None:
    cache = WhisperKVCache(tiny_en, _audio(tiny_en.config))
    assert isinstance(cache.cache, WrapperCache)
    assert isinstance(cache.cross, EncoderCache) and isinstance(cache.self_attn, CausalCache)
    assert cache.cache.caches == (cache.cross, cache.self_attn)
    assert cache.cross.encoder_cached
    k, v, mask = cache.cross.get(0)
    assert k.shape == v.shape == (1, 6, 1500, 64) and mask is None  # [A, H, S, D]
    assert cache.self_attn.memory_usage_bytes() == 0  # self K/V storage comes with the first token


def test_cached_logits_equal_full_decoder_tiny_en(tiny_en: Whisper) -> None:
    """The reference design's check: 4 tokens one at a time vs forward_decoder, fp32 < 1e-4."""
    audio = _audio(tiny_en.config, seed=3)
    full = tiny_en.forward_decoder(torch.tensor([PROMPT]), audio)[0]  # [4, V]
    cache = WhisperKVCache(tiny_en, audio)
    for i, token in enumerate(PROMPT):
        logits = forward_decoder_cached(tiny_en, token, cache)
        assert (logits - full[i]).abs().max().item() < 1e-4, i
    assert cache.step == 4


def test_cross_kv_projected_once(tiny_en: Whisper, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = Whisper.cross_kv_layers

    def counting(self: Whisper, audio: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        calls.append(tuple(audio.shape))
        return original(self, audio)

    monkeypatch.setattr(Whisper, "cross_kv_layers", counting)
    audio = _audio(tiny_en.config)
    cache = WhisperKVCache(tiny_en, audio)
    assert calls == [(1, 1500, 384)]
    for token in PROMPT:
        forward_decoder_cached(tiny_en, token, cache)
    assert len(calls) == 1  # no step recomputes them
    for layer in range(4):  # the fused projection equals each layer's own
        k, v = tiny_en.cross_kv(layer, audio)
        ck, cv, _ = cache.cross.get(layer)
        assert torch.allclose(ck, k, atol=1e-5) and torch.allclose(cv, v, atol=1e-5)


def test_float64_exact_token_by_token(small64: Whisper) -> None:
    audio = _audio(SMALL, dtype=torch.float64, seed=5)
    tokens = [5, 17, 3, 96, 0, 42, 42, 7]
    full = small64.forward_decoder(torch.tensor([tokens]), audio)[0]
    cache = WhisperKVCache(small64, audio)
    for i, t in enumerate(tokens):
        assert (forward_decoder_cached(small64, t, cache) - full[i]).abs().max().item() < 1e-10


def test_prompt_in_one_step_equals_full_decoder(small64: Whisper) -> None:
    audio = _audio(SMALL, dtype=torch.float64, seed=6)
    tokens = [1, 2, 3, 4, 5]
    full = small64.forward_decoder(torch.tensor([tokens]), audio)[0]
    cache = WhisperKVCache(small64, audio)
    logits = forward_decoder_step(small64, tokens[:3], [0, 0, 0], cache)  # a prefill
    assert (logits - full[:3]).abs().max().item() < 1e-10
    assert cache.step == 3
    for i in (3, 4):
        assert (
            forward_decoder_cached(small64, tokens[i], cache) - full[i]
        ).abs().max().item() < 1e-10


def test_several_sequences_and_windows_in_one_cell_cache(small64: Whisper) -> None:
    """Two windows, two sequences decoding together: each equals its own full decode."""
    audio = _audio(SMALL, windows=2, dtype=torch.float64, seed=7)
    streams = {0: [3, 9, 27, 81, 50], 1: [60, 2, 2, 11, 90]}
    refs = {
        s: small64.forward_decoder(torch.tensor([toks]), audio[s : s + 1])[0]
        for s, toks in streams.items()
    }
    cache = WhisperKVCache(small64, audio, max_sequences=2)
    assert (cache.window(0), cache.window(1)) == (0, 1)
    forward_decoder_step(small64, [3, 9], [0, 0], cache)  # seq 0 starts alone with two tokens
    for i in range(1, 5):
        toks, seqs = [streams[1][i - 1]], [1]
        if i + 1 < 5:
            toks.append(streams[0][i + 1])
            seqs.append(0)
        logits = forward_decoder_step(small64, toks, seqs, cache)
        for row, s in enumerate(seqs):
            pos = cache.length(s) - 1
            assert (logits[row] - refs[s][pos]).abs().max().item() < 1e-10, (s, pos)
    assert cache.length(0) == 5 and cache.length(1) == 4


def test_windows_in_lockstep_equal_their_full_decodes(small64: Whisper) -> None:
    """Three windows decoding together, rows in window order (the batched cross-attention
    path: one matmul over all windows), 2 rows each then 1: each equals its own decode."""
    audio = _audio(SMALL, windows=3, dtype=torch.float64, seed=11)
    streams = {0: [3, 9, 27, 81], 1: [60, 2, 2, 11], 2: [5, 44, 17, 8]}
    refs = {
        s: small64.forward_decoder(torch.tensor([toks]), audio[s : s + 1])[0]
        for s, toks in streams.items()
    }
    cache = WhisperKVCache(small64, audio, max_sequences=3)
    steps = [slice(0, 2), slice(2, 3), slice(3, 4)]
    for part in steps:
        seqs = [s for s in streams for _ in streams[s][part]]  # [0, 0, 1, 1, 2, 2] then [0, 1, 2]
        toks = [t for s in streams for t in streams[s][part]]
        logits = forward_decoder_step(small64, toks, seqs, cache)
        for row, s in enumerate(seqs):
            pos = part.start + row % (part.stop - part.start)
            assert (logits[row] - refs[s][pos]).abs().max().item() < 1e-10, (s, pos)


def test_beams_share_prompt_cells_and_free_pruned_ones(small64: Whisper) -> None:
    audio = _audio(SMALL, dtype=torch.float64, seed=8)
    prompt = [10, 20, 30]
    cache = WhisperKVCache(small64, audio, max_sequences=4)
    forward_decoder_step(small64, prompt, [0, 0, 0], cache)
    for dst in (1, 2):
        cache.copy_prefix(0, dst)
    assert cache.self_attn.used_cells() == 3  # shared, nothing copied
    assert cache.step == 3 and cache.length(2) == 3
    beams = {0: [4], 1: [5], 2: [6]}
    logits = forward_decoder_step(small64, [4, 5, 6], [0, 1, 2], cache)
    assert cache.self_attn.used_cells() == 6
    cache.remove(1)  # prune beam 1: only its own cell is freed
    assert cache.self_attn.used_cells() == 5
    logits = forward_decoder_step(small64, [7, 8], [0, 2], cache)
    beams[0].append(7)
    beams[2].append(8)
    for row, s in enumerate((0, 2)):
        ref = small64.forward_decoder(torch.tensor([prompt + beams[s]]), audio)[0, -1]
        assert (logits[row] - ref).abs().max().item() < 1e-10
    cache.copy_prefix(2, 3, length=4)  # a child of beam 2 forks before its last token
    child = forward_decoder_cached(small64, 9, cache, seq=3)
    ref = small64.forward_decoder(torch.tensor([prompt + [6, 9]]), audio)[0, -1]
    assert (child - ref).abs().max().item() < 1e-10


def test_self_kv_written_in_place(small64: Whisper) -> None:
    """Every step writes one new cell of one preallocated buffer per layer: no concat."""
    cache = WhisperKVCache(small64, _audio(SMALL, dtype=torch.float64))
    seen: list[tuple[int, int]] = []
    for t in range(1, 20):
        forward_decoder_cached(small64, t, cache)
        data = cache.self_attn.storage.layers[0].keys.data
        seen.append((data.data_ptr(), cache.self_attn.used_cells()))
    assert len({ptr for ptr, _ in seen}) == 1
    assert [n for _, n in seen] == list(range(1, 20))


def test_compressed_self_kv_codec(small64: Whisper) -> None:
    audio = _audio(SMALL, dtype=torch.float64, seed=9)
    tokens = [4, 8, 15, 16, 23, 42]
    full = small64.forward_decoder(torch.tensor([tokens]), audio)[0]
    cache = WhisperKVCache(small64, audio, codec="int8")
    for i, t in enumerate(tokens):
        err = (forward_decoder_cached(small64, t, cache) - full[i]).abs().max().item()
        assert 0 < err < 0.05 * full[i].abs().max().item()  # lossy, but close


def test_full_cache_raises_and_changes_nothing(small64: Whisper) -> None:
    cache = WhisperKVCache(small64, _audio(SMALL, dtype=torch.float64), capacity=2)
    forward_decoder_step(small64, [1, 2], [0, 0], cache)
    with pytest.raises(CacheFullError):
        forward_decoder_cached(small64, 3, cache)
    assert cache.step == 2 and cache.self_attn.used_cells() == 2


def test_bad_inputs_are_typed_errors(small64: Whisper) -> None:
    audio = _audio(SMALL, dtype=torch.float64)
    cache = WhisperKVCache(small64, audio)
    with pytest.raises(InvalidArgumentError, match="tokens"):
        forward_decoder_cached(small64, SMALL.n_vocab, cache)
    with pytest.raises(InvalidArgumentError, match="seqs"):
        forward_decoder_step(small64, [1, 2], [0], cache)
    assert cache.step == 0
    two = WhisperKVCache(small64, _audio(SMALL, windows=2, dtype=torch.float64), max_sequences=3)
    with pytest.raises(InvalidArgumentError, match="window"):
        forward_decoder_cached(small64, 1, two, seq=2)  # sequence 2 would read window 2 of 2
    assert two.step == 0 and two.self_attn.used_cells() == 0
    with pytest.raises(DimensionMismatchError, match="mel"):
        small64.forward_encoder(torch.zeros(1, SMALL.n_mels, 10, dtype=torch.float64))
    with pytest.raises(InvalidArgumentError, match="tokens"):
        small64.forward_decoder(torch.zeros(1, SMALL.n_text_ctx + 1, dtype=torch.int64), audio)
    with pytest.raises(DimensionMismatchError, match="audio"):
        WhisperKVCache(small64, torch.zeros(2, 5, 7, dtype=torch.float64))


def test_encoder_shapes(small64: Whisper) -> None:
    mel = torch.randn(2, SMALL.n_mels, 2 * SMALL.n_audio_ctx, dtype=torch.float64)
    out = small64.forward_encoder(mel)
    assert out.shape == (2, SMALL.n_audio_ctx, SMALL.n_audio_state)
    assert torch.allclose(small64.forward_encoder(mel[1:]), out[1:], atol=1e-12)  # rows independent


def _cached_search(
    model: Whisper, audio: torch.Tensor, prompt: list[int], rules: LogitRules, beam: int
) -> list[int]:
    spec = SearchSpec(prompt, rules, max_new=14)
    cache = WhisperKVCache(model, audio, max_sequences=2 * beam)
    seqs = list(range(2 * beam))
    search = BeamSearch(spec, seqs, beam) if beam > 1 else SampleSearch(spec, seqs[:1])
    return run_search(model, search, cache).tokens


def test_beam_search_on_cells_equals_beam_search_without_cache(
    small64: Whisper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forked beams (copy_prefix) and pruned ones (remove) score exactly like full decodes."""
    calls = {"copy_prefix": 0, "remove": 0}

    def spy(name: str) -> Callable[..., Any]:
        original = getattr(WhisperKVCache, name)

        def counted(self: WhisperKVCache, *args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return original(self, *args, **kwargs)

        return counted

    for name in calls:
        monkeypatch.setattr(WhisperKVCache, name, spy(name))
    special = SpecialTokens(eot=90, sot=91, no_timestamps=92, timestamp_begin=93)
    rules = LogitRules(special, SMALL.n_vocab, [], [], timestamps=False)
    for seed in range(3):
        audio = _audio(SMALL, dtype=torch.float64, seed=20 + seed)
        cached = _cached_search(small64, audio, [91, 92], rules, beam=3)
        uncached = beam_uncached(small64, audio, [91, 92], rules, 14, beam_size=3)
        assert cached == uncached and len(cached) > 0
        greedy = _cached_search(small64, audio, [91, 92], rules, beam=1)
        assert greedy == greedy_uncached(small64, audio, [91, 92], rules, 14)
    assert calls["copy_prefix"] > 0 and calls["remove"] > 0


def test_failed_step_leaves_the_cache_unchanged(
    small64: Whisper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer that raises mid-step: lengths, cells and later logits are as if never called."""
    audio = _audio(SMALL, dtype=torch.float64, seed=11)
    tokens = [7, 8, 9, 10]
    full = small64.forward_decoder(torch.tensor([tokens]), audio)[0]
    cache = WhisperKVCache(small64, audio, max_sequences=2)
    forward_decoder_step(small64, tokens[:2], [0, 0], cache)
    cells = cache.self_attn.used_cells()
    blk = small64.decoder[1]
    original = blk.fc1

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise FloatingPointError("layer 1 failed")

    monkeypatch.setattr(blk, "fc1", broken)
    with pytest.raises(FloatingPointError):
        forward_decoder_step(small64, [tokens[2], 5, 6], [0, 1, 1], cache)
    assert cache.length(0) == 2 and cache.length(1) == 0 and cache.step == 2
    assert cache.self_attn.used_cells() == cells
    assert cache.self_attn.positions(0) == [0, 1] and cache.self_attn.positions(1) == []
    monkeypatch.setattr(blk, "fc1", original)
    for i in (2, 3):
        got = forward_decoder_cached(small64, tokens[i], cache)
        assert (got - full[i]).abs().max().item() < 1e-10


def test_windows_replaced_in_place_and_attached(small64: Whisper) -> None:
    """set_audio swaps one file's window while another file's sequence keeps decoding."""
    audio = _audio(SMALL, windows=2, dtype=torch.float64, seed=12)
    nxt = _audio(SMALL, dtype=torch.float64, seed=13)  # file 0's next window
    cache = WhisperKVCache(small64, audio, max_sequences=4)
    forward_decoder_step(small64, [1, 2, 3], [0, 0, 1], cache)
    cache.set_audio(0, nxt[0])
    cache.remove(0)
    cache.attach(2, 0)  # a fresh sequence on file 0's new window
    logits = forward_decoder_step(small64, [4, 5, 6], [2, 2, 1], cache, logits_rows=[1, 2])
    assert logits.shape == (2, SMALL.n_vocab)
    ref_new = small64.forward_decoder(torch.tensor([[4, 5]]), nxt)[0, -1]
    ref_old = small64.forward_decoder(torch.tensor([[3, 6]]), audio[1:])[0, -1]
    assert (logits[0] - ref_new).abs().max().item() < 1e-10
    assert (logits[1] - ref_old).abs().max().item() < 1e-10
    with pytest.raises(InvalidArgumentError, match="seq"):
        cache.attach(1, 0)  # sequence 1 holds tokens of window 1
    with pytest.raises(InvalidArgumentError, match="window"):
        cache.set_audio(2, nxt[0])
    with pytest.raises(InvalidArgumentError, match="logits_rows"):
        forward_decoder_step(small64, [7], [2], cache, logits_rows=[1])
    assert cache.length(2) == 2

"""benchmarks/kv_quality.py: the bytes a codec holds and the quality figures."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import kv_quality as kq
from kvcache.models.llama import Llama
from tiny_models import TINY


def test_held_bytes_counts_every_layer_k_and_v(history_model) -> None:
    c = history_model.config  # 2 layers, 2 KV heads, head_dim 8
    row = c.num_layers * 2 * c.num_kv_heads * c.head_dim
    assert kq.held_bytes(history_model, "fp32", 64) == 64 * row * 4
    assert kq.held_bytes(history_model, "fp16", 64) == 64 * row * 2
    assert kq.held_bytes(history_model, "int8", 64) < 64 * row * 2


def test_quality_of_a_uniform_model_and_of_itself() -> None:
    vocab = 50
    win = [i % vocab for i in range(kq.WINDOW)]
    uniform = torch.full((kq.WINDOW - kq.PREFILL, vocab), -math.log(vocab), dtype=torch.float64)
    same = kq.quality([uniform], [win], [uniform])
    assert same["ppl"] == pytest.approx(vocab) and same["kl"] == pytest.approx(0.0, abs=1e-12)
    assert same["top1"] == 1.0
    sharp = torch.log_softmax(torch.randn(kq.WINDOW - kq.PREFILL, vocab, dtype=torch.float64), -1)
    other = kq.quality([sharp], [win], [uniform])
    assert other["kl"] > 0 and other["top1"] < 1.0
    nll = -float(sharp.gather(1, torch.tensor(win[kq.PREFILL :])[:, None]).mean())
    each = kq.window_ppl([uniform, sharp], [win, win], [uniform, uniform])
    assert each == pytest.approx([vocab, math.exp(nll)])  # each window alone, in order


def test_attention_cosines_record_every_layer_and_see_a_codec() -> None:
    """The per-layer cosines record each layer's q, k, v from a cached forward (they came
    out empty once the forward stopped calling the method they wrapped)."""
    config = replace(TINY, head_dim=16, context_length=1024)
    model = Llama.random(config, seed=0, dtype=torch.float32)
    tokens = [i % config.vocab_size for i in range(512)]
    got = kq.attention_cosines(model, tokens, ["fp32", "int4:recent=0"])
    assert [len(v) for v in got.values()] == [config.num_layers] * 2
    assert got["fp32"] == pytest.approx([1.0] * config.num_layers, abs=1e-6)
    assert all(0.5 < c < 1 - 1e-6 for c in got["int4:recent=0"])


def test_nudged_keys_move_a_quantized_codec_and_fp32_by_rounding_only() -> None:
    """``--spread``: keys one ulp up or down reach the cache (the figures move), and in fp32
    they move the log-probabilities by rounding only."""
    config = replace(TINY, head_dim=16, context_length=kq.WINDOW)
    model = Llama.random(config, seed=0, dtype=torch.float32)
    tokens = [(7 * i) % config.vocab_size for i in range(kq.WINDOW)]
    base = kq.window_logprobs(model, "fp32", tokens)
    up = kq.window_logprobs(model, "fp32", tokens, nudge="up")
    assert not torch.equal(base, up) and (base - up).abs().max() < 1e-4
    codes = {d: kq.window_logprobs(model, "int4:recent=0", tokens, nudge=d) for d in ("up", "down")}
    plain = kq.window_logprobs(model, "int4:recent=0", tokens)
    assert not torch.equal(codes["up"], codes["down"]) and not torch.equal(plain, codes["up"])
    with pytest.raises(ValueError, match="sideways"):
        kq.window_logprobs(model, "fp32", tokens, nudge="sideways")


def test_a_longer_window_scores_its_last_tokens_after_a_longer_prefill() -> None:
    """``--window``: the rows predict the window's last SCORED tokens, as one forward over the
    whole window does, and quality scores exactly those tokens."""
    window = kq.WINDOW + 512
    config = replace(TINY, head_dim=16, context_length=window)
    model = Llama.random(config, seed=0, dtype=torch.float32)
    tokens = [(7 * i + i // 5) % config.vocab_size for i in range(window)]
    lp = kq.window_logprobs(model, "fp32", tokens)
    assert lp.shape == (kq.SCORED, config.vocab_size)
    from kvcache import Batch

    cache = kq.make_cache(model, "fp32", window, max_batch=window)
    whole = model.forward(tokens, Batch.single(0, 0, window), cache)  # every position's logits
    cache.close()
    want = torch.log_softmax(whole[window - kq.SCORED - 1 : window - 1].double(), dim=-1)
    assert torch.allclose(lp, want, atol=1e-4, rtol=0)
    nll = -float(lp.gather(1, torch.tensor(tokens[-kq.SCORED :])[:, None]).sum())
    assert kq.quality([lp], [tokens], [lp])["ppl"] == pytest.approx(math.exp(nll / kq.SCORED))
    pressed, held, compression = kq.pressed_logprobs(
        model, "fp32", tokens, "streaming:0.5", 0.25, 16
    )
    assert pressed.shape == lp.shape and not torch.allclose(pressed, lp, atol=1e-3)
    assert 0.25 <= held < 0.25 + 16 / (window - kq.SCORED)  # capped at 1/4 of the history
    # fp32 rows are twice fp16's bytes, so each step's compression is 0.5 / its held share:
    # the mean is at least 0.5 / the mean share (Jensen), at most 0.5 / the smallest share
    assert 0.5 / held <= compression < 0.5 / (0.25 - 1 / (window - kq.SCORED))

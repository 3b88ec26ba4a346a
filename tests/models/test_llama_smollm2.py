"""Real SmolLM2-135M-Instruct weights: our logits equal transformers' LlamaForCausalLM loaded
from the same GGUF, and cached greedy decoding equals no-cache decoding."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcache import Batch
from kvcache.generate import GenerationConfig, generate
from kvcache.models.llama import Llama
from kvcache.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXT = (
    "The key-value cache stores the keys and values of every token a transformer has already "
    "seen, so that generating the next token costs one row of attention instead of a full "
    "recomputation. Many sequences can share one pool of cells, and a prompt prefix computed "
    "once can be forked by reference into several continuations without copying anything."
)


@pytest.fixture(scope="module")
def prompt64(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT)
    assert len(ids) >= 64, len(ids)
    return ids[:64]


def test_config_read_from_gguf(smollm2: Llama):
    c = smollm2.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert c.rope_theta == 100000.0 and c.tie_embeddings
    assert smollm2.weights.lm_head is smollm2.weights.embed  # tied: one tensor, not a copy


def test_logits_match_transformers(smollm2: Llama, hf_model: Any, prompt64: list[int]):
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt64])).logits[0]  # [64, V]
    # ours through the cache: a 40-token prefill chunk, then 24 single-token decode steps
    cache = smollm2.new_cache(128)
    parts = [smollm2.forward(prompt64[:40], Batch.single(0, 0, 40), cache)]
    for p in range(40, 64):
        parts.append(smollm2.forward(prompt64[p : p + 1], Batch.single(0, p, 1), cache))
    ours = torch.cat(parts)
    full = smollm2.forward_full(prompt64)
    for got in (ours, full):
        assert (got - ref).abs().max().item() <= 1e-3
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_with_cache_equals_without(smollm2: Llama, prompt64: list[int]):
    [done] = generate(smollm2, None, prompt64, GenerationConfig(max_new_tokens=32))
    seq = list(prompt64)
    for _ in range(32):
        seq.append(int(smollm2.forward_full(seq, outputs=[len(seq) - 1])[0].argmax()))
    assert done.tokens == seq[64:]


def test_chat_answer_is_sensible(smollm2: Llama, tokenizer: Tokenizer):
    text = tokenizer.apply_chat([{"role": "user", "content": "What is the capital of France?"}])
    [done] = generate(smollm2, tokenizer, text, GenerationConfig(max_new_tokens=24))
    assert "Paris" in done.text
    assert done.finish_reason in ("eos", "length")

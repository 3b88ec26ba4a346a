"""The ``"kvcache"`` attention implementation against transformers' own paths.

* generate under ``attn_implementation="kvcache"`` with KVCacheForTransformers equals
  DynamicCache under sdpa (eager for Gemma 2's soft-capping): the same greedy / beam tokens,
  logits within 1e-5 relative, on tiny random Llama, Mistral (sliding), Qwen2, Qwen3, Gemma 2
  and Gemma 3 (hybrid) models, batch 1, batch 3 with left padding, beams, prompts longer
  than the sliding window; head_dim 8 (the cell cache's plain-torch path) and 32 (the C++
  kernels);
* each lossy codec, with histories beyond its fp16 window, gives the logits of the decoded
  path (the same cache under sdpa, attending over K/V decoded from the codes);
* the registered mask function's mask equals transformers' sdpa mask (padding, sliding,
  offsets); nothing is decoded for transformers; the typed errors; real SmolLM2.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_hf_cache import CASES, MODELS, SMALL, WINDOW, generate, prompts
from transformers import (
    DynamicCache,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.masking_utils import (
    causal_mask_function,
    create_causal_mask,
    create_sliding_window_causal_mask,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from kvcache.causal import CausalCache
from kvcache.errors import CallOrderError, InvalidArgumentError, NotSupportedError
from kvcache.hf import CacheMask, KVCacheForTransformers, kvcache_mask

ATTN_MODELS: dict[str, tuple[type, type, dict[str, Any]]] = {
    **{k: v for k, v in MODELS.items() if k != "gemma3_d32"},
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"num_hidden_layers": 2}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"num_hidden_layers": 2}),
    # a cap the tiny model's logits reach (Gemma 2's 50 leaves them untouched)
    "gemma2_capped": (
        MODELS["gemma2"][0],
        MODELS["gemma2"][1],
        {**MODELS["gemma2"][2], "attn_logit_softcapping": 0.5},
    ),
}
# the attention today's adapter tests compare with (Gemma 2's soft-capping has no sdpa path)
REFERENCE_ATTN = {n: "eager" if n.startswith("gemma2") else "sdpa" for n in ATTN_MODELS}


@functools.cache
def model(name: str, head_dim: int) -> Any:
    """A random-weight tiny model (eval); its attention is switched per call by ``attn``."""
    config_cls, model_cls, extra = ATTN_MODELS[name]
    config = config_cls(**{**SMALL, **extra, "head_dim": head_dim})
    config._attn_implementation = REFERENCE_ATTN[name]
    torch.manual_seed(0)
    return model_cls(config).eval()


@contextlib.contextmanager
def attn(m: Any, implementation: str) -> Iterator[Any]:
    """``m`` with ``implementation`` for the block (the models are shared by tests)."""
    before = m.config._attn_implementation
    m.set_attn_implementation(implementation)
    try:
        yield m
    finally:
        m.set_attn_implementation(before)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |a|: the logits' relative difference."""
    return ((a - b).abs().max() / a.abs().max()).item()


def assert_close_generation(ref: Any, out: Any, rtol: float = 1e-5) -> None:
    assert torch.equal(ref.sequences, out.sequences), (ref.sequences, out.sequences)
    for step, (a, b) in enumerate(zip(ref.logits, out.logits, strict=True)):
        assert relative(a, b) <= rtol, (step, relative(a, b))


@pytest.mark.parametrize("head_dim", [8, 32])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(ATTN_MODELS))
def test_kvcache_attention_equals_dynamic_cache(name: str, case: str, head_dim: int):
    m = model(name, head_dim)
    rows, beams, pads = CASES[case]
    ids, mask = prompts(rows, 14, pads)
    with attn(m, REFERENCE_ATTN[name]):
        ref = generate(m, DynamicCache(config=m.config), ids, mask, beams)
    cache = KVCacheForTransformers(m.config, capacity=40, max_batch_size=rows * beams)
    with attn(m, "kvcache"):
        out = generate(m, cache, ids, mask, beams)
    assert_close_generation(ref, out)
    assert cache.get_seq_length() == ref.sequences.shape[1] - 1
    if pads != (0,) * len(pads):  # padding slots hold no cells
        held = sum(c.used_cells() for c in cache.caches if c.memory is None)
        assert held <= rows * beams * cache.get_seq_length() - sum(pads)


def test_kvcache_attention_reads_the_codes_not_decoded_history(monkeypatch: Any):
    """Under "kvcache" the cache never decodes a history range for transformers: every
    read / get of the cell cache raises, and generate still equals DynamicCache."""
    m = model("gemma3", 32)
    ids, mask = prompts(3, 14, (0, 4, 9))
    with attn(m, "sdpa"):
        ref = generate(m, DynamicCache(config=m.config), ids, mask, beams=2)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("decoded the history")

    monkeypatch.setattr(CausalCache, "read", refuse)
    monkeypatch.setattr(CausalCache, "get", refuse)
    cache = KVCacheForTransformers(m.config, capacity=40, max_batch_size=6)
    with attn(m, "kvcache"):
        assert_close_generation(ref, generate(m, cache, ids, mask, beams=2))


# ---- lossy codecs beyond their fp16 windows ---------------------------------------------
LONG = 150  # prompt tokens: beyond the 128 fp16 rows int4 / kivi / turbo keep per sequence
# relative logit tolerance against the decoded path, by codec: the kernels score int8, int4 and
# turbo keys with the query rounded to int16 steps (kvcache.kernels.attend, documented there),
# which sdpa over decoded K/V does not do; fp16 and kivi4 rows on padded sliding layers
# measured 1.5-2.2e-5 (1e-6 on full layers and without padding)
TOLERANCE = {"fp16": 3e-5, "int8": 1.5e-3, "int4": 6e-5, "kivi4": 3e-5, "turbo4": 1e-4}


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "kivi4", "turbo4"])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_codecs_equal_the_decoded_path(name: str, codec: str):
    """The kernels on the codes give the logits of sdpa over the K/V decoded from the same
    codes (batch 2, left padding, beams), on histories past every fp16 window; the codec is
    lossy there (its logits are not fp32's)."""
    m = model(name, 64)
    ids, mask = prompts(2, LONG, (0, 7))

    def run(implementation: str, spec: str) -> Any:
        cache = KVCacheForTransformers(m.config, capacity=LONG + 20, max_batch_size=4, codec=spec)
        with attn(m, implementation):
            return generate(m, cache, ids, mask, beams=2, new=8)

    decoded = run("sdpa", codec)
    assert_close_generation(decoded, run("kvcache", codec), TOLERANCE[codec])
    if codec != "fp16":
        assert relative(run("sdpa", "fp32").logits[0], decoded.logits[0]) > 1e-4


# ---- the mask function --------------------------------------------------------------------
MASK_CASES = {
    # name: (q_offset, q_length, kv_offset, kv_length, window, pads per row)
    "prefill_padded": (0, 9, 0, 9, None, (0, 3, 8)),
    "decode_padded": (11, 1, 0, 12, None, (0, 3, 8)),
    "chunk_after_past": (6, 4, 0, 10, None, (2, 0, 5)),
    "sliding_prefill_padded": (0, 9, 0, 9, WINDOW, (0, 3, 8)),
    "sliding_decode_offset": (15, 1, 10, 6, WINDOW, (0, 4, 12)),
    "sliding_chunk_offset": (12, 3, 7, 8, WINDOW, (1, 9, 0)),
    "unpadded": (5, 3, 0, 8, None, None),
    "sliding_unpadded": (12, 2, 7, 7, WINDOW, None),
}


@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_registered_mask_equals_transformers_sdpa_mask(case: str):
    q_off, q_len, kv_off, kv_len, window, pads = MASK_CASES[case]
    rows = 3
    padding = None
    if pads is not None:
        padding = torch.ones(rows, q_off + q_len, dtype=torch.bool)
        for r, p in enumerate(pads):
            padding[r, :p] = False
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    kw: dict[str, Any] = {
        "batch_size": rows,
        "q_length": q_len,
        "kv_length": kv_len,
        "q_offset": q_off,
        "kv_offset": kv_off,
        "mask_function": fn,
        "attention_mask": padding,
        "local_size": window,
    }
    ours = kvcache_mask(**kw)
    theirs = sdpa_mask(**kw, allow_is_causal_skip=False)
    assert isinstance(ours, CacheMask)
    assert ours.dense().shape == theirs.shape == (rows, 1, q_len, kv_len)
    assert torch.equal(ours.dense(), theirs)


@pytest.mark.parametrize("sliding", [False, True])
def test_model_mask_hooks_reach_the_registered_function(sliding: bool):
    """Through transformers' own create_*_mask, with a config set to "kvcache": the mask a
    layer gets is ours, and equals what the same call builds for sdpa."""
    config = model("gemma3", 8).config
    embeds = torch.zeros(3, 9, 4)
    padding = torch.ones(3, 9, dtype=torch.long)
    padding[1, :3] = 0
    padding[2, :7] = 0
    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    masks = {}
    for implementation in ("kvcache", "sdpa"):
        config._attn_implementation = implementation
        try:
            masks[implementation] = make(config, embeds, padding, past_key_values=None)
        finally:
            config._attn_implementation = "sdpa"
    assert isinstance(masks["kvcache"], CacheMask)
    assert masks["kvcache"].window == (WINDOW if sliding else None)
    assert torch.equal(masks["kvcache"].dense(), masks["sdpa"])


# ---- errors -------------------------------------------------------------------------------
def test_kvcache_attention_without_our_cache_says_what_to_pass():
    m = model("llama", 32)
    ids, mask = prompts(1, 6, (0,))
    with attn(m, "kvcache"), torch.no_grad():
        with pytest.raises(NotSupportedError, match="KVCacheForTransformers"):
            m(ids, attention_mask=mask, past_key_values=DynamicCache(config=m.config))
        with pytest.raises(NotSupportedError, match="KVCacheForTransformers"):
            m(ids, attention_mask=mask, use_cache=False)


def test_switching_attention_mid_cache_raises_and_reset_recovers():
    m = model("llama", 32)
    ids, mask = prompts(2, 6, (0, 2))
    cache = KVCacheForTransformers(m.config, capacity=16, max_batch_size=2)
    with attn(m, "kvcache"), torch.no_grad():
        m(ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 6
    with attn(m, "sdpa"), torch.no_grad():
        with pytest.raises(CallOrderError, match="reset"):
            m(ids[:, :1], attention_mask=torch.ones(2, 7), past_key_values=cache)
        assert cache.get_seq_length() == 6
        cache.reset()
        m(ids, attention_mask=mask, past_key_values=cache)  # padding stored, as before
    assert cache.caches[0].used_cells() == 12


def test_padding_that_is_not_left_padding_raises_and_changes_nothing():
    m = model("llama", 32)
    ids, mask = prompts(2, 6, (0, 2))
    cache = KVCacheForTransformers(m.config, capacity=16, max_batch_size=2)
    with attn(m, "kvcache"), torch.no_grad():
        right = torch.ones(2, 6, dtype=torch.long)
        right[1, 4:] = 0
        with pytest.raises(NotSupportedError, match="left padding"):
            m(ids, attention_mask=right, past_key_values=cache)
        assert cache.get_seq_length() == 0
        m(ids, attention_mask=mask, past_key_values=cache)
        used = cache.caches[0].used_cells()
        assert used == 6 + 4  # row 1's two padding slots are not stored
        flipped = torch.ones(2, 7, dtype=torch.long)  # row 1's padding turned into tokens
        with pytest.raises(NotSupportedError, match="padding"):
            m(ids[:, :1], attention_mask=flipped, past_key_values=cache)
        assert cache.get_seq_length() == 6 and cache.caches[0].used_cells() == used
        with pytest.raises(InvalidArgumentError, match="attention_mask"):
            m(ids[:, :1], attention_mask=torch.ones(2, 9), past_key_values=cache)


def test_custom_mask_functions_raise():
    with pytest.raises(NotSupportedError, match="custom mask"):
        kvcache_mask(2, 3, 3, mask_function=lambda b, h, q, k: k <= q, use_vmap=True)


# ---- real SmolLM2 ---------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_under_kvcache_attention(hf_model: Any, tokenizer: Any):
    """64 greedy tokens of the real weights: fp32 under "kvcache" equals DynamicCache (sdpa),
    logits within 1e-5 relative; kivi4 on a 300-token history (past its fp16 window) gives
    the decoded path's tokens, logits within 1e-4."""
    text = tokenizer.apply_chat(
        [{"role": "user", "content": "Explain what a key-value cache does in a transformer."}]
    )
    ids = torch.tensor([tokenizer.encode(text)])

    def greedy(implementation: str, cache: Any, prompt: torch.Tensor, new: int) -> Any:
        with attn(hf_model, implementation), torch.no_grad():
            return hf_model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                past_key_values=cache,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
            )

    ref = greedy("sdpa", DynamicCache(config=hf_model.config), ids, 64)
    ours = KVCacheForTransformers(hf_model.config, capacity=ids.shape[1] + 64, codec="fp32")
    assert_close_generation(ref, greedy("kvcache", ours, ids, 64))
    long = torch.cat([ids] * (300 // ids.shape[1] + 1), dim=1)[:, :300]

    def kivi(implementation: str) -> Any:
        cache = KVCacheForTransformers(hf_model.config, capacity=320, codec="kivi4")
        return greedy(implementation, cache, long, 8)

    # measured 7.7e-5 on these weights (the kernels' kivi reads vs torch's decode of the
    # same codes); fp32 above stays within 2e-6
    assert_close_generation(kivi("sdpa"), kivi("kvcache"), 1e-4)

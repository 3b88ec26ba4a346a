"""KVCacheForTransformers against transformers' own DynamicCache.

* generate: same greedy / beam tokens and logits on tiny random Llama, Mistral (sliding),
  Gemma2 and Gemma3 (hybrid) models, eager and sdpa, batch 1, batch 3 with left padding,
  beams, prompts longer than the sliding window;
* a Hypothesis state machine drives both caches with random K/V, forwards, beam reorders,
  row selection/repetition and crops, and checks after every step that every layer returns
  exactly DynamicCache's keys and values (for int8/int4: their codec round trip) and the same
  mask sizes, that reorders share cells, and that the cell bookkeeping stays consistent;
* the window off-by-one (transformers' SW = our W + 1), the sliding layers' bounded memory,
  a window imposed on full-attention layers, in-place storage, typed errors;
* real SmolLM2-135M loaded by transformers from the GGUF: 64 greedy tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)
from transformers.masking_utils import sliding_window_causal_mask_function

from kvcache import Batch, CausalCache
from kvcache.codecs import AffineRowsCodec, Codec
from kvcache.errors import (
    CacheFullError,
    CallOrderError,
    DimensionMismatchError,
    InvalidArgumentError,
    InvalidConfigError,
    NotSupportedError,
)
from kvcache.hf import KVCacheForTransformers, cell_window
from kvcache.policy import Policy

VOCAB = 211
WINDOW = 6  # transformers' sliding window of the tiny models (prompts are longer)
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,  # tied, Gemma's scaled embeddings make every step repeat
}
HYBRID = ["sliding_attention", "full_attention", "sliding_attention"]
MODELS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"num_hidden_layers": 2}),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        {"num_hidden_layers": 2, "sliding_window": WINDOW},
    ),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"num_hidden_layers": 2, "sliding_window": WINDOW}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": HYBRID},
    ),
    # head_dim 32: the int4 codecs quantize groups of 32 channels
    "gemma3_d32": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": HYBRID, "head_dim": 32},
    ),
}


@functools.cache
def tiny(name: str, attn: str) -> Any:
    """A random-weight model from its transformers config class (no download), eval mode."""
    config_cls, model_cls, extra = MODELS[name]
    config = config_cls(**{**SMALL, **extra})
    config._attn_implementation = attn
    torch.manual_seed(0)
    return model_cls(config).eval()


def prompts(rows: int, length: int, pads: tuple[int, ...], seed: int = 1) -> tuple[Any, Any]:
    """Token ids [rows, length] and a left-padding attention mask (row r has pads[r] pads)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    for r, p in enumerate(pads):
        mask[r, :p] = 0
        ids[r, :p] = 0
    return ids, mask


def generate(model: Any, cache: Any, ids: Any, mask: Any, beams: int = 1, new: int = 16) -> Any:
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=new,
            do_sample=False,
            num_beams=beams,
            return_dict_in_generate=True,
            output_logits=True,
        )


def assert_same_generation(ref: Any, out: Any, atol: float = 1e-5) -> None:
    assert torch.equal(ref.sequences, out.sequences), (ref.sequences, out.sequences)
    for step, (a, b) in enumerate(zip(ref.logits, out.logits, strict=True)):
        assert torch.allclose(a, b, atol=atol, rtol=0), (step, (a - b).abs().max().item())


# (rows, beams, left pads per row): prompts of 14 tokens, longer than WINDOW
CASES = {
    "batch1": (1, 1, (0,)),
    "batch3_left_padding": (3, 1, (0, 4, 9)),
    "beams3": (2, 3, (0, 5)),
}
MODEL_ATTN = [(m, a) for m in ("llama", "mistral", "gemma3") for a in ("eager", "sdpa")] + [
    ("gemma2", "eager")
]  # gemma2's logit softcapping has no sdpa path


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("name", "attn"), MODEL_ATTN)
def test_generate_equals_dynamic_cache(name: str, attn: str, case: str):
    model = tiny(name, attn)
    rows, beams, pads = CASES[case]
    ids, mask = prompts(rows, 14, pads)
    ref = generate(model, DynamicCache(config=model.config), ids, mask, beams)
    cache = KVCacheForTransformers(model.config, capacity=40, max_batch_size=rows * beams)
    out = generate(model, cache, ids, mask, beams)
    assert_same_generation(ref, out, atol=0.0 if attn == "eager" else 1e-5)
    assert cache.get_seq_length() == ref.sequences.shape[1] - 1  # the last token is not fed


@pytest.mark.parametrize(("name", "attn"), MODEL_ATTN[::2] + [("gemma2", "eager")])
def test_generated_tokens_are_not_trivial(name: str, attn: str):
    """Guard for the comparisons above: the tiny models' greedy output is no repeated token
    and depends on the prompt's first token, so wrong or missing K/V would change it."""
    model = tiny(name, attn)
    ids, mask = prompts(3, 14, (0, 4, 9))
    seqs = generate(model, DynamicCache(config=model.config), ids, mask).sequences[:, 14:]
    assert all(len(set(r)) > 4 for r in seqs.tolist())
    ids[:, -WINDOW - 1] = (ids[:, -WINDOW - 1] + 1) % VOCAB  # just outside the last window
    other = generate(model, DynamicCache(config=model.config), ids, mask).sequences[:, 14:]
    assert not torch.equal(seqs, other)


@pytest.mark.parametrize("codec", ["fp32", None])
def test_fp32_codec_exactly_equal_on_hybrid_with_beams(codec: str | None):
    model = tiny("gemma3", "sdpa")
    ids, mask = prompts(2, 14, (0, 5))
    ref = generate(model, DynamicCache(config=model.config), ids, mask, beams=3, new=24)
    cache = KVCacheForTransformers(model.config, capacity=64, max_batch_size=6, codec=codec)
    assert_same_generation(ref, generate(model, cache, ids, mask, beams=3, new=24), atol=0.0)


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "kivi4"])
def test_lossy_codecs_generate_with_padding_and_beams(codec: str):
    """Every codec serves the gather path (padded rows, shared beam cells); storage is
    smaller than fp32 and the first step's logits stay near the exact ones."""
    model = tiny("gemma3_d32", "sdpa")
    ids, mask = prompts(2, 14, (0, 5))
    ref = generate(model, DynamicCache(config=model.config), ids, mask, beams=3)
    exact = KVCacheForTransformers(model.config, capacity=64, max_batch_size=6)
    generate(model, exact, ids, mask, beams=3)
    cache = KVCacheForTransformers(model.config, capacity=64, max_batch_size=6, codec=codec)
    out = generate(model, cache, ids, mask, beams=3)
    assert out.sequences.shape == ref.sequences.shape
    scale = ref.logits[0].abs().max().item()
    assert (ref.logits[0] - out.logits[0]).abs().max().item() <= 0.25 * scale
    assert cache.memory_usage_bytes() < exact.memory_usage_bytes()


# ---- the window off-by-one -------------------------------------------------------------
@pytest.mark.parametrize("sw", [1, 2, 5])
def test_cell_window_matches_transformers_sliding_mask(sw: int):
    """transformers' window SW shows SW tokens (itself included); ours W shows W + 1."""
    n = 12
    pos = np.arange(n)
    ours = Policy(window=cell_window(sw), chunk=None, memory=None).mask(
        np.ones((n, n), dtype=bool), pos, pos, np.ones(n, dtype=bool)
    )
    fn = sliding_window_causal_mask_function(sw)
    theirs = np.array(
        [[bool(fn(0, 0, torch.tensor(q), torch.tensor(k))) for k in range(n)] for q in range(n)]
    )
    assert (ours == theirs).all()
    assert ours[-1].sum() == sw


def test_sliding_layers_return_exactly_the_window_and_evict_the_rest():
    """Mistral (all layers sliding): a decode step sees WINDOW keys, as DynamicCache's sliding
    layer returns; the cells keep only the positions the next forward can need (+1)."""
    model = tiny("mistral", "eager")
    ids, mask = prompts(1, 14, (0,))
    cache = KVCacheForTransformers(model.config, capacity=40)
    out = generate(model, cache, ids, mask, new=10)
    total = out.sequences.shape[1] - 1
    assert cache.get_mask_sizes(1, 0) == (WINDOW, total - WINDOW + 1)
    [cells] = cache.caches
    [seq] = cells.sequences()
    assert cells.positions(seq) == list(range(total - 1 - WINDOW, total))


def test_sliding_cells_shrink_with_max_forward_tokens():
    """Sliding layers need window + new tokens cells per row; a cap on the tokens per
    forward shrinks them without changing the output."""
    model = tiny("gemma3", "sdpa")
    ids, mask = prompts(2, 14, (0, 3))
    default = KVCacheForTransformers(model.config, capacity=40, max_batch_size=2)
    small = KVCacheForTransformers(
        model.config, capacity=40, max_batch_size=2, max_forward_tokens=16
    )
    a, b = (generate(model, c, ids, mask).sequences for c in (default, small))
    assert torch.equal(a, b)
    cells = {g.window: c.num_cells for g, c in zip(small.groups, small.caches, strict=True)}
    assert cells == {None: 2 * 40, WINDOW: 2 * (WINDOW + 16)}
    assert small.memory_usage_bytes() < default.memory_usage_bytes()


def test_chunked_prefill_fits_a_window_sized_sliding_pool():
    """generate(prefill_chunk_size=8) with max_forward_tokens=8: a 30-token prompt through
    sliding layers that hold WINDOW + 8 cells, same tokens as DynamicCache."""
    model = tiny("gemma3", "sdpa")
    ids, mask = prompts(1, 30, (0,))
    kw = {"max_new_tokens": 10, "do_sample": False, "prefill_chunk_size": 8}
    with torch.no_grad():
        ref = model.generate(
            ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), **kw
        )
        cache = KVCacheForTransformers(model.config, capacity=64, max_forward_tokens=8)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, **kw)
    assert torch.equal(ref, out)
    cells = {g.window: c.num_cells for g, c in zip(cache.groups, cache.caches, strict=True)}
    assert cells == {WINDOW: WINDOW + 8, None: 64}
    with pytest.raises(InvalidArgumentError, match="max_forward_tokens"):
        generate(
            model,
            KVCacheForTransformers(model.config, capacity=64, max_forward_tokens=8),
            ids,
            mask,
        )


def test_window_on_full_attention_layers_equals_a_sliding_model():
    """Llama with window=W decodes exactly like Mistral (same weights) with sliding_window=W."""
    llama = tiny("llama", "sdpa")
    config = MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=WINDOW)
    config._attn_implementation = "sdpa"
    mistral = MistralForCausalLM(config).eval()
    mistral.load_state_dict(llama.state_dict())
    ids, mask = prompts(1, WINDOW, (0,))
    ref = generate(mistral, DynamicCache(config=config), ids, mask, new=20)
    cache = KVCacheForTransformers(llama.config, capacity=40, window=WINDOW)
    assert_same_generation(ref, generate(llama, cache, ids, mask, new=20))
    unbounded = generate(llama, DynamicCache(config=llama.config), ids, mask, new=20)
    assert not torch.equal(unbounded.sequences, ref.sequences)  # the window matters here
    long_ids, long_mask = prompts(1, WINDOW + 1, (0,))
    with pytest.raises(NotSupportedError, match="window"):
        generate(
            llama,
            KVCacheForTransformers(llama.config, capacity=40, window=WINDOW),
            long_ids,
            long_mask,
        )


# ---- storage -------------------------------------------------------------------------
def _kv(rows: int, heads: int, tokens: int, dim: int, seed: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, heads, tokens, dim, generator=g),
        torch.randn(rows, heads, tokens, dim, generator=g),
    )


def test_batch1_returns_views_of_the_preallocated_cells():
    config = tiny("llama", "sdpa").config
    cache = KVCacheForTransformers(config, capacity=32)
    buffers: list[int] = []
    for step, t in enumerate([5, 1, 1, 1]):
        for layer in range(config.num_hidden_layers):
            k, v = _kv(1, 2, t, 8, seed=10 * step + layer)
            keys, values = cache.update(k, v, layer)
            data = cache.caches[0].storage.layers[layer].keys.data
            assert keys.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            assert torch.equal(keys[:, :, -t:], k) and torch.equal(values[:, :, -t:], v)
            if step == 0:
                buffers.append(data.data_ptr())
            assert data.data_ptr() == buffers[layer]  # written in place, never reallocated
    assert cache.memory_usage_bytes() == 2 * 2 * 32 * 2 * 8 * 4  # layers, K+V, cells, H, D, fp32


def test_reorder_shares_cells_instead_of_copying():
    config = tiny("llama", "sdpa").config
    cache = KVCacheForTransformers(config, capacity=32, max_batch_size=3)
    ref = DynamicCache(config=config)
    for layer in range(2):
        k, v = _kv(3, 2, 6, 8, seed=layer)
        cache.update(k, v, layer)
        ref.update(k, v, layer)
    [cells] = cache.caches
    used = cells.used_cells()
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    ref.reorder_cache(torch.tensor([2, 2, 0]))
    assert cells.used_cells() == 2 * 6  # old row 1's cells freed, row 2's shared: no copy
    assert used == 3 * 6
    for layer in range(2):
        k, v = _kv(3, 2, 1, 8, seed=5 + layer)
        ours, theirs = cache.update(k, v, layer), ref.update(k, v, layer)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


# ---- the state machine ---------------------------------------------------------------
def _roundtrip(codec: str | Codec | None, role: str, x: torch.Tensor) -> torch.Tensor:
    """What a codec gives back for rows x [B, H, L, D], each row encoded on its own (the
    machines' codecs keep no window, seal each row as written and use no key centre),
    through a fresh cell cache."""
    if codec in (None, "fp32"):
        return x
    b, h, n, d = x.shape
    rows = x.transpose(1, 2).reshape(b * n, h, d)  # [B*L, H, D]
    cache = CausalCache(b * n, **{f"{role}_codec": codec})
    cache.start_forward(Batch.single(0, 0, b * n))
    cache.put(0, rows, rows)
    keys, values = cache.read(0, slice(0, b * n))
    return (keys if role == "key" else values).view(b, n, h, d).transpose(1, 2)


class CacheMachine(RuleBasedStateMachine):
    """Random forwards / reorders / row changes / crops on ours and on DynamicCache."""

    LAYER_TYPES = HYBRID
    CODEC: str | Codec | None = None
    CAPACITY = 40
    PREALLOCATED = True
    MAX_ROWS = 6
    HEAD_DIM = 8

    def __init__(self) -> None:
        super().__init__()
        config = Gemma3TextConfig(
            **{**SMALL, "head_dim": self.HEAD_DIM},
            num_hidden_layers=len(self.LAYER_TYPES),
            sliding_window=4,
            layer_types=list(self.LAYER_TYPES),
        )
        self.ours = KVCacheForTransformers(
            config, capacity=self.CAPACITY, max_batch_size=self.MAX_ROWS, codec=self.CODEC
        )
        self.ref = DynamicCache(config=config)
        self.rows = 0
        self.length = 0
        self.seed = 0
        self.bytes: int | None = None

    @initialize(rows=st.integers(1, 3), tokens=st.integers(1, 9))
    def prefill(self, rows: int, tokens: int) -> None:
        self.rows = rows
        self._forward(tokens)

    @precondition(lambda self: self.length < self.CAPACITY)
    @rule(data=st.data())
    def forward(self, data: Any) -> None:
        self._forward(data.draw(st.integers(1, min(5, self.CAPACITY - self.length))))

    def _forward(self, tokens: int) -> None:
        """One forward of ``tokens`` new tokens per row through every layer of both caches."""
        for layer in range(len(self.LAYER_TYPES)):
            assert self.ours.get_mask_sizes(tokens, layer) == self.ref.get_mask_sizes(tokens, layer)
            self.seed += 1
            k, v = _kv(self.rows, 2, tokens, self.HEAD_DIM, self.seed)
            ok, ov = self.ours.update(k, v, layer)
            rk, rv = self.ref.update(k, v, layer)
            assert torch.equal(ok, _roundtrip(self.CODEC, "key", rk))
            assert torch.equal(ov, _roundtrip(self.CODEC, "value", rv))
        self.length += tokens

    # DynamicCache ignores row operations while empty (then fails): rows change with tokens
    @precondition(lambda self: self.length > 0)
    @rule(data=st.data())
    def reorder(self, data: Any) -> None:
        idx = data.draw(
            st.lists(st.integers(0, self.rows - 1), min_size=self.rows, max_size=self.rows)
        )
        before = [c.used_cells() for c in self.ours.caches]
        self.ours.reorder_cache(torch.tensor(idx))
        self.ref.reorder_cache(torch.tensor(idx))
        after = [c.used_cells() for c in self.ours.caches]
        assert all(a <= b for a, b in zip(after, before, strict=True))  # shared, never copied

    @precondition(lambda self: self.length > 0)
    @rule(data=st.data())
    def select(self, data: Any) -> None:
        idx = data.draw(st.lists(st.integers(0, self.rows - 1), min_size=1, max_size=self.rows))
        self.ours.batch_select_indices(torch.tensor(idx))
        self.ref.batch_select_indices(torch.tensor(idx))
        self.rows = len(idx)

    @precondition(lambda self: self.length > 0 and self.rows * 2 <= self.MAX_ROWS)
    @rule(repeats=st.integers(1, 2))
    def repeat(self, repeats: int) -> None:
        self.ours.batch_repeat_interleave(repeats)
        self.ref.batch_repeat_interleave(repeats)
        self.rows *= repeats

    @precondition(lambda self: self.length > 0 and "sliding_attention" not in self.LAYER_TYPES)
    @rule(data=st.data())
    def crop(self, data: Any) -> None:
        n = data.draw(st.integers(0, self.length))
        self.ours.crop(-n)
        self.ref.crop(-n)
        self.length -= n

    @invariant()
    def consistent(self) -> None:
        assert self.ours.get_seq_length() == self.ref.get_seq_length() == self.length
        assert self.ours.batch_size in (-1, self.rows)
        for cache in self.ours.caches:
            cache.cells.check()
            assert len(cache.sequences()) <= self.rows  # released rows leave nothing behind
        if self.ours.caches:
            nbytes = self.ours.memory_usage_bytes()
            if self.bytes is not None:  # floats and int8 are preallocated; int4 codes grow
                assert nbytes == self.bytes if self.PREALLOCATED else nbytes >= self.bytes
            self.bytes = nbytes


class FullAttentionMachine(CacheMachine):
    LAYER_TYPES = ["full_attention", "full_attention"]


class Int8Machine(CacheMachine):
    CODEC = "int8:batch=1"  # each row encoded as it is written (no rows waiting in fp16)
    PREALLOCATED = False  # codes are allocated as rows are encoded


class Int4Machine(FullAttentionMachine):
    # int4 without the fp16 window and the key centre: each row round-trips on its own
    # (test_codecs checks the window and the centre)
    CODEC = AffineRowsCodec(4, 32, centre=False, window=0, name="int4", batch=1)
    PREALLOCATED = False
    HEAD_DIM = 32


TestHybridMachine = CacheMachine.TestCase
TestFullAttentionMachine = FullAttentionMachine.TestCase
TestInt8Machine = Int8Machine.TestCase
TestInt4Machine = Int4Machine.TestCase
_SETTINGS = settings(
    max_examples=25,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHybridMachine.settings = _SETTINGS
TestFullAttentionMachine.settings = _SETTINGS
TestInt8Machine.settings = _SETTINGS
TestInt4Machine.settings = _SETTINGS


# ---- errors --------------------------------------------------------------------------
def test_crop_and_continue_equals_dynamic_cache():
    config = tiny("llama", "eager").config
    ours, ref = KVCacheForTransformers(config, capacity=32), DynamicCache(config=config)
    for t in (7, 1, 1):
        for layer in range(2):
            k, v = _kv(1, 2, t, 8, seed=t + layer)
            ours.update(k, v, layer)
            ref.update(k, v, layer)
    ours.crop(-3)
    ref.crop(-3)
    ours.crop(0)
    assert ours.get_seq_length() == 6
    for layer in range(2):
        k, v = _kv(1, 2, 2, 8, seed=40 + layer)
        assert torch.equal(ours.update(k, v, layer)[0], ref.update(k, v, layer)[0])
    with pytest.raises(InvalidArgumentError, match="tokens_to_remove"):
        ours.crop(2)
    with pytest.raises(InvalidArgumentError, match="tokens_to_remove"):
        ours.crop(-9)


def test_crop_past_an_evicted_window_raises_and_changes_nothing():
    model = tiny("mistral", "eager")
    cache = KVCacheForTransformers(model.config, capacity=40)
    ids, mask = prompts(1, 14, (0,))
    generate(model, cache, ids, mask, new=4)
    length = cache.get_seq_length()
    [cells] = cache.caches
    held = cells.positions(cells.sequences()[0])
    with pytest.raises(NotSupportedError, match="evicted"):
        cache.crop(-5)
    assert cache.get_seq_length() == length and cells.positions(cells.sequences()[0]) == held
    cache.crop(-1)  # still inside what is stored
    assert cache.get_seq_length() == length - 1


def test_capacity_and_batch_errors_leave_the_cache_unchanged():
    config = tiny("llama", "eager").config
    cache = KVCacheForTransformers(config, capacity=8, max_batch_size=2)
    with pytest.raises(InvalidArgumentError, match="max_batch_size"):
        cache.update(*_kv(3, 2, 2, 8, 0), 0)
    for layer in range(2):
        cache.update(*_kv(2, 2, 6, 8, layer), layer)
    with pytest.raises(CacheFullError):
        cache.update(*_kv(2, 2, 3, 8, 5), 0)
    assert cache.get_seq_length() == 6 and cache.caches[0].used_cells() == 12
    with pytest.raises(InvalidArgumentError, match="batch size"):
        cache.update(*_kv(1, 2, 1, 8, 5), 0)
    with pytest.raises(InvalidArgumentError, match="max_batch_size"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(InvalidArgumentError, match="beam_idx"):
        cache.reorder_cache(torch.tensor([0, 2]))
    cache.update(*_kv(2, 2, 1, 8, 6), 0)
    with pytest.raises(CallOrderError, match="different lengths"):
        cache.reorder_cache(torch.tensor([1, 0]))  # mid-forward: layer 1 not updated yet
    with pytest.raises(DimensionMismatchError):
        cache.update(*_kv(2, 2, 2, 8, 7), 1)  # this forward has 1 new token per row
    cache.update(*_kv(2, 2, 1, 8, 8), 1)
    with pytest.raises(InvalidArgumentError, match="key_states"):
        cache.update(*(x.double() for x in _kv(2, 2, 1, 8, 9)), 0)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.caches[0].used_cells() == 0
    cache.update(*_kv(1, 2, 4, 8, 10), 0)  # a new batch size after reset


def test_unsupported_configs_and_calls_raise():
    config = LlamaConfig(**SMALL, num_hidden_layers=2)
    config.layer_types = ["full_attention", "chunked_attention"]
    config.attention_chunk_size = 4
    with pytest.raises(NotSupportedError, match="chunked_attention"):
        KVCacheForTransformers(config)
    good = tiny("llama", "eager").config
    with pytest.raises(InvalidConfigError, match="codec"):
        KVCacheForTransformers(good, codec="int3")
    with pytest.raises(InvalidConfigError, match="capacity"):
        KVCacheForTransformers(good, capacity=0)
    cache = KVCacheForTransformers(good, capacity=16)
    with pytest.raises(NotSupportedError, match="early_initialization"):
        cache.early_initialization(1, 2, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(NotSupportedError, match="layers share cells"):
        cache.layers[0].reorder_cache(torch.tensor([0]))
    with pytest.raises(NotSupportedError, match="only appends"):
        cache.update(*_kv(1, 2, 2, 8, 0), 0, {"cache_position": torch.tensor([3, 4])})
    assert not cache.is_compileable


# ---- real SmolLM2 ----------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_64_greedy_tokens(hf_model: Any, tokenizer: Any, record_property: Any):
    text = tokenizer.apply_chat(
        [{"role": "user", "content": "Explain what a key-value cache does in a transformer."}]
    )
    ids = torch.tensor([tokenizer.encode(text)])
    capacity = ids.shape[1] + 64

    def greedy(cache: Any) -> list[int]:
        with torch.no_grad():
            out = hf_model.generate(
                ids, past_key_values=cache, max_new_tokens=64, min_new_tokens=64, do_sample=False
            )
        return out[0, ids.shape[1] :].tolist()

    ref = greedy(DynamicCache(config=hf_model.config))
    assert len(ref) == 64
    assert greedy(KVCacheForTransformers(hf_model.config, capacity=capacity, codec="fp32")) == ref
    int8 = greedy(KVCacheForTransformers(hf_model.config, capacity=capacity, codec="int8"))
    first = next((i for i, (a, b) in enumerate(zip(ref, int8, strict=True)) if a != b), None)
    record_property("int8_first_differing_token", first)
    print(f"int8 vs DynamicCache: first differing token = {first}")
    assert first is None or first >= 32, first

"""KVzip (kvcache.press.kvzip): its scores equal kvpress's KVzipPress computed from float64
no-cache forwards of the context and each chunk's repeat (``tests/reference/press.py``), it
keeps exactly the cells that reference picks, the repeats leave nothing behind, and misuse
gets typed errors with the cache as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.errors import CacheFullError, CallOrderError, InvalidArgumentError
from kvcache.models.llama import Llama
from kvcache.press import Reconstruction, make_press
from reference import press as ref

T = 120
CHUNKS = (70, 50)
FIRST, LATER, SUFFIX = [11, 12, 13], [14, 15], [16, 17]
SKIP = 6  # the "template prefix": never repeated, kept
CHUNK = 50  # three repeats: positions 6..55, 56..105, 106..119
RATIO = 0.4


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return np.random.default_rng(5).integers(0, 97, T).tolist()


def prefill(model: Llama, tokens: list[int], capacity: int = 256) -> CausalCache:
    cache = model.new_cache(capacity)
    start = 0
    for n in CHUNKS:
        pos = list(range(start, start + n))
        model.forward(tokens[start : start + n], Batch(positions=pos, sequences=[0] * n), cache)
        start += n
    return cache


def bound(model: Llama, spec: str, skip: int = SKIP) -> object:
    return make_press(spec).bind(Reconstruction(model, FIRST, LATER, SUFFIX, skip))


@pytest.mark.parametrize(
    ("spec", "skip", "room"),
    [  # skip 0: the first repeat has no sinks to attend to (kvpress's min(n_sink, start));
        # room: the longest repeat (a later prompt: 2 + 8 quoted + 2 + 50 chunk tokens, or
        # with one chunk: 3 + 2 + the 114 tokens after the prefix)
        (f"kvzip:{RATIO},chunk={CHUNK}", 0, 62),
        (f"kvzip:{RATIO},chunk={CHUNK}", SKIP, 62),
        (f"chunkkv:{RATIO},inner=kvzip", SKIP, 119),
    ],
)
def test_scores_and_kept_cells_equal_kvpress(
    spec: str, skip: int, room: int, history_model: Llama, tokens: list[int]
) -> None:
    chunk = CHUNK if spec.startswith("kvzip") else 2048  # chunkkv's inner kvzip: one repeat
    want = ref.kvzip(history_model, tokens, FIRST, LATER, SUFFIX, skip, chunk)
    cache = prefill(history_model, tokens)
    press = bound(history_model, spec, skip)
    assert press.extra_cells(T) == room
    kept = int(T * (1 - RATIO))
    got = press.scores(press.scoring(cache, 0, kept, tokens=tokens))
    torch.testing.assert_close(got.double(), want, rtol=1e-9, atol=1e-12)
    # the repeats are gone: the sequence holds its context only, every other cell is free
    assert cache.positions(0) == list(range(T))
    assert cache.free_cells() == cache.num_cells - T
    if spec.startswith("kvzip"):
        expect = ref.cell_decision(ref.cell_score(want), kept)
    else:
        expect = ref.chunk_decision(ref.cell_score(want), kept, press.chunk)
    assert expect != list(range(T - kept, T))
    assert set(range(max(skip, 4))) <= set(expect)  # the prefix and the sinks stay
    freed = press.compress(cache, 0, tokens=tokens)
    assert cache.positions(0) == expect
    assert freed == T - kept
    assert cache.free_cells() == cache.num_cells - kept
    # decoding goes on from the pressed cache at T
    history_model.forward([5], Batch(positions=[T], sequences=[0]), cache)
    assert cache.next_position(0) == T + 1


def test_misuse_gets_typed_errors_and_leaves_the_cache(
    history_model: Llama, tokens: list[int]
) -> None:
    cache = prefill(history_model, tokens, capacity=150)  # no room for a 2048-token repeat
    before, free = cache.positions(0), cache.free_cells()
    with pytest.raises(CallOrderError, match="bind"):
        make_press("kvzip:0.5").compress(cache, 0, tokens=tokens)
    press = bound(history_model, "kvzip:0.5")
    with pytest.raises(InvalidArgumentError, match="tokens"):
        press.compress(cache, 0)
    with pytest.raises(InvalidArgumentError, match="tokens"):
        press.compress(cache, 0, tokens=tokens[:-1])
    with pytest.raises(CacheFullError):  # the repeat (122 tokens) does not fit in 30 cells
        press.compress(cache, 0, tokens=tokens)
    assert cache.positions(0) == before and cache.free_cells() == free
    with pytest.raises(InvalidArgumentError, match="kvzip"):
        press.during_decode(64)
    with pytest.raises(InvalidArgumentError, match="kvzip"):
        make_press("chunkkv:0.5,inner=kvzip").during_decode(64)
    with pytest.raises(InvalidArgumentError, match="Reconstruction"):
        press.bind(history_model)
    # a pressed sequence (positions no longer 0..n-1) is not repeated again
    bound(history_model, "knorm:0.5").compress(cache, 0)
    with pytest.raises(InvalidArgumentError, match="tokens"):
        press.compress(cache, 0, tokens=tokens[: len(cache.positions(0))])


@pytest.mark.parametrize("codec", ["int8", "kivi4", "turbo4"])  # after / before RoPE, rotated
def test_kvzip_on_quantized_codecs(codec: str, history_model: Llama, tokens: list[int]) -> None:
    """The repeat goes through a quantizing codec's windows and seals (KIVI's groups of 64
    rows included) and is removed: the books stay consistent, the scores are attention
    probabilities, the press frees its share and decoding goes on."""
    long = tokens + tokens  # 240 tokens: well past the fp16 window of 128
    cache = history_model.new_cache(640, codec=codec)
    for a in range(0, len(long), 80):
        pos = list(range(a, a + 80))
        history_model.forward(long[a : a + 80], Batch(positions=pos, sequences=[0] * 80), cache)
    held = cache.held_bytes(0)
    press = bound(history_model, "chunkkv:0.5,inner=kvzip")
    scores = press.scores(press.scoring(cache, 0, 120, tokens=long))
    assert scores.shape[-1] == len(long) and 0 <= float(scores.min()) <= float(scores.max()) <= 1
    assert bool((scores[..., :SKIP] == 1).all()) and float(scores[..., SKIP:].std()) > 0.05
    assert cache.positions(0) == list(range(len(long)))
    cache.cells.check()
    for w in cache.storage.windows.values():
        w.check(cache.cells)
    assert press.compress(cache, 0, tokens=long) == 120
    assert len(cache.positions(0)) == 120 and cache.held_bytes(0) < held / 1.5
    logits = history_model.forward([3], Batch(positions=[240], sequences=[0]), cache)
    assert torch.isfinite(logits).all()

"""Each press's scores equal kvpress's, computed from a float64 no-cache forward
(``tests/reference/press.py``), and the press keeps exactly the cells that reference picks.

The prompt is prefilled in two chunks (70 + 50 tokens), so SnapKV's 64-row window spans
both: the query window must keep the newest rows across forwards."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.errors import CallOrderError
from kvcache.models.llama import Llama
from kvcache.press import make_press
from kvcache.press.adakv import AdaKV
from reference import press as ref

T = 120
CHUNKS = (70, 50)
RATIO = 0.3  # keeps 84 cells: more than SnapKV's 64-row window


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return np.random.default_rng(3).integers(0, 97, T).tolist()


@pytest.fixture(scope="module")
def states(history_model: Llama, tokens: list[int]) -> list[ref.LayerStates]:
    return ref.no_cache_states(history_model, tokens)


def prefill(model: Llama, tokens: list[int], spec: str) -> tuple[CausalCache, object]:
    cache = model.new_cache(256)
    press = make_press(spec)
    start = 0
    with press.observe(cache):
        for n in CHUNKS:
            pos = list(range(start, start + n))
            model.forward(tokens[start : start + n], Batch(positions=pos, sequences=[0] * n), cache)
            start += n
    return cache, press


def reference_scores(name: str, states: list[ref.LayerStates], theta: float) -> torch.Tensor:
    """kvpress's scores [L, Hkv, T] per layer."""
    per_layer = {
        "snapkv": lambda st: ref.snapkv(st),
        "tova": lambda st: ref.tova(st),
        "knorm": lambda st: ref.knorm(st),
        "expected": lambda st: ref.expected(st, theta),
        "streaming": lambda st: ref.streaming(T, RATIO).expand(st.k.shape[1], -1),
        "adakv": lambda st: ref.snapkv(st),
        "chunkkv": lambda st: ref.knorm(st),  # its default inner press
        "chunkkv,inner=snapkv,chunk=8": lambda st: ref.snapkv(st),
    }[name]
    return torch.stack([per_layer(st) for st in states])


@pytest.mark.parametrize(
    "name",
    [
        "snapkv",
        "tova",
        "knorm",
        "expected",
        "streaming",
        "adakv",
        "chunkkv",
        "chunkkv,inner=snapkv,chunk=8",
    ],
)
def test_scores_and_kept_cells_equal_kvpress(
    name: str,
    history_model: Llama,
    tokens: list[int],
    states: list[ref.LayerStates],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    press_name, _, options = name.partition(",")
    cache, press = prefill(history_model, tokens, f"{press_name}:{RATIO},{options}".rstrip(","))
    kept = int(T * (1 - RATIO))
    want = reference_scores(name, states, history_model.config.rope_theta)
    decoded = {"keys": 0, "values": 0}  # layers whose K / V the scoring decoded
    for side in decoded:
        read = getattr(cache.storage, f"read_{side}")

        def counted(
            *args: object, _read: Callable[..., torch.Tensor] = read, _side: str = side
        ) -> torch.Tensor:
            decoded[_side] += 1
            return _read(*args)

        monkeypatch.setattr(cache.storage, f"read_{side}", counted)
    got = press.scores(press.scoring(cache, 0, kept))
    torch.testing.assert_close(got.double().expand_as(want), want, rtol=1e-9, atol=1e-12)
    layers = len(states)
    # each layer's keys decoded once (none for streaming), values only for expected's norms
    assert decoded == {
        "keys": 0 if press_name == "streaming" else layers,
        "values": layers if press_name == "expected" else 0,
    }
    if name == "adakv":
        votes = sum(ref.adakv_selected(want[i], kept).sum(0) for i in range(len(states)))
        score = ref.cell_score(want)
        order = sorted(range(T), key=lambda i: (i != T - 1, -int(votes[i]), -score[i], i))
        expect = sorted(order[:kept])
    elif press_name == "chunkkv":
        expect = ref.chunk_decision(ref.cell_score(want), kept, press.chunk)
    else:
        expect = ref.cell_decision(ref.cell_score(want), kept)
    assert expect != list(range(T - kept, T))  # the choice is not just "the newest"
    freed = press.compress(cache, 0)
    assert cache.positions(0) == expect
    assert cache.next_position(0) == T  # the newest cell stays: decode goes on at T
    assert freed == T - kept
    assert cache.free_cells() == cache.num_cells - kept


def test_query_window_keeps_the_newest_rows_across_chunks(
    history_model: Llama, tokens: list[int], states: list[ref.LayerStates]
) -> None:
    cache, press = prefill(history_model, tokens, "snapkv:0.5")
    for layer, st in enumerate(states):
        q, pos = press.scoring(cache, 0, 10).queries(layer)
        assert pos.tolist() == list(range(T - 64, T))
        torch.testing.assert_close(q, st.q[-64:], rtol=1e-10, atol=1e-12)


def test_adakv_votes_follow_head_budgets() -> None:
    """A head with one peaked cell and a flat head: AdaKV's global pruning gives the flat
    head the budget, so its best cells win over the peaked head's second best."""
    scores = torch.tensor([[[10.0, 0.0, 0.0, 0.0], [0.5, 0.4, 0.45, 0.41]]])  # [1, 2, 4]
    press = AdaKV(0.5)
    sel = ref.adakv_selected(scores[0], 2, 0.2)
    # kvpress: head 0 keeps cell 0 only, head 1 keeps 0, 2, 3 (4 pairs = 2 heads x 2 kept)
    assert sel.tolist() == [[True, False, False, False], [True, False, True, True]]
    from kvcache.press.adakv import selected

    assert torch.equal(selected(scores, 2, 0.2)[0], sel)
    assert press.alpha == 0.2
    # the safeguard: with alpha 0.5 each head keeps its 2 best first; without it the peaked
    # head would keep only cell 0 and the flat head 7 cells
    peaked = [10, 0.05, 0.04, 0.03, 0.02, 0.01, 0.005, 0.001]
    flat = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    two = torch.tensor([[peaked, flat]], dtype=torch.float64)  # [1, 2, 8]
    want = [[True, True] + [False] * 6, [True] * 6 + [False] * 2]
    assert ref.adakv_selected(two[0], 4, 0.5).tolist() == want
    assert selected(two, 4, 0.5)[0].tolist() == want


def test_query_presses_need_an_observed_prefill(history_model: Llama, tokens: list[int]) -> None:
    cache = history_model.new_cache(256)
    history_model.forward(tokens[:80], Batch(positions=list(range(80)), sequences=[0] * 80), cache)
    before = cache.positions(0)
    for spec in ("snapkv:0.5", "tova:0.5", "expected:0.5", "adakv:0.5"):
        with pytest.raises(CallOrderError, match="observe"):
            make_press(spec).compress(cache, 0)
    assert cache.positions(0) == before
    assert make_press("knorm:0.5").compress(cache, 0) == 40  # query-agnostic: no observe


def test_chunkkv_keeps_whole_chunks() -> None:
    """Cells 2 and 3 score low but their chunk's mean ties the next chunk's and comes first:
    they stay, while the per-cell rule would keep 4..7 instead."""
    from kvcache.press.base import newest_first, top_cells
    from kvcache.press.chunkkv import chunk_select

    score = np.array([0.9, 0.9, 0.1, 0.1, 0.5, 0.5, 0.5, 0.5, 0.2, 0.95])
    assert chunk_select(newest_first(score), 6, 4).tolist() == [0, 1, 2, 3, 8, 9]
    assert top_cells(newest_first(score), 6).tolist() == [0, 1, 4, 5, 6, 9]
    assert ref.chunk_decision(score, 6, 4) == [0, 1, 2, 3, 8, 9]
    # a partial chunk: its best cells; one chunk of everything: the per-cell choice
    assert chunk_select(newest_first(score), 7, 4).tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert chunk_select(newest_first(score), 5, 10).tolist() == [0, 1, 4, 5, 9]


def test_snapout_scores_and_kept_cells_equal_the_output_moves(
    history_model: Llama, tokens: list[int], states: list[ref.LayerStates]
) -> None:
    """Scores through each head's columns of Wo (the reference does not factorise it), and
    the kept cells by the plain sum over layers and heads (not min-max per head)."""
    cache, press = prefill(history_model, tokens, "snapout:0.25")  # 90 kept: sums matter
    kept = 90
    with pytest.raises(CallOrderError, match="bind"):
        press.compress(cache, 0)
    assert cache.positions(0) == list(range(T))  # refused before anything was evicted
    press.bind(history_model)
    wo = [layer.wo for layer in history_model.weights.layers]
    want = torch.stack([ref.snapout(st, w) for st, w in zip(states, wo, strict=True)])
    got = press.scores(press.scoring(cache, 0, kept))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    expect = ref.raw_decision(want, kept, 64)
    assert expect != ref.cell_decision(ref.cell_score(want), kept)  # the sum decides here
    assert press.compress(cache, 0) == T - kept
    assert cache.positions(0) == expect


def test_snapout_binds_a_model_or_refuses(history_model: Llama, tokens: list[int]) -> None:
    from dataclasses import replace

    from kvcache.errors import InvalidArgumentError
    from kvcache.press import Reconstruction
    from tiny_models import history_llama

    press = make_press("snapout:0.5")
    assert press.needs_model and not press.reconstructs
    with pytest.raises(InvalidArgumentError, match="output_projections"):
        press.bind(object())
    rec = Reconstruction(history_model, [1], [2])
    direct = make_press("snapout:0.5").bind(history_model).factors
    assert direct is not None and press.bind(rec).factors is not None
    for a, b in zip(press.factors, direct, strict=True):
        assert torch.equal(a, b)  # a Reconstruction's model, as the model itself
    three = history_llama(replace(history_model.config, num_layers=3), seed=0)
    cache, _ = prefill(history_model, tokens, "snapkv:0.5")
    wrong = make_press("snapout:0.5")
    with wrong.observe(cache):
        history_model.forward([5], Batch([T], [0]), cache)
    wrong.bind(three)
    with pytest.raises(InvalidArgumentError, match="3 layers"):
        wrong.compress(cache, 0)
    assert len(cache.positions(0)) == T + 1


def test_fast_output_moves_keep_their_digits_where_a_row_sits_on_one_cell() -> None:
    """snapout's distances through a matrix product, in float32, against the exact
    differences in float64: every row puts ~99.9 % of its attention on one cell, whose
    distance p / (1 - p) multiplies by ~1000 (the product form alone is off there)."""
    from kvcache.press.snapout import moved

    g = torch.Generator().manual_seed(0)
    v = torch.randn(2, 50, 16, generator=g) * 10  # [Hq, n, D]
    logits = torch.randn(2, 8, 50, generator=g)
    logits[:, :, 7] += 12.0
    p = torch.softmax(logits, dim=-1)  # [Hq, T, n]
    o = p @ v
    assert float(p[:, :, 7].min()) > 0.99
    want = moved(p.double(), o.double(), v.double())  # exact, float64
    got = moved(p, o, v, exact=False).double()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-5 * float(want.max()))

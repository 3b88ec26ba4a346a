"""benchmarks/press_bounds.py: the head-wise eviction simulation and the future oracles."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

import kv_quality as kq
import press_bounds as pb
from kvcache.models.llama import Llama

TOKENS = [(7 * i + 3) % 90 + 2 for i in range(120)]
PREFILL = 80


def test_the_simulation_without_a_press_is_the_cache(history_model: Llama) -> None:
    base, _, _ = pb.unpressed(history_model, TOKENS, PREFILL)
    c = history_model.config
    cache = kq.make_cache(history_model, "fp32", len(TOKENS))
    pb.PerHead(cache, c.num_layers, c.num_kv_heads, len(TOKENS))
    lp = pb.decode_logprobs(history_model, cache, TOKENS, PREFILL, lambda i: None)
    assert torch.allclose(lp, base, atol=1e-3, rtol=0)  # float32 K/V: kernel vs torch


def test_each_head_keeps_its_own_cells_and_sees_only_them(history_model: Llama) -> None:
    c = history_model.config
    cache = kq.make_cache(history_model, "fp32", len(TOKENS))
    sim = pb.PerHead(cache, c.num_layers, c.num_kv_heads, len(TOKENS))
    pb.decode_logprobs(history_model, cache, TOKENS[: PREFILL + 2], PREFILL, lambda i: None)
    n, keep = PREFILL + 1, 70
    sim.press(n, keep)
    kept = sim.valid[:, :, :n]
    assert (kept.sum(-1) == keep).all()  # exactly the budget, per layer and head
    assert kept[:, :, n - pb.WINDOW :].all()  # the observed window stays
    assert any(not torch.equal(kept[layer, 0], kept[layer, 1]) for layer in range(c.num_layers))
    # a next step attends, per head, to that head's cells only
    from kvcache import Batch

    cache.start_forward(Batch.single(0, n, 1))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, c.num_heads, c.head_dim, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 1, c.num_kv_heads, c.head_dim, generator=g, dtype=torch.float64)
    out = sim.attention(0, q, k, v)
    keys, values = (x.double() for x in cache.get(0)[:2])  # float32 codes
    group = c.num_heads // c.num_kv_heads
    for hq in range(c.num_heads):
        h = hq // group
        seen = torch.cat([kept[0, h], torch.tensor([True])])  # the new token is seen
        w = torch.softmax(keys[seen, h] @ q[0, hq] / c.head_dim**0.5, dim=0)
        assert torch.allclose(out[0, hq].double(), w @ values[seen, h], atol=1e-5)


def test_the_oracle_keeps_the_cell_the_next_queries_attend_to(history_model: Llama) -> None:
    cache = kq.make_cache(history_model, "fp32", len(TOKENS))
    pb.decode_logprobs(history_model, cache, TOKENS[:PREFILL], PREFILL, lambda i: None)
    n, target = PREFILL, 17
    future = {}
    for layer in cache.layers():
        k = cache.read(layer, torch.arange(n))[0]  # [n, Hkv, D]
        q = k[target].repeat_interleave(history_model.config.num_heads // k.shape[1], 0)
        future[layer] = (40 * q[None], np.array([n]))  # the query of position n, 1 row
    press = pb.FutureAttention(future, every=4)
    ctx = press.scoring(cache, 0, 2)
    assert list(press.select(ctx, 2)) == [target, n - 1]  # it, and the newest cell
    far = pb.FutureAttention({layer: (q, p + 10) for layer, (q, p) in future.items()}, every=4)
    assert target not in far.select(far.scoring(cache, 0, 2), 2)  # not within `every`: unseen


def test_the_head_oracle_keeps_each_heads_most_attended_cell(history_model: Llama) -> None:
    c = history_model.config
    cache = kq.make_cache(history_model, "fp32", len(TOKENS))
    n, every = PREFILL, 4
    pb.decode_logprobs(history_model, cache, TOKENS[:n], n, lambda i: None)
    group = c.num_heads // c.num_kv_heads
    future, want, decoyed = {}, {}, False
    for layer in cache.layers():
        k = cache.read(layer, torch.arange(n))[0].double()  # [n, Hkv, D]
        q = torch.stack([k[(11 * h + 5) % n, h] for h in range(c.num_kv_heads)])  # [Hkv, D]
        # the query of position n - 1 (already seen, not to come) aims elsewhere, harder
        decoy = 3 * torch.stack([k[(11 * h + 40) % n, h] for h in range(c.num_kv_heads)])
        rows = torch.stack([decoy, q]).repeat_interleave(group, 1).float()  # [2, Hq, D]
        future[layer] = (rows, np.array([n - 1, n]))
        want[layer] = torch.einsum("nhd,hd->hn", k, q).argmax(-1)  # per head: the top logit
        decoyed |= not torch.equal(torch.einsum("nhd,hd->hn", k, decoy).argmax(-1), want[layer])
    assert decoyed  # the decoy would change some head's choice
    sim = pb.PerHeadOracle(cache, c.num_layers, c.num_kv_heads, len(TOKENS), future, every)
    sim.press(n, 1)
    for layer in cache.layers():
        kept = sim.valid[layer, :, :n]
        assert (kept.sum(-1) == 1).all()
        assert torch.equal(kept.float().argmax(-1), want[layer])
    assert len({tuple(w.tolist()) for w in want.values()}) > 1  # heads and layers differ


def reference_costs(model: Llama, queries, kv, now: int, kind: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """future_costs at one press, query by query: [L, Hkv, N] float64."""
    c = model.config
    group, d = c.num_heads // c.num_kv_heads, c.head_dim
    out = torch.zeros(c.num_layers, c.num_kv_heads, len(TOKENS) - 1, dtype=torch.float64)
    for layer in range(c.num_layers):
        q, qpos = queries[layer]
        k, v = (x.double() for x in kv[layer])
        wo = model.weights.layers[layer].wo.double()
        for r, at in enumerate(qpos.tolist()):
            if at <= now:
                continue
            for hq in range(c.num_heads):
                h = hq // group
                p = torch.softmax(k[: at + 1, h] @ q[r, hq].double() / d**0.5, dim=0)
                if kind == "futureattn":
                    out[layer, h, : at + 1] += p
                    continue
                o = p @ v[: at + 1, h]
                w = wo[:, hq * d : (hq + 1) * d]
                for n in range(at + 1):
                    gap = torch.linalg.vector_norm(w @ (o - v[n, h]))
                    out[layer, h, n] += p[n] / (1 - p[n]).clamp_min(1e-6) * gap  # as documented
    return out


@pytest.mark.parametrize("kind", pb.FUTURE)
def test_future_costs_equal_a_query_by_query_reference(history_model: Llama, kind: str) -> None:
    _, queries, kv = pb.unpressed(history_model, TOKENS, PREFILL)
    nows = pb.press_times(PREFILL, len(TOKENS), 16)
    assert nows == [80, 96, 112]
    wo = [layer.wo for layer in history_model.weights.layers]
    costs = pb.future_costs(queries, kv, wo, nows, kind)
    assert costs.shape == (2, 3, history_model.config.num_kv_heads, len(TOKENS) - 1)
    for i in (0, 2):
        want = reference_costs(history_model, queries, kv, nows[i], kind)
        assert torch.allclose(costs[:, i], want, rtol=1e-9, atol=1e-12)
    assert (costs[:, 2, :, : nows[2] - 30] < costs[:, 0, :, : nows[2] - 30]).all()  # fewer to come


def future_presses(
    model: Llama,
    make: Callable[..., pb.PerHeadFuture],
    keeps: tuple[int, int],
    seed: int,
) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """Random costs [L, 2, Hkv, N], the two presses' newest positions and what each (layer,
    head) saw after each press of ``make`` (keeping ``keeps[i]`` cells at press i)."""
    c = model.config
    cache = kq.make_cache(model, "fp32", len(TOKENS))
    nows = [PREFILL, PREFILL + 16]
    g = torch.Generator().manual_seed(seed)
    costs = torch.rand(
        c.num_layers, 2, c.num_kv_heads, len(TOKENS), generator=g, dtype=torch.float64
    )
    sim = make(cache, c.num_layers, c.num_kv_heads, len(TOKENS), costs, nows)
    seen = []

    def after(i: int) -> None:
        if i in nows:
            sim.press(i + 1, keeps[nows.index(i)])
            seen.append(sim.valid[:, :, : i + 1].clone())

    pb.decode_logprobs(model, cache, TOKENS[: nows[1] + 2], PREFILL, after)
    return costs, nows, seen


def test_the_future_oracle_keeps_each_heads_costliest_cells(history_model: Llama) -> None:
    c = history_model.config
    first_keep, keep = 50, 30
    costs, nows, (first, second) = future_presses(
        history_model, pb.PerHeadFuture, (first_keep, keep), 3
    )
    for layer in range(c.num_layers):
        for h in range(c.num_kv_heads):
            want = torch.zeros(nows[0] + 1, dtype=torch.bool)
            want[costs[layer, 0, h, : nows[0] + 1].topk(first_keep).indices] = True
            assert torch.equal(first[layer, h], want)
            s = costs[layer, 1, h, : nows[1] + 1].clone()  # the second press's costs, among
            s[: nows[0] + 1][~first[layer, h]] = -1.0  # the cells still seen
            want = torch.zeros(nows[1] + 1, dtype=torch.bool)
            want[s.topk(keep).indices] = True
            assert torch.equal(second[layer, h], want)


@pytest.mark.parametrize("mode", ["headh2o", "headout"])
def test_the_causal_heads_keep_the_cells_worth_most_per_row(
    history_model: Llama, mode: str
) -> None:
    from kvcache import CausalCache

    c = history_model.config
    wo = [layer.wo for layer in history_model.weights.layers]
    cache = CausalCache(
        len(TOKENS), max_batch=PREFILL, shift=history_model.rope, dtype=torch.float64
    )
    shape = (cache, c.num_layers, c.num_kv_heads, len(TOKENS))
    sim = pb.PerHeadH2O(*shape) if mode == "headh2o" else pb.PerHeadOut(*shape, wo, c.head_dim)
    rows: dict[int, list[torch.Tensor]] = {}
    observed = sim.observed

    def spy(layer, q, p, seen, v):  # type: ignore[no-untyped-def]
        rows.setdefault(layer, []).append(q.clone())
        observed(layer, q, p, seen, v)

    sim.observed = spy  # type: ignore[method-assign]
    pb.decode_logprobs(history_model, cache, TOKENS, PREFILL, lambda i: None)
    n = len(TOKENS) - 1
    queries = {layer: (torch.cat(qs), np.arange(n)) for layer, qs in rows.items()}
    kv = {layer: cache.read(layer, slice(0, n)) for layer in cache.layers()}
    kind = {"headh2o": "futureattn", "headout": "futureout"}[mode]
    want = pb.future_costs(queries, kv, wo, [-1], kind)[:, 0]  # what every row paid, float64
    assert torch.allclose(sim.paid[:, :, :n], want, rtol=1e-7, atol=1e-12)
    keep = 70
    seen_by = (n - torch.arange(n)).double()  # position j is seen by the rows of j .. n - 1
    assert torch.equal(sim.rows[:, :, :n], seen_by.expand(c.num_layers, c.num_kv_heads, n))
    mean = sim.paid[:, :, :n] / seen_by
    sim.press(n, keep)
    for layer in range(c.num_layers):
        for h in range(c.num_kv_heads):
            s = mean[layer, h].clone()
            s[n - pb.WINDOW :] = float("inf")
            kept = torch.zeros(n, dtype=torch.bool)
            kept[s.topk(keep).indices] = True
            assert torch.equal(sim.valid[layer, h, :n], kept)
    assert not torch.equal(sim.valid[0, 0], sim.valid[1, 0])  # layers choose their own


def test_the_cell_oracle_keeps_the_cells_costliest_over_every_head(history_model: Llama) -> None:
    keeps = (70, 75)
    costs, nows, seen = future_presses(history_model, pb.CellFuture, keeps, 4)
    gone = None
    for i, (k, valid) in enumerate(zip(keeps, seen, strict=True)):
        n = nows[i] + 1
        s = costs[:, i, :, :n].sum(dim=(0, 1))
        s[n - pb.WINDOW :] = float("inf")
        if gone is not None:
            s[: len(gone)][gone] = -1.0  # gone stays gone
        want = torch.zeros(n, dtype=torch.bool)
        want[s.topk(k).indices] = True
        assert torch.equal(valid, want.expand_as(valid))  # one decision, every layer and head
        gone = ~want if gone is None else gone
    assert not seen[1][:, :, : nows[0] + 1][:, :, gone].any()  # none of the first press's gone


def reference_global(scores: torch.Tensor, keep: int, own: int) -> torch.Tensor:
    """global_keep one row at a time: each (layer, head)'s ``own`` best, then the best rows
    left anywhere until L * Hkv * keep are kept (-inf: gone, never kept)."""
    layers, heads, n = scores.shape
    kept = torch.zeros_like(scores, dtype=torch.bool)
    for layer in range(layers):
        for h in range(heads):
            order = sorted(range(n), key=lambda j: -float(scores[layer, h, j]))
            for j in order[:own]:
                kept[layer, h, j] = True
    left = [(float(scores[i]), i) for i in np.ndindex(*scores.shape) if not kept[i]]
    for value, i in sorted(left, reverse=True)[: (keep - own) * layers * heads]:
        assert value > -math.inf, "a gone row would be kept"
        kept[i] = True
    return kept


@pytest.mark.parametrize("floor", [0.0, 0.5, 1.0])
def test_the_global_budget_keeps_each_heads_floor_then_the_best_anywhere(
    history_model: Llama, floor: float
) -> None:
    keeps = (60, 66)
    costs, nows, seen = future_presses(
        history_model, lambda *a: pb.PerHeadFuture(*a, floor=floor), keeps, 5
    )
    c = history_model.config
    for i, (k, valid) in enumerate(zip(keeps, seen, strict=True)):
        n = nows[i] + 1
        s = costs[:, i, :, :n].clone()
        if i:  # gone at the first press stays gone
            s[:, :, : nows[0] + 1][~seen[0]] = -math.inf
        want = reference_global(s, k, int(floor * k))
        assert torch.equal(valid, want)
        assert int(valid.sum()) == k * c.num_layers * c.num_kv_heads  # the whole budget
        per_head = valid.sum(-1)
        assert (per_head >= int(floor * k)).all()
        if floor == 1.0:
            assert (per_head == k).all()  # PerHeadFuture's uniform shares
        else:
            assert per_head.min() < per_head.max()  # the budget moved between heads


@pytest.mark.parametrize("merge", [False, True])
def test_merged_rows_are_the_token_weighted_means_of_the_most_alike_rows(
    history_model: Llama, merge: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pb, "MERGE_COSINE", -1.0)  # every evicted row merges somewhere
    c, rope = history_model.config, history_model.rope
    cache = kq.make_cache(history_model, "fp32", len(TOKENS))
    sim = pb.CellMerge(cache, c.num_layers, c.num_kv_heads, len(TOKENS), rope, merge=merge)
    pb.decode_logprobs(history_model, cache, TOKENS[: PREFILL + 2], PREFILL, lambda i: None)
    n, keep = PREFILL + 1, 70
    before = [
        tuple(x.clone().double() for x in cache.read(layer, slice(0, n)))
        for layer in range(c.num_layers)
    ]
    sim.press(n, keep)
    kept = sim.valid[0, 0, :n]
    assert int(kept.sum()) == keep and kept[n - pb.WINDOW :].all()
    assert (sim.valid[:, :, :n] == kept).all()  # one decision, every layer and head
    pos = torch.arange(n)
    for layer in range(c.num_layers):
        k0, v0 = before[layer]
        pre = rope.rotate(k0, *rope.tables(-pos, k0.dtype))
        k1, v1 = (x.double() for x in cache.read(layer, slice(0, n)))
        for h in range(c.num_kv_heads):
            want_k, want_v, tokens = pre[:, h].clone(), v0[:, h].clone(), torch.ones(n)
            if merge:
                into: dict[int, list[int]] = {}
                for e in (~kept).nonzero()[:, 0].tolist():
                    cos = torch.nn.functional.cosine_similarity(
                        pre[kept, h], pre[e, h][None], dim=-1
                    )
                    into.setdefault(int(kept.nonzero()[cos.argmax(), 0]), []).append(e)
                for dst, src in into.items():
                    rows = [dst, *src]
                    want_k[dst], want_v[dst] = pre[rows, h].mean(0), v0[rows, h].mean(0)
                    tokens[dst] = len(rows)
            want_k = rope.rotate(want_k[:, None], *rope.tables(pos, k0.dtype))[:, 0]
            assert torch.allclose(k1[kept, h], want_k[kept], atol=1e-5)
            assert torch.allclose(v1[kept, h], want_v[kept], atol=1e-5)
            assert torch.equal(sim.tokens[layer, h, :n][kept], tokens[kept].float())
    # a next step's attention: each kept row's score plus the log of the tokens it holds
    from kvcache import Batch

    cache.start_forward(Batch.single(0, n, 1))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, c.num_heads, c.head_dim, generator=g)
    k, v = torch.randn(2, 1, c.num_kv_heads, c.head_dim, generator=g)
    out = sim.attention(0, q, k, v)
    keys, values = (x.double() for x in cache.get(0)[:2])
    seen = torch.cat([kept, torch.tensor([True])])
    bias = torch.cat([sim.tokens[0, 0, :n], torch.ones(1)]).double().log()[seen]
    w = torch.softmax(keys[seen, 0] @ q[0, 0].double() / c.head_dim**0.5 + bias, dim=0)
    assert torch.allclose(out[0, 0].double(), w @ values[seen, 0], atol=1e-5)
    assert bool((sim.tokens[0, 0] > 1).any()) == merge


def test_windows_pool_as_one_quality_over_all_their_scored_tokens() -> None:
    """``--windows``: each (mode, cap) pooled over windows equals ``kv_quality.quality`` over
    every window's scored tokens at once, against the unpressed runs pooled the same way."""
    vocab, scored = 40, kq.WINDOW - kq.PREFILL
    gen = torch.Generator().manual_seed(0)
    wins = [[int(t) for t in torch.randint(vocab, (kq.WINDOW,), generator=gen)] for _ in range(3)]

    def lps() -> list[torch.Tensor]:
        logits = [torch.randn(scored, vocab, generator=gen, dtype=torch.float64) for _ in wins]
        return [torch.log_softmax(x * (1 + i), -1) for i, x in enumerate(logits)]

    base, pressed = lps(), lps()
    rows = []
    for lp, b, win, held in zip(pressed, base, wins, (0.25, 0.3, 0.35), strict=True):
        q, ref = kq.quality([lp], [win], [b]), kq.quality([b], [win], [b])
        rows.append({"mode": "m", "cap": 0.25, "held": held, "held_union": None, **q})
        rows[-1].update(dppl_pct=100 * (q["ppl"] / ref["ppl"] - 1), base_ppl=ref["ppl"])
    got = pb.pooled(rows)
    want, unpressed = kq.quality(pressed, wins, base), kq.quality(base, wins, base)
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-12)
    assert got["kl"] == pytest.approx(want["kl"], rel=1e-12)
    assert got["top1"] == pytest.approx(want["top1"], rel=1e-12)
    assert got["dppl_pct"] == pytest.approx(100 * (want["ppl"] / unpressed["ppl"] - 1), rel=1e-9)
    assert got["base_ppl"] == pytest.approx(unpressed["ppl"], rel=1e-12)
    assert got["held"] == pytest.approx(0.3) and got["held_union"] is None
    assert got["window_dppl_pct"] == [r["dppl_pct"] for r in rows]

"""Bounds of decode-time pressing: would a better choice of cells reach ΔPPL <= 5 %
with the cache capped at 1/4 of the history?

The protocol of ``kv_quality.py --press-decode`` (SmolLM2-135M, fp32, 2048-token windows
of the Debian license texts: a 1024-token prompt, then 1024 tokens scored one decode step at a
time; every ``--every`` steps the cache goes back to CAP of the tokens seen), against the
unpressed cache. Twelve ways to choose what stays, each at every ``--caps`` value:

    snapkv    the library's press (``make_press("snapkv")``): one decision per cell, for all
              layers and heads, from the newest 64 queries
    oracle    one decision per cell, scored by the attention the next ``--every`` queries
              of the *unpressed* run pay each cell held now (summed over layers and query
              heads): a press that knew the queries to come
    perhead   every (layer, KV head) keeps its own CAP of the cells, by SnapKV's scores for
              that head over the cells it still sees (window 64, pooling 5): head-wise
              budgets at the same share per head. Simulated in plain torch, mask only: the
              cache keeps every cell (``held_union`` is the share of cells some head kept)
    headoracle  perhead's budgets, each (layer, KV head) choosing by the attention the next
              ``--every`` queries of the unpressed run pay each cell it still sees (softmax
              over those cells, summed over the head's query heads): the two bounds at once
    headh2o   perhead's budgets, each (layer, KV head) choosing causally by the mean
              attention each cell got from the queries that saw it so far (H2O's heavy
              hitters, as a mean), the newest 64 cells kept
    headout   the same, by how far each past query's output (through the output
              projection) would have moved were the cell alone gone: futureout's measure,
              causal
    futureattn  perhead's budgets, each (layer, KV head) choosing by the attention *every*
              query to come, to the end of the window, pays each cell in the unpressed run
              (``future_costs``): what a press that knew the whole future would keep
    futureout   the same, by how far each coming query's output (through the output
              projection) would move were the cell alone gone
    globalout futureout's costs with one budget for all (layer, KV head) pairs (AdaKV's
              allocation, with foresight): each pair keeps its best ``--floors`` share of
              the per-head budget, the rest of the L x Hkv x budget rows go to the largest
              costs anywhere (the costs compare across heads and layers: distances in the
              same residual stream); one row per floor
    cellout   futureout's costs, one decision per cell (what a cell cache can free): each
              cell's costs summed over layers and KV heads as they are (every head's output
              moves in the same residual stream), the newest 64 cells kept
    cellsnap  one decision per cell by the per-head SnapKV scores of ``perhead``, turned
              into cells as the library's presses do (min-max per layer and head over the
              cells still held, the mean): snapkv in this simulation
    cellmerge cellsnap's choice, each evicted cell merged, per (layer, KV head), into the
              kept cell whose key before RoPE is most alike (cosine >= MERGE_COSINE; D2O and
              CaM merge evicted tokens so): keys averaged before RoPE and rotated back to the
              kept cell's position, values averaged, each weighted by the tokens it holds,
              and a cell holding m tokens adds log m to its scores (what m alike keys get)

The oracles that see ``--every`` queries ahead do no better than snapkv; those that see the
whole future (``futureattn``, ``futureout``) come within the goal's reach: what a quarter of
the history must hold is what the queries far ahead will need, per head, and that is what a
causal press has to predict. ``cellout`` is the same foresight for a cell
cache (one decision per cell, the memory really freed): far above the goal at 1/4.
``globalout`` moves budget between heads with the same foresight: the more it moves, the
worse (equal budgets per head are best).

    python benchmarks/press_bounds.py                   # caps 0.25 0.5, every mode, ~1 h
    python benchmarks/press_bounds.py --quick           # cap 0.25, snapkv and perhead
    python benchmarks/press_bounds.py --caps 0.25 0.75 --modes snapkv oracle
    python benchmarks/press_bounds.py --modes futureout headout --caps 0.25 --windows 8

``--windows N`` runs windows 0..N-1 of the license texts (2,048 tokens each) and pools them
as ``kv_quality.py`` does (the mean log-perplexity, KL and top-1 over every scored token);
each row keeps every window's perplexity and ΔPPL.

Writes benchmarks/results/press_bounds.json and press_bounds.png (ΔPPL against the cap).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import kv_quality as kq
from common import license_tokens
from harness import plot, table, write_json
from kvcache import Batch, CausalCache
from kvcache.forward import ForwardPlan
from kvcache.models.llama import Llama
from kvcache.models.rope import Rope
from kvcache.press.base import Press, Scoring, aggregate, newest_first, top_cells
from kvcache.press.snapkv import KERNEL, WINDOW
from kvcache.press.snapout import moved, out_factor

MODES = (
    "snapkv",
    "oracle",
    "perhead",
    "headoracle",
    "headh2o",
    "headout",
    "futureattn",
    "futureout",
    "globalout",
    "cellout",
    "cellsnap",
    "cellmerge",
)
FUTURE = ("futureattn", "futureout")
MERGE_COSINE = 0.9  # cellmerge: keys less alike than this are not merged
Queries = dict[int, tuple[torch.Tensor, np.ndarray]]  # layer -> q [N, Hq, D], positions [N]
KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> k, v [N, Hkv, D] by position


def unpressed(model: Llama, tokens: list[int], prefill: int) -> tuple[torch.Tensor, Queries, KV]:
    """Log-probs [len - prefill, V] of the unpressed fp32 cache decoding ``tokens`` after
    ``prefill`` (one step a token), and every layer's queries and keys and values of the run."""
    cache = kq.make_cache(model, "fp32", len(tokens))
    seen: dict[int, list[tuple[torch.Tensor, np.ndarray]]] = {}

    def record(layer: int, q: torch.Tensor, plan: ForwardPlan) -> None:
        seen.setdefault(layer, []).append((q.float().clone(), plan.positions.copy()))

    cache.add_observer(record)
    lp = decode_logprobs(model, cache, tokens, prefill, lambda i: None)
    n = cache.next_position(0)
    kv = {layer: cache.read(layer, slice(0, n)) for layer in cache.layers()}  # cells = positions
    cache.close()
    queries = {
        layer: (torch.cat([q for q, _ in rows]), np.concatenate([p for _, p in rows]))
        for layer, rows in seen.items()
    }
    return lp, queries, kv


def decode_logprobs(model: Llama, cache: CausalCache, tokens: list[int], prefill: int, after):
    """The prompt, then one decode step a token with ``after(i)`` once token i is in."""
    batch = Batch.single(0, 0, prefill)
    out = [model.forward(tokens[:prefill], batch, cache, outputs=[prefill - 1])]
    for i in range(prefill, len(tokens) - 1):
        out.append(model.forward([tokens[i]], Batch.single(0, cache.next_position(0), 1), cache))
        after(i)
    return torch.log_softmax(torch.cat(out).double(), dim=-1)


def coming_attention(
    future: tuple[torch.Tensor, np.ndarray],
    keys: torch.Tensor,
    now: int,
    every: int,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention [Hkv, n] the queries of positions now + 1 .. now + ``every`` (one layer's
    of an unpressed run) pay each of ``keys`` [n, Hkv, D], summed over each KV head's query
    heads; the softmax over the cells ``seen`` [Hkv, n] by each head where given."""
    q, qpos = future
    q = q[torch.from_numpy((qpos > now) & (qpos <= now + every))]  # [w, Hq, D]
    (w, hq, d), hkv = q.shape, keys.shape[1]
    logits = torch.einsum("whgd,nhd->hgwn", q.view(w, hkv, hq // hkv, d), keys.to(q.dtype))
    logits = logits / math.sqrt(d)
    if seen is not None:
        logits = logits.masked_fill(~seen[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=(1, 2))


class FutureAttention(Press):
    """One decision per cell: the attention the queries of the next ``every`` positions (from
    an unpressed run) pay each cell, summed over layers and query heads."""

    name = "oracle"

    def __init__(self, queries: Queries, every: int) -> None:
        super().__init__(0.0)
        self.future, self.every = queries, every

    def scores(self, ctx: Scoring) -> torch.Tensor:
        now = int(ctx.pos.max())
        out = [
            coming_attention(self.future[layer], ctx.keys(layer), now, self.every)
            for layer in ctx.layers()
        ]
        return torch.stack(out)  # [L, Hkv, n]

    def select(self, ctx: Scoring, keep: int) -> np.ndarray:
        return top_cells(newest_first(self.scores(ctx).double().sum(dim=(0, 1)).numpy()), keep)


class PerHead:
    """Head-wise eviction, simulated: ``cache.attention`` replaced by a plain-torch attention
    that also masks, per (layer, KV head), the cells that head no longer sees."""

    def __init__(self, cache: CausalCache, layers: int, heads: int, cells: int) -> None:
        self.cache = cache
        self.valid = torch.ones(layers, heads, cells, dtype=torch.bool)  # [L, Hkv, N]
        self.q: dict[int, torch.Tensor] = {}  # layer -> the newest WINDOW queries
        cache.attention = self.attention  # type: ignore[method-assign]

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale=None
    ) -> torch.Tensor:
        keys, values, mask = self.cache.update(layer, k, v)  # [n, Hkv, D] x2, [T, n]
        (t, hq, d), (n, hkv, _) = q.shape, keys.shape
        seen = mask[:, None, :] & self.valid[layer][None, :, :n]  # [T, Hkv, n]
        qg = q.view(t, hkv, hq // hkv, d).to(keys.dtype)
        logits = torch.einsum("thgd,nhd->thgn", qg, keys) * (scale or d**-0.5)
        logits = logits + self.bias(layer, n)[None, :, None, :]
        p = torch.softmax(logits.masked_fill(~seen[:, :, None, :], float("-inf")), dim=-1)
        self.observed(layer, q, p, seen, values)
        return torch.einsum("thgn,nhd->thgd", p, values).reshape(t, hq, -1).to(q.dtype)

    def bias(self, layer: int, n: int) -> torch.Tensor:
        """What each head adds to its scores of the first ``n`` cells [Hkv, n]: nothing."""
        return torch.zeros(self.valid.shape[1], n)

    def observed(
        self, layer: int, q: torch.Tensor, p: torch.Tensor, seen: torch.Tensor, v: torch.Tensor
    ) -> None:
        """One attention call's queries [T, Hq, D], weights [T, Hkv, G, n], what each row
        and head saw [T, Hkv, n] and the values [n, Hkv, D]: the newest WINDOW queries are
        kept for ``scores``."""
        old = self.q.get(layer)
        self.q[layer] = (q if old is None else torch.cat([old, q]))[-WINDOW:]

    def scores(self, layer: int, n: int) -> torch.Tensor:
        """SnapKV's scores [Hkv, n] of each head over the cells it sees (the observed window's
        own cells: +inf, kept)."""
        keys = self.cache.read_keys(layer, slice(0, n))  # one sequence, cells = positions
        q = self.q[layer]
        (w, hq, d), hkv = q.shape, keys.shape[1]
        logits = torch.einsum("whgd,nhd->hgwn", q.view(w, hkv, hq // hkv, d).to(keys.dtype), keys)
        qpos = torch.arange(n - w, n)
        seen = (torch.arange(n)[None, :] <= qpos[:, None]) & self.valid[layer][:, None, :n]
        p = torch.softmax((logits / math.sqrt(d)).masked_fill(~seen[:, None], float("-inf")), -1)
        s = F.avg_pool1d(p.mean(dim=(1, 2))[:, None].float(), KERNEL, 1, KERNEL // 2)[:, 0]
        s[:, n - w :] = math.inf
        return s

    def press(self, n: int, keep: int) -> None:
        """Each (layer, head) keeps its ``keep`` best of the first ``n`` cells it still sees
        (gone stays gone, whatever ``scores`` says of it)."""
        assert np.array_equal(self.cache.cells_of(0), np.arange(n)), "cells are not positions"
        for layer in range(self.valid.shape[0]):
            s = self.scores(layer, n).masked_fill(~self.valid[layer, :, :n], -math.inf)
            best = s.topk(keep, dim=-1).indices  # [Hkv, keep]
            kept = torch.zeros_like(self.valid[layer, :, :n]).scatter_(-1, best, True)
            self.valid[layer, :, :n] &= kept


class PerHeadOracle(PerHead):
    """PerHead whose heads choose by the attention of the queries to come (coming_attention,
    one head's cells at a time)."""

    def __init__(
        self, cache: CausalCache, layers: int, heads: int, cells: int, future: Queries, every: int
    ) -> None:
        super().__init__(cache, layers, heads, cells)
        self.future, self.every = future, every

    def scores(self, layer: int, n: int) -> torch.Tensor:
        keys = self.cache.read_keys(layer, slice(0, n))  # [n, Hkv, D]
        seen = self.valid[layer][:, :n]
        return coming_attention(self.future[layer], keys, n - 1, self.every, seen)  # [Hkv, n]


class PerHeadH2O(PerHead):
    """PerHead whose heads choose causally, by the mean attention each cell got from the
    queries that saw it so far (H2O's accumulated attention over every query of the run,
    per (layer, KV head) and summed over its query heads, divided by the rows that saw the
    cell: old cells do not win by age); the newest ``WINDOW`` cells stay."""

    def __init__(self, cache: CausalCache, layers: int, heads: int, cells: int) -> None:
        super().__init__(cache, layers, heads, cells)
        self.paid = torch.zeros(layers, heads, cells, dtype=torch.float64)  # attention so far
        self.rows = torch.zeros(layers, heads, cells, dtype=torch.float64)  # rows that saw it

    def observed(
        self, layer: int, q: torch.Tensor, p: torch.Tensor, seen: torch.Tensor, v: torch.Tensor
    ) -> None:
        super().observed(layer, q, p, seen, v)
        n = p.shape[-1]
        self.paid[layer, :, :n] += self.worth(layer, p, v).sum(dim=(0, 2)).double()
        self.rows[layer, :, :n] += seen.sum(dim=0).double()

    def worth(self, layer: int, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """What each row's query head got from each cell [T, Hkv, G, n]: its attention."""
        return p

    def scores(self, layer: int, n: int) -> torch.Tensor:
        s = self.paid[layer, :, :n] / self.rows[layer, :, :n].clamp_min(1)
        s[:, max(0, n - WINDOW) :] = math.inf
        return s


class PerHeadOut(PerHeadH2O):
    """PerHeadH2O whose rows pay each cell, instead of their attention, how far their output
    would move were the cell alone gone (futureout's measure, over the queries so far):
    p / (1 - p) * |Wo_hq (o - v_n)| = p / (1 - p) * |R_hq (o - v_n)|, R_hq the [D, D] factor
    of Wo_hq = Q R (each cell's R v_n kept as it arrives). ``wo``: each layer's [E, Hq * D]."""

    def __init__(
        self,
        cache: CausalCache,
        layers: int,
        heads: int,
        cells: int,
        wo: list[torch.Tensor],
        head_dim: int,
    ) -> None:
        super().__init__(cache, layers, heads, cells)
        self.rt = [out_factor(w, head_dim) for w in wo]  # layer -> R^T [Hq, D, D]
        hq = wo[0].shape[1] // head_dim
        self.vr = torch.zeros(layers, hq, cells, head_dim, dtype=torch.float64)  # R_hq v_n
        self.done = [0] * layers  # cells whose R v_n is in vr, per layer

    def worth(self, layer: int, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        (t, hkv, g, n), rt, done = p.shape, self.rt[layer], self.done[layer]
        vq = v.double().repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, n, D]
        self.vr[layer, :, done:n] = vq[:, done:] @ rt
        self.done[layer] = n
        pd = p.double().reshape(t, hkv * g, n).transpose(0, 1)  # [Hq, T, n]
        return (
            moved(pd, (pd @ vq) @ rt, self.vr[layer, :, :n]).transpose(0, 1).reshape(t, hkv, g, n)
        )


def future_costs(
    queries: Queries, kv: KV, wo: list[torch.Tensor], nows: list[int], kind: str
) -> torch.Tensor:
    """What each cell is worth to every query to come of the unpressed run, per layer and
    KV head, at each press: [L, len(nows), Hkv, N] float64, entry [l, i, h, n] summed over
    the query rows of positions > nows[i] and over head h's query heads hq:

        futureattn   p(q, n)                                       the attention q pays n
        futureout    p(q, n) / (1 - p(q, n)) * |Wo_hq (o_q - v_n)|  how far q's output moves
                     (through its head's slice of the output projection) if n alone is gone

    p is the unpressed softmax (over the cells at positions <= q's), o_q = sum_n p(q, n) v_n,
    1 - p clamped at 1e-6 (a cell that holds all of q's attention).
    ``wo``: each layer's output projection [E, Hq * D]."""
    out = []
    for layer, (q, qpos) in sorted(queries.items()):
        k, v = (x.double() for x in kv[layer])  # [N, Hkv, D]
        (nq, hq, d), (n, hkv, _) = q.shape, k.shape
        g = hq // hkv
        qh = q.double().transpose(0, 1)  # [Hq, Nq, D]
        kh, vh = (x.transpose(0, 1).repeat_interleave(g, 0) for x in (k, v))  # [Hq, N, D]
        logits = qh @ kh.transpose(1, 2) / math.sqrt(d)
        seen = torch.from_numpy(qpos[:, None] >= np.arange(n)[None, :])  # [Nq, N]
        p = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)  # [Hq, Nq, N]
        cost = p
        if kind == "futureout":
            rt = out_factor(wo[layer], d)
            cost = moved(p, (p @ vh) @ rt, vh @ rt)
        cost = cost.view(hkv, g, nq, n).sum(1)  # [Hkv, Nq, N]
        after = torch.from_numpy(qpos[None, :] > np.asarray(nows)[:, None]).double()  # [P, Nq]
        out.append(torch.einsum("pq,hqn->phn", after, cost))
    return torch.stack(out)


class PerHeadFuture(PerHead):
    """PerHead whose heads choose by ``future_costs`` (every query to come, not a window):
    each (layer, KV head) keeps the cells its coming queries need most. ``floor`` < 1
    (``globalout``): one budget for every (layer, KV head), ``global_keep``."""

    def __init__(
        self,
        cache: CausalCache,
        layers: int,
        heads: int,
        cells: int,
        costs: torch.Tensor,
        nows: list[int],
        floor: float = 1.0,
    ) -> None:
        super().__init__(cache, layers, heads, cells)
        self.costs, self.press_of = costs, {now + 1: i for i, now in enumerate(nows)}
        self.now = 0  # the press under way (an index into nows)
        self.floor = floor

    def press(self, n: int, keep: int) -> None:
        self.now = self.press_of[n]
        if self.floor == 1.0:
            super().press(n, keep)
            return
        s = self.costs[:, self.now, :, :n].masked_fill(~self.valid[:, :, :n], -math.inf)
        self.valid[:, :, :n] &= global_keep(s, keep, self.floor)

    def scores(self, layer: int, n: int) -> torch.Tensor:
        return self.costs[layer, self.now, :, :n]


def global_keep(scores: torch.Tensor, keep: int, floor: float) -> torch.Tensor:
    """Which rows [L, Hkv, n] stay of ``scores`` [L, Hkv, n] (-inf: gone) when every (layer,
    head) keeps its best int(floor * keep) and the rest of L * Hkv * keep rows go to the
    largest scores left anywhere."""
    (layers, heads, _), own = scores.shape, int(floor * keep)
    kept = torch.zeros_like(scores, dtype=torch.bool)
    if own:
        kept.scatter_(-1, scores.topk(own, dim=-1).indices, True)
    rest = scores.masked_fill(kept, -math.inf).flatten()
    kept.view(-1)[rest.topk((keep - own) * layers * heads).indices] = True
    return kept


class CellFuture(PerHeadFuture):
    """PerHeadFuture's costs, one decision per cell: the cells with the largest costs summed
    over layers and heads (the newest ``WINDOW`` kept) stay in every layer and head."""

    def press(self, n: int, keep: int) -> None:
        self.now = self.press_of[n]
        cell = self.costs[:, self.now, :, :n].sum(dim=(0, 1))  # [n]
        cell[max(0, n - WINDOW) :] = math.inf
        cell[~self.valid[0, 0, :n]] = -math.inf  # gone stays gone
        kept = torch.zeros(n, dtype=torch.bool)
        kept[cell.topk(keep).indices] = True
        self.valid[:, :, :n] &= kept


class CellMerge(PerHead):
    """``cellsnap`` (``merge=False``) and ``cellmerge``: one decision per cell by SnapKV's
    per-head scores; with ``merge``, the evicted cells' K/V merged into alike kept cells."""

    def __init__(
        self, cache: CausalCache, layers: int, heads: int, cells: int, rope: Rope, merge: bool
    ) -> None:
        super().__init__(cache, layers, heads, cells)
        self.rope, self.merge = rope, merge
        self.tokens = torch.ones(layers, heads, cells)  # tokens each cell holds, per head

    def bias(self, layer: int, n: int) -> torch.Tensor:
        """A cell holding m tokens adds log m to each head's scores."""
        return self.tokens[layer, :, :n].log()

    def press(self, n: int, keep: int) -> None:
        assert np.array_equal(self.cache.cells_of(0), np.arange(n)), "cells are not positions"
        held = self.valid[0, 0, :n].nonzero()[:, 0]  # one decision per cell: any head's
        s = torch.stack([self.scores(layer, n) for layer in range(self.valid.shape[0])])
        window = torch.isinf(s[:, :, held]).all(dim=0).all(dim=0)  # the observation window
        score = newest_first(aggregate(s[:, :, held].masked_fill(window, 0.0)))
        score[window.numpy()] = np.inf  # kept, as the press keeps its window's cells
        kept = torch.zeros(n, dtype=torch.bool)
        kept[held[torch.from_numpy(top_cells(score, keep))]] = True
        gone = self.valid[0, 0, :n] & ~kept
        if self.merge and bool(gone.any()):
            for layer in range(self.valid.shape[0]):
                self.merge_into(layer, n, gone.nonzero()[:, 0], kept.nonzero()[:, 0])
        self.valid[:, :, :n] &= kept

    def merge_into(self, layer: int, n: int, gone: torch.Tensor, kept: torch.Tensor) -> None:
        """Each head's rows of ``gone`` cells averaged into its most alike ``kept`` cell."""
        keys, values = self.cache.read(layer, slice(0, n))  # views of the fp32 storage
        pos = torch.arange(n)
        pre = self.rope.rotate(keys, *self.rope.tables(-pos, keys.dtype))  # before RoPE
        unit = pre / pre.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        cosine, into = torch.einsum("ehd,khd->hek", unit[gone], unit[kept]).max(dim=-1)
        for h in range(keys.shape[1]):
            alike = cosine[h] >= MERGE_COSINE
            src, dst = gone[alike], kept[into[h][alike]]
            if len(src) == 0:
                continue
            w = self.tokens[layer, h, :n]
            total = w.clone().index_add_(0, dst, w[src])
            for rows, rotate in ((pre[:, h], True), (values[:, h], False)):
                summed = (rows * w[:, None]).index_add_(0, dst, rows[src] * w[src][:, None])
                mean = summed[dst] / total[dst][:, None]
                if rotate:  # back to the kept cell's position
                    mean = self.rope.rotate(mean[:, None], *self.rope.tables(dst, mean.dtype))[:, 0]
                    keys[dst, h] = mean
                else:
                    values[dst, h] = mean
            self.tokens[layer, h, :n] = total


def press_times(prefill: int, total: int, every: int) -> list[int]:
    """The newest position at each press of ``decode_logprobs``' steps (after token i is in,
    i = prefill, prefill + every, ...)."""
    return list(range(prefill, total - 1, every))


def per_head(
    model: Llama,
    tokens: list[int],
    prefill: int,
    cap: float,
    every: int,
    make: Callable[[CausalCache, int, int, int], PerHead] = PerHead,
) -> tuple[torch.Tensor, float, float]:
    """Log-probs under head-wise eviction (the simulation ``make(cache, layers, heads,
    cells)`` chooses), the mean share each head saw and the mean share of cells some head
    still saw (what a mask-only cache would have to hold)."""
    c = model.config
    cache = kq.make_cache(model, "fp32", len(tokens))
    sim = make(cache, c.num_layers, c.num_kv_heads, len(tokens))
    times = set(press_times(prefill, len(tokens), every))
    shares: list[tuple[float, float]] = []

    def after(i: int) -> None:
        if i in times:
            sim.press(i + 1, int(cap * (i + 1)))
        seen = sim.valid[:, :, : i + 1]
        shares.append(
            (float(seen.float().mean()), float(seen.any(dim=1).any(dim=0).float().mean()))
        )

    lp = decode_logprobs(model, cache, tokens, prefill, after)
    cache.close()
    head, union = np.mean(shares, axis=0)
    return lp, float(head), float(union)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="cap 0.25, snapkv and perhead")
    parser.add_argument("--caps", type=float, nargs="+", help="cells kept / tokens seen")
    parser.add_argument("--modes", nargs="+", choices=MODES, help=f"{' '.join(MODES)}")
    parser.add_argument("--every", type=int, default=16, help="decode steps between presses")
    parser.add_argument(
        "--floors",
        type=float,
        nargs="+",
        default=[0.0, 0.5, 0.8],
        help="globalout: each head's own share of its budget, one row each",
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=1,
        help="2048-token windows of the license texts (default 1: window 0), pooled as "
        "kv_quality.py pools them",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="press_bounds", help="results name (.json, .png)")
    args = parser.parse_args(argv)
    args.caps = args.caps or ([0.25] if args.quick else [0.25, 0.5])
    args.modes = args.modes or (["snapkv", "perhead"] if args.quick else list(MODES))
    if not all(0 < c < 1 for c in args.caps):
        parser.error(f"--caps {args.caps}: fractions in (0, 1)")
    if not all(0 <= f <= 1 for f in args.floors):
        parser.error(f"--floors {args.floors}: fractions in [0, 1]")
    if args.windows < 1:
        parser.error(f"--windows {args.windows}: expected at least 1")
    torch.set_num_threads(args.threads)
    from kvcache.text.tokenizer import Tokenizer

    model = Llama.from_gguf(weights="fp32")
    tokens = license_tokens(Tokenizer.from_gguf(), args.windows * kq.WINDOW)
    per_window = []  # [window][run]: each window's rows, in the same order
    with torch.inference_mode():
        for w in range(args.windows):
            win = tokens[w * kq.WINDOW : (w + 1) * kq.WINDOW]
            per_window.append(window_rows(model, win, args))
    rows = [pooled([r[i] for r in per_window]) for i in range(len(per_window[0]))]
    ppl = rows[0]["base_ppl"]
    print(f"\nunpressed fp32 PPL {ppl:.3f} ({args.windows} windows)\n{table(rows, COLS)}")
    write_json(args.json, {"ppl": ppl, "every": args.every, "windows": args.windows, "rows": rows})
    plot(args.json, lambda fig, ax: draw(ax, rows, args.windows), figsize=(7, 4.5))
    return 0


COLS = ["mode", "cap", "held", "held_union", "ppl", "kl", "top1", "dppl_pct"]


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One (mode, cap) over every window: kq.quality's pooling (each window scores the same
    count of tokens, so the mean log-perplexity, KL and top-1), each window's perplexity kept."""
    first = rows[0]
    mean = {k: statistics.fmean(r[k] for r in rows) for k in ("held", "kl", "top1")}
    unions = [r["held_union"] for r in rows]
    log_ppl = statistics.fmean(math.log(r["ppl"]) for r in rows)
    base = statistics.fmean(math.log(r["base_ppl"]) for r in rows)
    return {
        "mode": first["mode"],
        "cap": first["cap"],
        **mean,
        "held_union": None if None in unions else statistics.fmean(unions),
        "ppl": math.exp(log_ppl),
        "base_ppl": math.exp(base),  # the unpressed runs', pooled the same way
        "dppl_pct": 100 * (math.exp(log_ppl - base) - 1),
        "window_ppl": [r["ppl"] for r in rows],
        "window_dppl_pct": [r["dppl_pct"] for r in rows],
    }


def window_rows(model: Llama, tokens: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (cap, mode) of one window, against its unpressed cache."""
    from kvcache.press import make_press

    rows: list[dict[str, Any]] = []
    base, queries, kv = unpressed(model, tokens, kq.PREFILL)
    ppl = kq.quality([base], [tokens], [base])["ppl"]
    nows = press_times(kq.PREFILL, len(tokens), args.every)
    wo = [layer.wo for layer in model.weights.layers]
    with_out = {"cellout", "globalout"} & set(args.modes)
    need = set(args.modes) | ({"futureout"} if with_out else set())
    costs = {m: future_costs(queries, kv, wo, nows, m) for m in FUTURE if m in need}
    sims: dict[str, Callable[..., PerHead]] = {
        "perhead": PerHead,
        "headh2o": PerHeadH2O,
        "headout": lambda *a: PerHeadOut(*a, wo, model.config.head_dim),
        "headoracle": lambda *a: PerHeadOracle(*a, queries, args.every),
        **{m: (lambda *a, c=c: PerHeadFuture(*a, c, nows)) for m, c in costs.items()},
    }
    if "cellout" in args.modes:
        sims["cellout"] = lambda *a: CellFuture(*a, costs["futureout"], nows)
    sims["cellsnap"] = lambda *a: CellMerge(*a, model.rope, merge=False)
    sims["cellmerge"] = lambda *a: CellMerge(*a, model.rope, merge=True)
    runs = []  # the rows' modes: globalout once per floor
    for mode in args.modes:
        if mode != "globalout":
            runs.append(mode)
            continue
        for f in args.floors:
            runs.append(f"globalout:{f:g}")
            sims[runs[-1]] = lambda *a, f=f: PerHeadFuture(*a, costs["futureout"], nows, f)
    for cap in args.caps:
        for mode in tqdm(runs, desc=f"cap {cap:g}", unit="mode"):
            union = None
            if mode in sims:
                lp, held, union = per_head(model, tokens, kq.PREFILL, cap, args.every, sims[mode])
            else:
                press = make_press("snapkv:0.5") if mode == "snapkv" else None  # ratio unused
                press = press or FutureAttention(queries, args.every)
                lp, held, _ = kq.pressed_logprobs(model, "fp32", tokens, press, cap, args.every)
            q = kq.quality([lp], [tokens], [base])
            rows.append({"mode": mode, "cap": cap, "held": held, "held_union": union, **q})
            rows[-1].update(dppl_pct=100 * (q["ppl"] / ppl - 1), base_ppl=ppl)
            print(table(rows[-1:], COLS), flush=True)
    return rows


def draw(ax: Any, rows: list[dict[str, Any]], windows: int = 1) -> None:
    """ΔPPL against the cap, a line per mode, the goal as a line."""
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["cap"], r["dppl_pct"]) for r in rows if r["mode"] == mode)
        ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
    ax.axhline(kq.DECODE_PRESS_GOAL, color="black", ls="--", lw=1, label="goal (at 1/4)")
    ax.set(
        xlabel="cells kept / tokens seen",
        ylabel="ΔPPL % vs the unpressed cache",
        title="SmolLM2-135M, decode-time pressing: the press's choice against the budget"
        + (f"\n(license texts, {windows} windows of 2,048 tokens, pooled)" if windows > 1 else ""),
    )
    ax.grid(alpha=0.3)
    ax.legend()


if __name__ == "__main__":
    sys.exit(main())

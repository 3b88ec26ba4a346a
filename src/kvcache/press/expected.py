"""Expected attention (kvpress's ``ExpectedAttentionPress``, Devoto et al., 2025): score
each cell by the attention that *future* queries are expected to pay it.

Future queries are modelled as Gaussian: mean mu and covariance S of the observed queries
(the newest ``rows`` of the sequence, un-rotated to their pre-RoPE form through the cache's
shift; kvpress takes every prompt query, the issue asks for recent ones), moved to the next
``future`` positions by the average RoPE rotation R over them. For a key k (rotated, as
stored) the expected logit is E[q.k] / sqrt(D) + k^T S' k / (2 D), the second term the
Gaussian's log-mean-exp correction; per query head::

    mu' = R mu,  S' = R S R^T          R = mean over p in [next, next + future) of RoPE(p)
    score[h, n] = softmax_n(mu'_h . k_n / sqrt(D) + k_n^T S'_h k_n / (2 D))
    scores      = mean over the group's query heads * ||v_n||   (value norm, ``vnorm``)

The first ``sinks`` cells score the maximum (kept), and their queries are left out of the
statistics, as kvpress does.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcache.press.base import Press, Scoring
from kvcache.protocol import RotaryShift

ROWS = 64
FUTURE = 512
SINKS = 4


class ExpectedAttention(Press):
    """Keeps the cells expected future queries attend to most (times their value norm)."""

    name = "expected"

    def __init__(
        self,
        ratio: float,
        compact: bool = False,
        rows: int = ROWS,
        future: int = FUTURE,
        sinks: int = SINKS,
        cov: bool = True,
        vnorm: bool = True,
    ) -> None:
        super().__init__(ratio, compact)
        self.query_rows = rows
        self.future, self.sinks, self.cov, self.vnorm = future, sinks, cov, vnorm

    def scores(self, ctx: Scoring) -> torch.Tensor:
        return torch.stack([self._layer(ctx, layer) for layer in ctx.layers()])

    def _layer(self, ctx: Scoring, layer: int) -> torch.Tensor:
        k = ctx.keys(layer)  # [n, Hkv, D]
        n, hkv, d = k.shape
        mu, s = self._statistics(ctx, layer)  # [Hq, D], [Hq, D, D] float64
        mu, s = mu.to(k.dtype), s.to(k.dtype)  # scored in the keys' precision (ranking only)
        group = mu.shape[0] // hkv
        kq = k.repeat_interleave(group, dim=1)  # [n, Hq, D]
        logits = torch.einsum("hd,nhd->hn", mu, kq) / math.sqrt(d)  # [Hq, n]
        if self.cov:
            logits = logits + torch.einsum("nhi,hij,nhj->hn", kq, s, kq) / (2 * d)
        tail = torch.from_numpy(np.arange(n) >= self.sinks)
        probs = torch.softmax(logits[:, tail], dim=-1)  # [Hq, n - sinks]
        out = probs.view(hkv, group, -1).mean(dim=1)  # [Hkv, n - sinks]
        if self.vnorm:
            out = out * ctx.values(layer)[tail].norm(dim=-1).T
        full = torch.empty((hkv, n), dtype=out.dtype)
        full[:, tail] = out
        full[:, ~tail] = out.max() if out.numel() else 1.0
        return full

    def _statistics(self, ctx: Scoring, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """mu' [Hq, D] and S' [Hq, D, D] (float64) of the future queries."""
        q, qpos = ctx.queries(layer)  # [w, Hq, D] rotated
        use = np.searchsorted(ctx.pos, qpos) >= self.sinks  # rows of sink tokens are left out
        if use.any():
            q, qpos = q[torch.from_numpy(use)], qpos[use]
        shift = ctx.cache.shift
        assert shift is not None, "expected attention needs the cache's RoPE shift"
        q0 = shift(layer, q.double(), torch.from_numpy(-qpos)).double()  # [w, Hq, D] pre-RoPE
        mu = q0.mean(dim=0)  # [Hq, D]
        centred = (q0 - mu).transpose(0, 1)  # [Hq, w, D]
        s = centred.transpose(1, 2) @ centred / max(len(qpos), 1)  # [Hq, D, D]
        key = ("rotation", None if isinstance(ctx.cache.shift, RotaryShift) else layer)
        r = ctx.memo.get(key)  # a rotary shift is the same in every layer: built once
        if r is None:
            r = ctx.memo[key] = self._mean_rotation(ctx, layer, q.shape[2])  # [D, D]
        return mu @ r.T, r @ s @ r.T

    def _mean_rotation(self, ctx: Scoring, layer: int, d: int) -> torch.Tensor:
        """R [D, D]: the mean RoPE rotation over the next ``future`` positions."""
        shift = ctx.cache.shift
        assert shift is not None
        start = ctx.cache.next_position(ctx.seq)
        p = torch.arange(start, start + self.future).repeat_interleave(d)  # [F * D]
        basis = torch.eye(d, dtype=torch.float64).repeat(self.future, 1)[:, None, :]  # [F*D, 1, D]
        cols = shift(layer, basis, p).view(self.future, d, d)  # [F, i, :] = R_p e_i
        return cols.mean(dim=0).T  # R[:, i] = mean_p R_p e_i

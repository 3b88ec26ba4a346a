"""SnapKV (Li et al., 2024) and the window attention it shares with TOVA.

The newest ``window`` query rows of the prompt (the observation window) attend, causally,
over the sequence's cells; each cell's score is that attention averaged over the window's
rows, smoothed along positions by an average pool of ``kernel`` cells (zero padded), and
averaged over the query heads of its KV group, per layer and KV head (kvpress's
``SnapKVPress``; "summed" in the paper, the same ranking). The window's own cells score the
maximum, so they are kept::

    attn    [Hq, w, n]   softmax(q_w . k / sqrt(D)), k at positions <= the row's
    scores  [Hkv, n]     mean over w -> avg_pool1d(kernel) over the prompt cells
                         -> mean over the group's query heads; window cells = max
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kvcache.press.base import Press, Scoring

WINDOW = 64
KERNEL = 5


def window_attention(ctx: Scoring, layer: int) -> tuple[torch.Tensor, np.ndarray]:
    """attn [Hq, w, n] of the observed rows over the cells, and the window mask [n] (cells
    that hold the observed rows' own tokens)."""
    q, qpos = ctx.queries(layer)  # [w, Hq, D], [w]
    k = ctx.keys(layer)  # [n, Hkv, D]
    (w, hq, d), hkv = q.shape, k.shape[1]
    qg = q.reshape(w, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)  # [Hkv, G*w, D]
    logits = (qg @ k.permute(1, 2, 0)).view(hq, w, -1) / math.sqrt(d)  # [Hq, w, n]
    # every row sees the cells before its oldest row's position: only the tail is masked
    tail = int(np.searchsorted(ctx.pos, qpos.min(), side="right")) if w else len(ctx.pos)
    later = torch.from_numpy(ctx.pos[None, tail:] > qpos[:, None])  # [w, n - tail]
    logits[:, :, tail:].masked_fill_(later, float("-inf"))
    return torch.softmax(logits, dim=-1), np.isin(ctx.pos, qpos)


def observed_cells(ctx: Scoring, layer: int) -> np.ndarray:
    """The cells kept as the window's own [n] (bool): those holding the observed rows'
    tokens, or none when they alone would fill the budget (then every cell is scored)."""
    window = np.isin(ctx.pos, ctx.queries(layer)[1])
    return window if window.sum() < ctx.keep else np.zeros_like(window)


class SnapKV(Press):
    """Keeps the cells the observation window attends to most (pooled)."""

    name = "snapkv"

    def __init__(
        self, ratio: float, compact: bool = False, window: int = WINDOW, kernel: int = KERNEL
    ) -> None:
        super().__init__(ratio, compact)
        self.query_rows = window
        self.kernel = kernel

    def scores(self, ctx: Scoring) -> torch.Tensor:
        return torch.stack([self._layer(ctx, layer) for layer in ctx.layers()])

    def _layer(self, ctx: Scoring, layer: int) -> torch.Tensor:
        attn, _ = window_attention(ctx, layer)  # [Hq, w, n]
        hkv = ctx.keys(layer).shape[1]
        window = observed_cells(ctx, layer)  # [n]
        prompt = torch.from_numpy(~window)
        s = attn.mean(dim=1)[:, prompt]  # [Hq, m]
        s = F.avg_pool1d(s[:, None, :], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        s = s.view(hkv, -1, s.shape[-1]).mean(dim=1)  # [Hkv, m]
        out = torch.empty((hkv, len(window)), dtype=s.dtype)  # [Hkv, n]
        out[:, prompt] = s
        out[:, ~prompt] = s.max() if s.numel() else 1.0
        return out

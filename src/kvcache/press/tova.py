"""TOVA (Oren et al., 2024): keep the cells the newest query attends to, over all heads.

The last query row's attention over the sequence's cells, averaged over every query head
(one ranking for all KV heads, as kvpress's ``TOVAPress``); the newest cell itself scores
the maximum. Applied during decode (``during_decode``), this is TOVA's policy: the newest
token's attention decides which cells stay.
"""

from __future__ import annotations

import torch

from kvcache.press.base import Press, Scoring
from kvcache.press.snapkv import window_attention


class TOVA(Press):
    """Keeps the cells the newest query attends to most (mean over all query heads)."""

    name = "tova"
    query_rows = 1

    def scores(self, ctx: Scoring) -> torch.Tensor:
        return torch.stack([self._layer(ctx, layer) for layer in ctx.layers()])

    def _layer(self, ctx: Scoring, layer: int) -> torch.Tensor:
        attn, window = window_attention(ctx, layer)  # [Hq, 1, n], [n]
        hkv = ctx.keys(layer).shape[1]
        s = attn.mean(dim=(0, 1))  # [n]
        top = s[torch.from_numpy(~window)].max() if (~window).any() else s.max()
        s = torch.where(torch.from_numpy(window), top, s)
        return s[None, :].expand(hkv, -1)  # [Hkv, n]

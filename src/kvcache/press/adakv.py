"""AdaKV (Feng et al., 2024): head-adaptive budgets, as kvpress's ``AdaKVPress``, mapped onto
cells.

In kvpress, per layer, the inner press's scores [Hkv, n] compete across heads: each head
first protects its ``alpha`` * kept best cells, then the layer prunes the Hkv * (n - kept)
lowest (head, cell) scores over all heads together, so a head with peaked scores keeps
few cells and a diffuse one many (same total as a per-head budget).

Cells are shared by every layer and head, so a cell here is one decision: each (layer, head)
that AdaKV's rule keeps a cell is a vote for it, and the ``kept`` cells with the most votes
stay (ties: the inner press's cell score of ``base.py``, then the earlier position). The
count matches the target exactly and nothing per layer or head is stored, so the cache's
contract (masks, remove, copy_prefix, can_resume) is untouched::

    selected [L, Hkv, n]   AdaKV's per-layer choice over (head, cell) pairs
    votes    [n]           selected.sum over layers and heads
    kept                   the newest cell, then top of (votes, inner cell score)
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.press.base import Press, Scoring, Wrapper, aggregate, newest_first

ALPHA = 0.2  # kvpress's alpha_safeguard


class AdaKV(Wrapper):
    """Head-adaptive selection over an inner press's scores (default SnapKV)."""

    name = "adakv"

    def __init__(
        self, ratio: float, compact: bool = False, inner: Press | None = None, alpha: float = ALPHA
    ) -> None:
        from kvcache.press.snapkv import SnapKV

        super().__init__(ratio, compact, inner if inner is not None else SnapKV(ratio))
        self.alpha = alpha

    def select(self, ctx: Scoring, keep: int) -> np.ndarray:
        scores = self.scores(ctx)  # [L, Hkv, n]
        votes = newest_first(selected(scores, keep, self.alpha).sum(dim=(0, 1)).numpy())  # [n]
        order = np.lexsort((np.arange(len(votes)), -aggregate(scores), -votes))
        return np.sort(order[:keep])


def selected(scores: torch.Tensor, keep: int, alpha: float) -> torch.Tensor:
    """AdaKV's kept (head, cell) pairs of each layer: bool [L, Hkv, n]."""
    layers, heads, n = scores.shape
    s = scores.double().clone()
    safe = int(keep * alpha)
    if safe:
        top = s.topk(safe, dim=-1).indices  # [L, Hkv, safe]
        s.scatter_(-1, top, torch.finfo(torch.float64).max)
    flat = s.reshape(layers, heads * n)
    pruned = flat.topk(heads * (n - keep), dim=-1, largest=False).indices  # [L, H * (n - keep)]
    out = torch.ones_like(flat, dtype=torch.bool)
    out.scatter_(-1, pruned, False)
    return out.view(layers, heads, n)

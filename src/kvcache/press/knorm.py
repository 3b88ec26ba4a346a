"""Key norm (kvpress's ``KnormPress``, after Devoto et al., 2024): keep the keys with the
lowest L2 norm, which draw the most attention. Query-agnostic: scores = -||k|| per layer
and KV head (RoPE keeps norms, so rotated or not is the same)."""

from __future__ import annotations

import torch

from kvcache.press.base import Press, Scoring


class KeyNorm(Press):
    """Keeps the cells whose keys have the lowest norm."""

    name = "knorm"

    def scores(self, ctx: Scoring) -> torch.Tensor:
        return torch.stack([-ctx.keys(layer).norm(dim=-1).T for layer in ctx.layers()])

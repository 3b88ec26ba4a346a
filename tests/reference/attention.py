"""Attention as its definition says, in float64: the reference for ``CausalCache.attention``."""

from __future__ import annotations

import torch


def softmax_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, groups: int
) -> torch.Tensor:
    """q [T, Hq, D] over keys / values [n, H, D], row i over the tokens ``visible[i]`` [T, n]
    only: out [T, Hq, D]; query head hq reads KV head hq // groups; scale 1/sqrt(D)."""
    k = keys.repeat_interleave(groups, dim=1)  # [n, Hq, D]
    v = values.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,nhd->thn", q, k) / q.shape[-1] ** 0.5  # [T, Hq, n]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    # (not torch.softmax: ~15 ms a call on tiny tensors when the cores are busy)
    return torch.einsum("thn,nhd->thd", weights / weights.sum(dim=-1, keepdim=True), v)

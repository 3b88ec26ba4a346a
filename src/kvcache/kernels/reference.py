"""Grouped-query attention in plain torch: the reference the kernels are tested against, and
the one attention every model calls where no cache reads for it (a full forward, Whisper's
encoder and cross-attention).

    q [T, Hq, D], k / v [L, Hkv, D] (query head hq reads KV head hq // G, HuggingFace's
    ``repeat_kv`` order), mask [T, L] bool (True = may attend) or None  ->  [T, Hq, Dv]

Computed in the inputs' dtype (pass float64 for an exact reference); a row that may attend
to nothing gives zeros (softmax over an empty set), as the kernels do.
"""

from __future__ import annotations

import math

import torch


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with query heads grouped over KV heads (see above)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = 1.0 / math.sqrt(d) if scale is None else scale
    # qg: [Hkv, T*G, D]; scores [Hkv, T*G, L]
    qg = q.reshape(t, hkv, g, d).transpose(0, 1).reshape(hkv, t * g, d)
    scores = torch.bmm(qg, k.permute(1, 2, 0)) * s
    if mask is not None:
        keep = mask.repeat_interleave(g, dim=0)  # [T*G, L], row t*G + j
        scores = scores.masked_fill(~keep, float("-inf"))
        empty = ~keep.any(dim=1)  # [T*G]
        scores = scores.masked_fill(empty[None, :, None], 0.0)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(empty[None, :, None], 0.0)
    out = torch.bmm(probs, v.transpose(0, 1))  # [Hkv, T*G, Dv]
    return out.view(hkv, t, g, -1).transpose(0, 1).reshape(t, hq, -1)

"""Attention without a mask over dense windows of keys and values (Whisper's cross-attention).

    q [T, H, D], keys / values [A, H, S, D], windows[t] = the window row t reads -> [T, H, D]

Float32 on the CPU with D a multiple of 8 runs the C++ kernel (``csrc/dense.cpp``: the rows
reading a window share one pass over its keys and one over its values); anything else runs
:func:`reference`, plain torch matmuls grouped by window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.kernels.build import extension


def served(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether ``dense_attention(q, keys, ...)`` runs the kernel."""
    return (
        q.dtype == torch.float32
        and keys.dtype == torch.float32
        and q.device.type == "cpu"
        and keys.device.type == "cpu"
        and q.shape[-1] % 8 == 0
        and keys.shape[2] > 0
        and not torch.is_grad_enabled()
    )


def dense_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    windows: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Each row of ``q`` [T, H, D] over all S rows of its window: out [T, H, D]."""
    if not served(q, keys):
        return reference(q, keys, values, windows, scale)
    w = torch.as_tensor(windows, dtype=torch.int64)
    return extension().dense_attention(
        q.contiguous(), keys.contiguous(), values.contiguous(), w, float(scale)
    )


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    windows: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Plain torch: the rows of each window in one batched matmul over its heads."""
    out = torch.empty_like(q)
    for a in sorted(set(windows)):
        rows = torch.tensor([i for i, x in enumerate(windows) if x == a])
        qa = q[rows].transpose(0, 1)  # [H, r, D]
        att = (torch.bmm(qa, keys[a].transpose(1, 2)) * scale).softmax(-1)  # [H, r, S]
        out[rows] = torch.bmm(att, values[a]).transpose(0, 1)
    return out

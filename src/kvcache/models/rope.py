"""Rotary position embedding (RoPE), written once: for attention and as the cache's ``shift``.

Layout: a head vector ``x: [D]`` is rotated in rotate-half pairs ``(x[i], x[i + D/2])`` by the
angle ``position * inv_freq[i]`` (HuggingFace Llama's layout). A rotation by ``a`` followed by one
by ``b`` is a rotation by ``a + b``, so keys stored after RoPE move to a new position by rotating
them by the offset alone: that is :meth:`Rope.shift`, the function a
:class:`~kvcache.CausalCache` calls when ``remove`` closes a gap in the middle of a sequence.
"""

from __future__ import annotations

import torch

from kvcache.errors import InvalidArgumentError
from kvcache.kernels.rows import rope


class Rope:
    """Rotary embedding of one model: frequencies from ``theta`` and ``head_dim``."""

    def __init__(self, head_dim: int, theta: float) -> None:
        if head_dim % 2:
            raise InvalidArgumentError("head_dim", head_dim, "an even int (RoPE rotates pairs)")
        self.head_dim = head_dim
        self.theta = float(theta)
        # inv_freq: [D/2], float32 exactly as HF computes it; float64 recomputed for exact models
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64)
        self._inv_freq = {
            torch.float32: 1.0 / (self.theta ** (exponent.float() / head_dim)),
            torch.float64: 1.0 / (self.theta ** (exponent.double() / head_dim)),
        }

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)``, each ``[T, 1, D]``, for :meth:`rotate`; compute once per forward."""
        exact = torch.float64 if dtype == torch.float64 else torch.float32
        # angles: [T, D/2]
        angles = positions.to(exact)[:, None] * self._inv_freq[exact][None, :]
        cos, sin = angles.cos(), angles.sin()
        # rotate-half: out[:D/2] = x1 cos - x2 sin ; out[D/2:] = x2 cos + x1 sin
        cos_full = torch.cat((cos, cos), dim=-1).to(dtype)
        sin_signed = torch.cat((-sin, sin), dim=-1).to(dtype)
        return cos_full[:, None, :], sin_signed[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """RoPE of ``x: [T, H, D]`` by the tables of :meth:`tables` (a new tensor; one C++
        call for float32 CPU rows, the same bits as the ops below)."""
        y = rope(x, cos, sin_signed)
        if y is not None:
            return y
        half = x.shape[-1] // 2
        # swapped: [T, H, D] = (x2, x1); times sin_signed gives (-x2 sin, x1 sin)
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin_signed)

    def shift(self, layer: int, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Keys ``[n, H, D]`` already rotated, moved by ``offsets: [n]`` positions (a cache's
        ``shift``; the cache may instead apply :meth:`tables` itself, see RotaryShift)."""
        del layer  # every layer of a Llama uses the same rotation
        return self.rotate(keys, *self.tables(offsets, keys.dtype))

    __call__ = shift

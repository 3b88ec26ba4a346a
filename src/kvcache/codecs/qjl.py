"""QJL: a 1-bit Johnson–Lindenstrauss sketch of a residual, for unbiased inner products.

TurboQuant by the book codes a key with ``bits - 1`` codebook bits and sketches what is left,
``r = t - centroids`` (rotated, unit scale), as the signs of ``S r`` with a Gaussian
``S: [m, P]`` (one seed -> one S) plus the norm ``||r||``. Then
``E[sqrt(pi/2)/m * ||r|| * <S q, sign(S r)>] = <q, r>``: no bias, but a variance of about
``(pi/2) ||q||^2 ||r||^2 / m``. ``quantizer.py`` says why keys default to spending that bit on
the codebook instead (``key_mode="mse"``); this sketch is ``key_mode="qjl"``.

Layout: sketches are packed sign bits ``uint8 [N, ceil(m/8)]`` (``pack.py``: bit i of the row
is projection i, 1 = non-negative), norms bf16 ``[N, 1]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcache.codecs.device import served_device
from kvcache.codecs.encoded import SCALE_DTYPE
from kvcache.codecs.pack import pack, packed_width, unpack
from kvcache.codecs.rotation import padded_rows


class QJLSketch:
    """1-bit Johnson–Lindenstrauss sketch: unbiased inner products with a vector's residual."""

    def __init__(
        self, dim: int, projections: int, seed: int, device: torch.device | str | None = None
    ) -> None:
        self.dim, self.projections, self.seed = dim, projections, seed
        self.device = served_device(device)
        g = torch.Generator().manual_seed(seed)  # on the CPU: the same S on every device
        self.matrix = torch.randn(projections, dim, generator=g).to(self.device)  # S: [m, P]
        self.width = packed_width(projections, 1)
        self.gain = math.sqrt(math.pi / 2) / projections

    def to(self, device: torch.device | str) -> QJLSketch:
        """The same sketch with its matrix on ``device``."""
        return QJLSketch(self.dim, self.projections, self.seed, device)

    def signs(self, sketch: torch.Tensor) -> torch.Tensor:
        """Packed bits [N, ceil(m/8)] -> +-1 [N, m] float32."""
        return unpack(sketch, 1, self.projections).float() * 2 - 1

    def decode(self, sketch: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Unbiased reconstruction sqrt(pi/2)/m * ||r|| * S^T sign(S r): [N, P]."""
        return (self.signs(sketch) @ self.matrix) * (norm * self.gain)

    def inner(self, q: torch.Tensor, sketch: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Unbiased estimates of <q_i, r_j>: q [Q, P], sketch [N, ..], norm [N, 1] -> [Q, N]."""
        return (q @ self.matrix.T) @ (self.signs(sketch) * (norm * self.gain)).T


class QJLStack:
    """H sketches applied together: residuals [H, N, P] -> packed signs, head h with its S."""

    def __init__(self, sketches: Sequence[QJLSketch]) -> None:
        self.width = sketches[0].width
        self.matrices = torch.stack([s.matrix for s in sketches])  # [H, m, P]

    def encode(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """r [H, N, P] -> (sign bits of S_h r [H*N, ceil(m/8)] uint8, ||r|| [H*N, 1] bf16)."""
        transposed = self.matrices.transpose(1, 2)  # [H, P, m]
        proj = padded_rows(lambda b: torch.bmm(b, transposed), r)  # [H, N, m]
        rows = r.shape[0] * r.shape[1]
        bits = pack((proj >= 0).view(rows, -1), 1)
        norms = torch.linalg.vector_norm(r, dim=-1).view(rows, 1)
        return bits, norms.to(SCALE_DTYPE)

"""The random rotation of TurboQuant: sign flips, then the orthonormal Walsh–Hadamard transform.

A vector ``x: [D]`` is zero-padded to ``P`` = the next power of two (>= 2) and rotated as
``y = H diag(signs) x / sqrt(P)`` (one seed -> one ``signs: [P]`` of +-1). The rotation spreads
outlier channels evenly over the P coordinates, so that every coordinate of a rotated unit
vector follows the same known distribution (the codebook's, see ``codebook.py``).

Layout: rows are vectors; ``Rotation`` maps ``[N, D] -> [N, P]`` (one head),
``RotationStack`` maps ``[H, N, D] -> [H, N, P]`` with head h's own signs (one op per step for
all heads).

Speed: for queries and decoding (:class:`Rotation`) the fast Walsh–Hadamard transform is
mixed-radix, stages of ``x @ H_r`` on a ``[.., r]`` view with ``r <= 128`` (O(P r log_r P));
at P <= 128 it is one GEMM with the sign flips folded into the matrix ``diag(signs) H /
sqrt(P)``, faster in torch than 7 radix-2 butterfly passes, which are memory-bound (docs/design).
Encoding on the CPU goes through the C++ encoder, which runs the butterflies in registers.

Batch invariance: the encoding path (:class:`RotationStack`) runs the transform as radix-2
butterflies, stage by stage (:func:`butterflies`): elementwise float32 additions in a fixed
order, so a vector rotates to the same bits whatever it was batched with and the compressed
cache gives the same codes however its tokens were pushed (``tests/test_compressed.py`` checks
it on random chunkings, ``tests/test_turbo.py`` row by row), and the C++ encoder
(``csrc/encode.cpp``) repeats the same operations bit for bit. A BLAS product picks its kernel
by shape: the same row in a product of 1..11 rows and in a larger one can differ in the last
bit (measured here), which now and then moves a code across a codebook boundary; the QJL
sketch, which still multiplies, runs its products on a multiple of ``BLOCK`` = 16 rows
(:func:`padded_rows`). Decoding and queries (:meth:`Rotation.forward`,
:meth:`Rotation.inverse`) see the same shapes whatever the pushes were: plain products.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from kvcache.codecs.device import served_device
from kvcache.errors import InvalidConfigError

RADIX = 128  # largest Hadamard block applied as one GEMM
BLOCK = 16  # encoding products run on a multiple of this many rows (see the module doc)


def padded_dim(dim: int) -> int:
    """The power of two (>= 2) that the Hadamard rotation works in."""
    return 1 << max(1, (dim - 1).bit_length())


def hadamard(n: int, device: torch.device | None = None) -> torch.Tensor:
    """Sylvester Hadamard matrix [n, n] of +-1 (n a power of two), built once per device."""
    return _hadamard(n, torch.device("cpu") if device is None else device)


@functools.cache
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform of each row of ``x: [N, P]`` (P a power of two)."""
    n, p = x.shape
    assert p & (p - 1) == 0, f"fwht needs a power-of-two width, got {p}"
    y = x
    stride = p
    while stride > 1:
        r = min(RADIX, stride)
        # y: [N, P/r, r]: transform the last axis, then move it first so that the next stage
        # transforms the next factor of the index (mixed-radix order).
        h = hadamard(r, x.device)
        y = (y.reshape(-1, r) @ h).view(n, p // r, r).transpose(1, 2).reshape(n, p)
        stride //= r
    return y * (1.0 / math.sqrt(p))


def butterflies(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform of rows ``x: [..., P]`` (P a power of two) as
    radix-2 butterflies in a fixed order: stage h = 1, 2, ..., P/2 maps each pair (v[i],
    v[i + h]) of a block of 2h to (v[i] + v[i + h], v[i] - v[i + h]). Only elementwise
    additions: every row's bits are independent of its batch (csrc/encode.cpp runs the same)."""
    *lead, p = x.shape
    assert p & (p - 1) == 0, f"butterflies need a power-of-two width, got {p}"
    v = x.reshape(-1, p)
    n, h = v.shape[0], 1
    while h < p:
        pairs = v.view(n, p // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = torch.stack((a + b, a - b), dim=2).view(n, p)
        h *= 2
    return v.view(*lead, p)


def padded_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to x [..., N, K] zero-padded to a multiple of BLOCK rows -> [..., N, K'].

    ``fn`` must treat rows independently (a product with a fixed matrix)."""
    n = x.shape[-2]
    pad = -n % BLOCK
    y = fn(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x)  # [..., N + pad, K']
    return y[..., :n, :] if pad else y


class Rotation:
    """Random sign flips then the Walsh–Hadamard transform: spreads outlier channels evenly."""

    def __init__(self, dim: int, seed: int, device: torch.device | str | None = None) -> None:
        if dim < 1:
            raise InvalidConfigError("dim", dim, "an int >= 1")
        self.dim = dim
        self.padded = padded_dim(dim)
        self.seed = seed
        self.device = served_device(device)
        g = torch.Generator().manual_seed(seed)  # on the CPU: the same signs on every device
        signs = torch.randint(0, 2, (self.padded,), generator=g).float() * 2 - 1  # [P]
        self.signs = signs.to(self.device)
        # One GEMM when P fits one radix stage: M = diag(signs) H / sqrt(P), rows = inputs.
        self.matrix: torch.Tensor | None = None
        if self.padded <= RADIX:
            h = hadamard(self.padded, self.device) * (1.0 / math.sqrt(self.padded))
            self.matrix = (self.signs[:, None] * h)[: self.dim]  # [D, P]

    def to(self, device: torch.device | str) -> Rotation:
        """The same rotation with its tensors on ``device``."""
        return Rotation(self.dim, self.seed, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> rotated [N, P] (orthonormal; for queries and offsets: encoding goes
        through :class:`RotationStack`, whose rows do not depend on their batch)."""
        if self.matrix is not None:
            return x @ self.matrix
        x = torch.nn.functional.pad(x, (0, self.padded - self.dim))
        return fwht(x * self.signs)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """y: [N, P] -> [N, D] (H is symmetric and orthonormal: its own inverse)."""
        if self.matrix is not None:
            return y @ self.matrix.T
        return (fwht(y) * self.signs)[:, : self.dim]


class RotationStack:
    """H rotations applied together: x [H, N, D] -> [H, N, P], head h with rotations[h], as
    butterflies (what encoding uses: a vector's codes do not depend on its batch)."""

    def __init__(self, rotations: Sequence[Rotation]) -> None:
        first = rotations[0]
        for r in rotations:
            if (r.dim, r.device) != (first.dim, first.device):
                want = f"dim {first.dim} on {first.device} (all heads alike)"
                raise InvalidConfigError("rotation", f"dim {r.dim} on {r.device}", want)
        self.dim, self.padded, self.heads = first.dim, first.padded, len(rotations)
        self.signs = torch.stack([r.signs for r in rotations])  # [H, P]
        mats = [r.matrix for r in rotations if r.matrix is not None]
        self.matrices = torch.stack(mats) if len(mats) == self.heads else None  # [H, D, P]
        self._dense: torch.Tensor | None = self.matrices

    def dense(self) -> torch.Tensor:
        """[H, D, P] matrices of the rotations, built once also where P > RADIX: the attention
        kernels rotate one value sum a query row back by them, not every cell."""
        if self._dense is None:
            h = hadamard(self.padded, self.signs.device) * (1.0 / math.sqrt(self.padded))
            self._dense = (self.signs[:, :, None] * h)[:, : self.dim].contiguous()
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [H, N, D] -> [H, N, P]: zero-padded, per-head sign flips, the butterflies, then
        1/sqrt(P) (float32 operations in a fixed order)."""
        x = torch.nn.functional.pad(x, (0, self.padded - self.dim))  # [H, N, P]
        return butterflies(x * self.signs[:, None]) * (1.0 / math.sqrt(self.padded))

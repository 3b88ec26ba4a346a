"""Codebooks: the Lloyd–Max levels of one rotated coordinate as encode/decode lookup tables.

A coordinate ``t`` of a rotated vector scaled to unit variance (``t = y sqrt(P) / ||y||``) is
coded as the index of its nearest level. Tables of a :class:`Codebook` (``b`` bits, grid step
``2^-g``; every tensor lives on the codebook's device)::

    centroids       float32 [2^b]            levels, ascending, in unit-variance units
    boundaries      float32 [2^b - 1]        midpoints rounded to the grid; t >= b_j -> code > j
    cell_codes      uint8/f32 [16 * 2^g]     code of every grid cell of [-8, 8) (pack's dtype)
    cell_squares    float32 [16 * 2^g]       centroid^2 of that code
    cell_centroids  float32 [16 * 2^g]       centroid of that code
    byte_centroids  float32 [256, 8/b]       centroids of the codes a packed byte holds (b | 8)

Speed: boundaries are rounded to a grid of step 2^-g <= (smallest gap) / 32 so that encoding
is one table lookup per coordinate instead of ``torch.bucketize`` (slower: docs/design); a boundary
moves by <= 1/64 of a gap (MSE within 0.1 % of exact nearest-centroid coding, tested).
Packed codes are decoded with the per-byte tables: torch's uint8 shifts are not vectorized.

The levels are fitted by ``lloyd.py`` (scipy) once per (P, bits) in a process, when the first
codebook of that shape is built, and rounded to steps of max |level| / 8191 (``LEVEL_STEPS``:
moved by < 1/600 of the smallest gap between levels at 5 bits, < 1/60 at 8), so that the attention
kernel can look them up as int16 and sum their products with an int16 query exactly
(csrc/codecs/turbo.cpp, turbo_keys16).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvcache.codecs.device import served_device
from kvcache.codecs.pack import byte_codes, unpack

GRID_CELLS_PER_GAP = 32  # encode grid step <= (smallest gap between boundaries) / 32
GRID_LO = -8.0  # grid covers [-8, 8); every boundary of every codebook lies inside
LEVEL_STEPS = 8191  # levels on multiples of max |level| / 8191: int16, 8 * 8191 * 32767 < 2^31


@dataclass(frozen=True)
class Codebook:
    """Lloyd–Max levels for one coordinate of a rotated unit vector, in units of 1/sqrt(P)."""

    bits: int
    grid_bits: int  # encode grid step 2^-grid_bits
    mse: float  # expected squared error per coordinate of the optimal (unrounded) quantizer
    centroids: torch.Tensor  # [2^b] float32, ascending
    boundaries: torch.Tensor  # [2^b - 1] float32, on the grid; t >= b_j -> code > j
    cell_codes: torch.Tensor  # [G]: code of every grid cell, as its packer reads it (uint8
    # for bits dividing 8, float32 for the float-word packer of the other widths)
    cell_squares: torch.Tensor  # [G] float32: centroid^2 of every grid cell
    cell_centroids: torch.Tensor  # [G] float32: centroid of every grid cell
    byte_centroids: torch.Tensor | None  # [256, 8/b]: centroids of a packed byte (b | 8)

    @property
    def device(self) -> torch.device:
        return self.centroids.device

    def to(self, device: torch.device | str) -> Codebook:
        """The same tables on ``device`` (typed error for a device they cannot live on)."""
        d = served_device(device)
        byte_centroids = None if self.byte_centroids is None else self.byte_centroids.to(d)
        return replace(
            self,
            centroids=self.centroids.to(d),
            boundaries=self.boundaries.to(d),
            cell_codes=self.cell_codes.to(d),
            cell_squares=self.cell_squares.to(d),
            cell_centroids=self.cell_centroids.to(d),
            byte_centroids=byte_centroids,
        )

    def cells(self, y: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """Grid cells of t = y * factor: y [N, P], factor [N, 1] -> int32 [N * P]: the cell
        floor(y * (factor * 2^g)) counted from GRID_LO, clamped to the grid."""
        offset = int(-GRID_LO * (1 << self.grid_bits))
        t = torch.floor(y * (factor * float(1 << self.grid_bits)))
        t = t.clamp_(-offset, self.cell_codes.shape[0] - 1 - offset).to(torch.int32)
        return t.add_(offset).view(-1)

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        """t: [N, P] (unit-variance units) -> codes [N, P] uint8 (the reference path)."""
        ones = torch.ones(t.shape[0], 1, device=t.device)
        return self.cell_codes.index_select(0, self.cells(t, ones)).view(t.shape).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [N, P] (any integer dtype) -> centroids [N, P] float32."""
        index = codes.reshape(-1)
        if index.dtype not in (torch.int32, torch.int64):  # index_select takes only these
            index = index.int()
        return self.centroids.index_select(0, index).view(codes.shape)

    def decode_packed(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        """Packed codes [N, ceil(count*b/8)] -> centroids [N, count] float32."""
        n = packed.shape[0]
        if self.byte_centroids is None:
            return self.decode(unpack(packed, self.bits, count, dtype=None))
        per = self.byte_centroids.shape[1]
        out = self.byte_centroids.index_select(0, packed.reshape(-1).int())
        return out.view(n, packed.shape[1] * per)[:, :count]


def lloyd_max(dim: int, bits: int, device: torch.device | str | None = None) -> Codebook:
    """MSE-optimal scalar codebook for rotated unit-vector coordinates in R^dim, on ``device``
    (fitted once per (dim, bits), its tables built once per device)."""
    return _codebook(dim, bits, served_device(device))


@functools.cache
def _codebook(dim: int, bits: int, device: torch.device) -> Codebook:
    if device.type != "cpu":
        return _codebook(dim, bits, torch.device("cpu")).to(device)
    return _tables(dim, bits, *_fitted(dim, bits))


@functools.cache
def _fitted(dim: int, bits: int) -> tuple[np.ndarray, float]:
    """Levels and MSE from ``lloyd.py``, imported here so that scipy loads only to fit."""
    from kvcache.codecs.lloyd import lloyd_levels

    return lloyd_levels(dim, bits)


def _tables(dim: int, bits: int, c: np.ndarray, mse: float) -> Codebook:
    """The lookup tables of levels ``c`` (unit-vector units) on the CPU."""
    level_step = float(np.max(np.abs(c))) * math.sqrt(dim) / LEVEL_STEPS
    levels = np.round(c * math.sqrt(dim) / level_step) * level_step  # unit-variance units
    mids = (levels[1:] + levels[:-1]) / 2.0  # [L-1] optimal boundaries of those levels
    gap = float(np.min(np.diff(mids))) if len(mids) > 1 else 1.0
    grid_bits = max(4, math.ceil(math.log2(GRID_CELLS_PER_GAP / gap)))
    step = 2.0**-grid_bits  # 2^-7 at 4 bits (2048 cells, 8 KiB: the lookup stays in L1)
    bounds = np.round(mids / step) * step  # moved by <= step / 2 <= gap / 64
    assert np.all(np.diff(bounds) > 0), f"codebook ({dim}, {bits}) too fine for the grid"
    assert bounds[0] > GRID_LO and bounds[-1] < -GRID_LO, f"boundaries {bounds[[0, -1]]}"
    grid = GRID_LO + step * np.arange(int(-2 * GRID_LO / step))  # left edge of each cell
    cell = torch.tensor(np.searchsorted(bounds, grid, side="right"))  # boundaries <= edge
    centroids = torch.tensor(levels, dtype=torch.float32)
    byte_centroids = centroids[byte_codes(bits).long()] if 8 % bits == 0 else None  # [256, per]
    return Codebook(
        bits=bits,
        grid_bits=grid_bits,
        mse=mse * dim,
        centroids=centroids,
        boundaries=torch.tensor(bounds, dtype=torch.float32),
        cell_codes=cell.to(torch.uint8 if 8 % bits == 0 else torch.float32),
        cell_squares=centroids[cell] ** 2,
        cell_centroids=centroids[cell],
        byte_centroids=byte_centroids,
    )

"""TurboQuant-style vector quantizer, as batched building blocks for K/V codecs.

One vector ``x: [D]`` (a key or a value of one head) is stored as::

    x' = x - offset         if the caller passes an offset and it shrinks ||x|| (1 flag bit)
    t  = sqrt(P) * R x' / ||x'||     R = H diag(signs) / sqrt(P), P = D padded to a power of 2
    codes = codebook(P, b).encode(t)        b bits per coordinate, bit-packed into uint8
    scale = ||x'|| * sqrt(P) / ||centroids[codes]||     bf16; its sign bit is the offset flag
    [key_mode="qjl" only] sign bits of S r and ||r||, r = t/sqrt(P) - centroids[codes]/sqrt(P)

so that ``x ~= flag * offset + scale * R^T centroids[codes] / sqrt(P)`` with ``R`` the rotation.
Layout of an :class:`Encoded` batch of N vectors (every field is ``[N, width]``)::

    codes    uint8 [N, ceil(P*b/8)]    packed indices (b = bits; bits - 1 with QJL)
    scale    bf16  [N, 1]              per-vector norm, sign bit = "offset subtracted"
    sketch   uint8 [N, ceil(m/8)]      QJL sign bits of the residual (width 0 without QJL)
    residual bf16  [N, 1]              QJL residual norm ||r|| (width 0 without QJL)

Why it is not the by-the-book TurboQuant. Measured with ``benchmarks/turbo_quality.py --kv``
on real SmolLM2-135M K/V (the first 1024 tokens of the Debian license texts, all 30 layers,
9 query heads over 3 KV heads, causal attention-output cosine vs exact attention):

    codec (bits)                          4-bit cosine  3-bit cosine  bytes/token/head (K+V)
    by the book: (b-1) + 64-row QJL       0.946         0.837         70.0 / 54.0
    all b bits to the codebook            0.989         0.959         68.0 / 52.0
    + keys centred where it helps (ours)  0.994         0.977         68.4 / 52.4

(layers 0/14/29 only, NOTES' protocol: by the book 0.966 / 0.898, ours 0.995 / 0.983.)

* Keys spend all ``bits`` on the MSE codebook instead of ``bits - 1`` plus a 1-bit QJL sketch
  (``key_mode="mse"``, the default). QJL makes inner products unbiased, not accurate: its
  variance is about ``(pi/2) ||q||^2 ||r||^2 / m``, while the error it removes has variance
  about ``||q||^2 ||r||^2 / P``; with m = P = 64 it adds pi/2 times the error it corrects, on
  the residual of a codebook with one bit less (3.6x its squared error). Softmax turns that
  variance into attention error; the MSE codebook's bias (a uniform shrink of the logits,
  which the norm-preserving scale below removes) costs almost nothing. The bias/variance
  trade is tested (test_turbo: QJL has no bias but > 2x the variance of 1-bit MSE codes).
  ``key_mode="qjl"`` keeps the by-the-book estimator to compare against.
* The stored scale makes each decoded vector's norm equal the input's rather than storing the
  plain norm (all layers: +0.0005 at 4 bits, +0.0015 at 3 bits); least-squares or
  projection-unbiased scales measured the same.
* Key outlier channels: real keys share a large per-channel component (RoPE's slow channels;
  the mean key norm is 1.56x the mean centred norm, median over layers), so the error, which
  scales with ||k||, is spent on a part every token shares and softmax ignores. The cache
  passes the running key mean as ``offset``; each key subtracts it only when that shrinks
  its norm (1 flag bit in the scale's sign bit; <q, offset> is added back exactly). "Only
  when" matters: attention-sink tokens are far from the mean and take much of the
  attention; centring every key made some layers worse (keys only, 3 bits: layer 15
  0.965 -> 0.948) while the per-key choice improved all of them. Centring values gained
  0.0007, so values are left as they are.
* Rejected after measuring: two rounds of sign flips + WHT and a dense Haar rotation (equal or
  worse than one round), per-channel key scaling before the rotation (worse), float16
  instead of bfloat16 scales (equal; bfloat16 cannot overflow).

Speed (goal: encode >= 400k vectors/s at D = 128 on this 2-core machine; measured 460-480k
wall, ~700k per CPU-second, for a batched 8-head push, see the benchmark): all heads of a
push go through one batched pipeline (:class:`HeadStack`), so each step is one op for every
head. The fast Walsh–Hadamard transform is mixed-radix, stages of ``x @ H_r`` on a
``[.., r]`` view with ``r <= 128`` (O(P r log_r P)); at P <= 128 it is one GEMM (a bmm over
heads with the sign flips folded in), ~20x faster here than 7 radix-2 butterfly passes, which
are memory-bound. Codebook boundaries are rounded to a grid of step 2^-g <= (smallest gap) /
32 so that encoding is one table lookup per coordinate instead of ``torch.bucketize`` (5x
slower); a boundary moves by <= 1/64 of a gap (MSE within 0.1 % of exact nearest-centroid
coding, tested). Codes are packed by k strided adds (k codes -> one integer exact in
float32/float64) viewed as bytes, and decoded with per-byte lookup tables, since torch's
uint8 shifts are not vectorized.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from scipy import optimize, special, stats

from kvcache.errors import DimensionMismatchError, InvalidConfigError
from kvcache.validate import config_int

SCALE_DTYPE = torch.bfloat16
KEY_MODES = ("mse", "qjl")
_RADIX = 128  # largest Hadamard block applied as one GEMM
_GRID_CELLS_PER_GAP = 32  # encode grid step <= (smallest gap between boundaries) / 32
_GRID_LO = -8.0  # grid covers [-8, 8); every boundary of every codebook lies inside
_CHUNK = 4096  # rows (all heads together) per encode step: keeps the working set in L2


def padded_dim(dim: int) -> int:
    """The power of two (>= 2) that the Hadamard rotation works in."""
    return 1 << max(1, (dim - 1).bit_length())


@functools.cache
def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix [n, n] of +-1 (n a power of two), built once."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform of each row of ``x: [N, P]`` (P a power of two)."""
    n, p = x.shape
    assert p & (p - 1) == 0, f"fwht needs a power-of-two width, got {p}"
    y = x
    stride = p
    while stride > 1:
        r = min(_RADIX, stride)
        # y: [N, P/r, r]: transform the last axis, then move it first so that the next stage
        # transforms the next factor of the index (mixed-radix order).
        y = (y.reshape(-1, r) @ hadamard(r)).view(n, p // r, r).transpose(1, 2).reshape(n, p)
        stride //= r
    return y * (1.0 / math.sqrt(p))


class Rotation:
    """Random sign flips then the Walsh–Hadamard transform: spreads outlier channels evenly."""

    def __init__(self, dim: int, seed: int) -> None:
        self.dim = dim
        self.padded = padded_dim(dim)
        g = torch.Generator().manual_seed(seed)
        self.signs = torch.randint(0, 2, (self.padded,), generator=g).float() * 2 - 1  # [P]
        # One GEMM when P fits one radix stage: M = diag(signs) H / sqrt(P), rows = inputs.
        self.matrix: torch.Tensor | None = None
        if self.padded <= _RADIX:
            h = hadamard(self.padded) * (1.0 / math.sqrt(self.padded))
            self.matrix = (self.signs[:, None] * h)[: self.dim]  # [D, P]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> rotated [N, P] (orthonormal)."""
        if self.matrix is not None:
            return x @ self.matrix
        x = torch.nn.functional.pad(x, (0, self.padded - self.dim))
        return fwht(x * self.signs)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """y: [N, P] -> [N, D] (H is symmetric and orthonormal: its own inverse)."""
        if self.matrix is not None:
            return y @ self.matrix.T
        return (fwht(y) * self.signs)[:, : self.dim]


@dataclass(frozen=True)
class Codebook:
    """Lloyd–Max levels for one coordinate of a rotated unit vector, in units of 1/sqrt(P)."""

    bits: int
    grid_bits: int  # encode grid step 2^-grid_bits
    centroids: torch.Tensor  # [2^b] float32, ascending
    boundaries: torch.Tensor  # [2^b - 1] float32, on the grid; t >= b_j -> code > j
    mse: float  # expected squared error per coordinate of the optimal (unrounded) quantizer
    cell_codes: torch.Tensor  # [G] float32: code of every grid cell
    cell_squares: torch.Tensor  # [G] float32: centroid^2 of every grid cell
    cell_centroids: torch.Tensor  # [G] float32: centroid of every grid cell
    byte_centroids: torch.Tensor | None  # [256, 8/b]: centroids of a packed byte (b | 8)

    def cells(self, y: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """Grid cells of t = y * factor: y [N, P], factor [N, 1] -> int32 [N * P]."""
        offset = torch.tensor(-_GRID_LO * (1 << self.grid_bits))
        cell = torch.addcmul(offset, y, factor * float(1 << self.grid_bits))
        return cell.clamp_(0, self.cell_codes.shape[0] - 1).to(torch.int32).view(-1)

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        """t: [N, P] (unit-variance units) -> codes [N, P] uint8 (the reference path)."""
        ones = torch.ones(t.shape[0], 1)
        return self.cell_codes.index_select(0, self.cells(t, ones)).view(t.shape).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [N, P] (any integer dtype) -> centroids [N, P] float32."""
        return self.centroids.index_select(0, codes.reshape(-1).int()).view(codes.shape)

    def decode_packed(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        """Packed codes [N, ceil(count*b/8)] -> centroids [N, count] float32."""
        n = packed.shape[0]
        if self.byte_centroids is None:
            return self.decode(unpack_codes(packed, self.bits, count))
        per = self.byte_centroids.shape[1]
        out = self.byte_centroids.index_select(0, packed.reshape(-1).int())
        return out.view(n, packed.shape[1] * per)[:, :count]


class _BetaCoordinate:
    """One coordinate x of a uniform unit vector in R^P: density (1-x^2)^a / B(1/2, a+1)."""

    def __init__(self, dim: int) -> None:
        self.a = (dim - 3) / 2.0
        self.log_norm = special.betaln(0.5, self.a + 1.0)
        # Second moments through the a+1 density: x^2 (1-x^2)^a = (1-x^2)^a - (1-x^2)^(a+1).
        self.ratio = math.exp(special.betaln(0.5, self.a + 2.0) - self.log_norm)

    def cdf(self, x: np.ndarray, extra: float = 0.0) -> np.ndarray:
        a = self.a + extra
        return np.asarray(stats.beta.cdf((x + 1.0) / 2.0, a + 1.0, a + 1.0))

    def first_moment(self, x: np.ndarray) -> np.ndarray:
        """Integral of t g(t) dt from -1 to x (closed form)."""
        base = np.clip(1.0 - x * x, 0.0, 1.0)
        return -np.power(base, self.a + 1.0) / (2.0 * (self.a + 1.0) * math.exp(self.log_norm))

    def centroids(self, c: np.ndarray) -> np.ndarray:
        """One Lloyd step: conditional means of the cells whose edges are midpoints of ``c``."""
        b = _edges(c)
        mass = np.diff(self.cdf(b))
        mean = np.diff(self.first_moment(b)) / np.where(mass > 0, mass, 1.0)
        return np.where(mass > 0, mean, c)

    def mse(self, c: np.ndarray) -> float:
        """Expected (x - Q(x))^2 of the nearest-centroid quantizer with levels ``c``."""
        b = _edges(c)
        mass = np.diff(self.cdf(b))
        m1 = np.diff(self.first_moment(b))
        m2 = mass - self.ratio * np.diff(self.cdf(b, extra=1.0))
        return float(np.sum(m2 - 2.0 * c * m1 + c * c * mass))


def _edges(c: np.ndarray) -> np.ndarray:
    return np.concatenate(([-1.0], (c[1:] + c[:-1]) / 2.0, [1.0]))


def _lloyd_levels(dim: int, bits: int) -> tuple[np.ndarray, float]:
    """Optimal levels (unit-vector units) and their MSE for ``bits`` bits in R^dim."""
    dist = _BetaCoordinate(dim)
    levels = 1 << bits
    # Panter–Dite start (point density ~ g^(1/3)), a few Lloyd steps, then a root finder on
    # the fixed point c = centroids(c): plain Lloyd needs > 20k steps to converge at 8 bits.
    u = (np.arange(levels) + 0.5) / levels
    a3 = dist.a / 3.0 + 1.0
    c = 2.0 * np.asarray(stats.beta.ppf(u, a3, a3)) - 1.0
    for _ in range(30):
        c = dist.centroids(c)
    sol = optimize.root(lambda v: dist.centroids(v) - v, c, method="hybr", options={"xtol": 1e-14})
    if np.all(np.diff(sol.x) > 0) and dist.mse(sol.x) <= dist.mse(c):
        c = sol.x
    return c, dist.mse(c)


@functools.cache
def lloyd_max(dim: int, bits: int) -> Codebook:
    """MSE-optimal scalar codebook for rotated unit-vector coordinates in R^dim (fit once)."""
    c, mse = _lloyd_levels(dim, bits)
    root = math.sqrt(dim)
    mids = (c[1:] + c[:-1]) / 2.0 * root  # [L-1] optimal boundaries, unit-variance units
    gap = float(np.min(np.diff(mids))) if len(mids) > 1 else 1.0
    grid_bits = max(4, math.ceil(math.log2(_GRID_CELLS_PER_GAP / gap)))
    step = 2.0**-grid_bits  # 2^-7 at 4 bits (2048 cells, 8 KiB: the lookup stays in L1)
    bounds = np.round(mids / step) * step  # moved by <= step / 2 <= gap / 64
    assert np.all(np.diff(bounds) > 0), f"codebook ({dim}, {bits}) too fine for the grid"
    assert bounds[0] > _GRID_LO and bounds[-1] < -_GRID_LO, f"boundaries {bounds[[0, -1]]}"
    grid = _GRID_LO + step * np.arange(int(-2 * _GRID_LO / step))  # left edge of each cell
    cell = np.searchsorted(bounds, grid, side="right")  # number of boundaries <= edge
    centroids = torch.tensor(c * root, dtype=torch.float32)
    byte_centroids = None
    if 8 % bits == 0:
        per = 8 // bits
        idx = (torch.arange(256)[:, None] >> (torch.arange(per) * bits)) & ((1 << bits) - 1)
        byte_centroids = centroids[idx]  # [256, per]
    return Codebook(
        bits=bits,
        grid_bits=grid_bits,
        centroids=centroids,
        boundaries=torch.tensor(bounds, dtype=torch.float32),
        mse=mse * dim,
        cell_codes=torch.tensor(cell, dtype=torch.float32),
        cell_squares=centroids[torch.tensor(cell)] ** 2,
        cell_centroids=centroids[torch.tensor(cell)],
        byte_centroids=byte_centroids,
    )


# bits -> (codes per word k, bytes per word): k*bits is a whole number of bytes, and the word
# is exact in float32 (<= 24 bits) or float64 (<= 48 bits); 7 bits go through int64 shifts.
_WORDS = {1: (8, 1), 2: (4, 1), 3: (8, 3), 4: (2, 1), 5: (8, 5), 6: (4, 3), 7: (8, 7), 8: (1, 1)}


def packed_width(count: int, bits: int) -> int:
    """Bytes per row for ``count`` codes of ``bits`` bits."""
    return (count * bits + 7) // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [N, C] integers < 2^bits (any dtype) -> [N, ceil(C*bits/8)] uint8.

    Bit order is little-endian: code i occupies bits [i*bits, (i+1)*bits) of the row.
    """
    assert sys.byteorder == "little", "byte views assume a little-endian machine"
    n, count = codes.shape
    k, nb = _WORDS[bits]
    groups = (count + k - 1) // k
    if groups * k != count:
        codes = torch.nn.functional.pad(codes, (0, groups * k - count))
    # word_g = sum_i code_{g*k+i} << (bits*i): k strided adds, exact in the chosen dtype.
    dtype = torch.float32 if nb <= 3 else torch.float64 if bits != 7 else torch.int64
    c = codes.to(dtype)
    word = c[:, 0::k].clone(memory_format=torch.contiguous_format)  # [N, G]
    for i in range(1, k):
        word.add_(c[:, i::k], alpha=1 << (bits * i))
    if nb == 1:
        return word.to(torch.uint8)
    word = word.to(torch.int32 if nb <= 3 else torch.int64)
    out = word.view(torch.uint8).view(n, groups, word.element_size())[:, :, :nb]
    return out.reshape(n, groups * nb)[:, : packed_width(count, bits)]


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: [N, ceil(C*bits/8)] uint8 -> codes [N, C] int32."""
    n = packed.shape[0]
    k, nb = _WORDS[bits]
    groups = (count + k - 1) // k
    p = torch.nn.functional.pad(packed, (0, groups * nb - packed.shape[1])).view(n, groups, nb)
    wide = torch.int32 if nb <= 3 else torch.int64
    size = 4 if nb <= 3 else 8
    word = torch.nn.functional.pad(p, (0, size - nb)).view(wide)  # [N, G, 1]
    shifts = torch.arange(k, dtype=wide) * bits
    codes = (word >> shifts) & ((1 << bits) - 1)  # [N, G, k]
    return codes.view(n, groups * k)[:, :count].to(torch.int32)


@dataclass(frozen=True)
class Encoded:
    """A batch of N encoded vectors; every field is [N, width] (layout in the module doc)."""

    codes: torch.Tensor
    scale: torch.Tensor
    sketch: torch.Tensor
    residual: torch.Tensor

    def __len__(self) -> int:
        return self.codes.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The stored buffers, in field order (what a cache preallocates and counts)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def nbytes(self) -> int:
        """Bytes of every stored buffer (codes, scales, sketches, residual norms)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def rows(self, start: int, stop: int) -> Encoded:
        """Views of rows [start, stop)."""
        return Encoded(*(t[start:stop] for t in self.tensors()))


class QJLSketch:
    """1-bit Johnson–Lindenstrauss sketch: unbiased inner products with a vector's residual."""

    def __init__(self, dim: int, projections: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.matrix = torch.randn(projections, dim, generator=g)  # S: [m, P]
        self.projections = projections
        self.width = packed_width(projections, 1)
        self.gain = math.sqrt(math.pi / 2) / projections

    def signs(self, sketch: torch.Tensor) -> torch.Tensor:
        """Packed bits [N, ceil(m/8)] -> +-1 [N, m] float32."""
        return unpack_codes(sketch, 1, self.projections).float() * 2 - 1

    def decode(self, sketch: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Unbiased reconstruction sqrt(pi/2)/m * ||r|| * S^T sign(S r): [N, P]."""
        return (self.signs(sketch) @ self.matrix) * (norm * self.gain)

    def inner(self, q: torch.Tensor, sketch: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Unbiased estimates of <q_i, r_j>: q [Q, P], sketch [N, ..], norm [N, 1] -> [Q, N]."""
        return (q @ self.matrix.T) @ (self.signs(sketch) * (norm * self.gain)).T


class TurboQuantizer:
    """Encode/decode batches of one head's keys and values with one shared random rotation."""

    def __init__(
        self, head_dim: int, bits: int, projections: int = 64, seed: int = 0, key_mode: str = "mse"
    ) -> None:
        self.head_dim = config_int("head_dim", head_dim, 2)
        self.bits = config_int("bits", bits, 1)
        if self.bits > 8:
            raise InvalidConfigError("bits", bits, "an int in 1..8")
        self.projections = config_int("projections", projections, 1)
        if key_mode not in KEY_MODES:
            raise InvalidConfigError("key_mode", key_mode, f"one of {KEY_MODES}")
        self.key_mode = key_mode
        self.seed = int(seed)
        self.rotation = Rotation(self.head_dim, self.seed)
        self.padded = self.rotation.padded
        self.value_codebook = lloyd_max(self.padded, self.bits)
        self.key_bits = self.bits - 1 if key_mode == "qjl" else self.bits
        self.key_codebook = lloyd_max(self.padded, self.key_bits) if self.key_bits else None
        self.qjl = QJLSketch(self.padded, self.projections, self.seed + 1_000_003)
        self._stack = HeadStack([self])

    # -- encoding -------------------------------------------------------------------------

    def encode_keys(self, x: torch.Tensor, offset: torch.Tensor | None = None) -> Encoded:
        """Keys x: [N, D] -> codes. ``offset`` [D] (or one per row, [N, D]) is subtracted from
        the rows whose norm it shrinks; pass the same offset to decode and score them."""
        return self._encode(x, offset, keys=True)

    def encode_values(self, x: torch.Tensor, offset: torch.Tensor | None = None) -> Encoded:
        """Values x: [N, D] -> codes (``bits`` bits per coordinate, MSE codebook)."""
        return self._encode(x, offset, keys=False)

    def _encode(self, x: torch.Tensor, offset: torch.Tensor | None, keys: bool) -> Encoded:
        """One head through the batched path: x [N, D] -> [1, N, D]; offset -> [1, 1 or N, D]."""
        self._check(x, "x")
        off = None
        if offset is not None:
            off = self._offset(offset, x.shape[0])
            off = off[None, None] if off.dim() == 1 else off[None]
        return self._stack.encode(x[None], off, keys)[0]

    # -- decoding -------------------------------------------------------------------------

    def decode_keys(self, enc: Encoded, offset: torch.Tensor | None = None) -> torch.Tensor:
        """Reconstructed keys [N, D] (QJL mode: codebook part plus the unbiased sketch part)."""
        rotated = self._centroids(enc, self.key_codebook)
        if self.key_mode == "qjl":
            rotated = rotated + self.qjl.decode(enc.sketch, enc.residual.float())
        return self._unrotate(rotated, enc, offset)

    def decode_values(self, enc: Encoded, offset: torch.Tensor | None = None) -> torch.Tensor:
        """Reconstructed values [N, D]."""
        return self._unrotate(self._centroids(enc, self.value_codebook), enc, offset)

    def _centroids(self, enc: Encoded, book: Codebook | None) -> torch.Tensor:
        """Codebook part of the rotated rows at unit scale: [N, P] (zeros without a codebook)."""
        if book is None:
            return torch.zeros(len(enc), self.padded)
        return book.decode_packed(enc.codes, self.padded) * (1.0 / math.sqrt(self.padded))

    def _unrotate(
        self, rotated: torch.Tensor, enc: Encoded, offset: torch.Tensor | None
    ) -> torch.Tensor:
        scale, flag = _split_flag(enc.scale)
        x = self.rotation.inverse(rotated * scale)
        return x if offset is None else x + flag * self._offset(offset, len(enc))

    # -- attention ------------------------------------------------------------------------

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q: [Q, D] -> [Q, P]; rotate once per call and reuse it for every key."""
        self._check(q, "q")
        return self.rotation.forward(q.float())

    def key_scores(
        self,
        q: torch.Tensor,
        enc: Encoded,
        offset: torch.Tensor | None = None,
        rotated: bool = False,
    ) -> torch.Tensor:
        """Estimated <q_i, k_j> (unscaled): q [Q, D] (or [Q, P] if ``rotated``) -> [Q, N]."""
        qr = q.float() if rotated else self.rotate_queries(q)
        if qr.dim() != 2 or qr.shape[1] != self.padded:
            raise DimensionMismatchError(f"[Q, {self.padded}]", tuple(qr.shape), "rotated query")
        scale, flag = _split_flag(enc.scale)  # [N, 1] each
        scores = qr @ self._centroids(enc, self.key_codebook).T  # [Q, N]
        if self.key_mode == "qjl":
            scores = scores + self.qjl.inner(qr, enc.sketch, enc.residual.float())
        scores = scores * scale.T
        if offset is not None:
            off = self._offset(offset, len(enc))
            off_rot = self.rotation.forward(off[None] if off.dim() == 1 else off)  # [1 or N, P]
            scores = scores + (qr @ off_rot.T) * flag.T  # <q, offset> where flagged
        return scores

    def weighted_values(
        self, weights: torch.Tensor, enc: Encoded, offset: torch.Tensor | None = None
    ) -> torch.Tensor:
        """sum_j weights[i, j] * value_j: weights [Q, N] -> [Q, D], summed in rotated space.

        One inverse rotation per output row instead of one per stored value.
        """
        scale, flag = _split_flag(enc.scale)  # [N, 1] each
        w = weights.float()
        rotated = (w * scale.T) @ self._centroids(enc, self.value_codebook)  # [Q, P]
        out = self.rotation.inverse(rotated)
        if offset is None:
            return out
        off = self._offset(offset, len(enc))
        return out + ((w @ flag) * off if off.dim() == 1 else (w * flag.T) @ off)

    def nbytes(self, enc: Encoded) -> int:
        """Bytes the encoded batch occupies (every field)."""
        return enc.nbytes()

    def bytes_per_key(self) -> int:
        """Stored bytes of one key vector (codes, scale, and the QJL sketch + norm if any)."""
        sketch = self.qjl.width + 2 if self.key_mode == "qjl" else 0
        return packed_width(self.padded, self.key_bits) + 2 + sketch

    def bytes_per_value(self) -> int:
        """Stored bytes of one value vector."""
        return packed_width(self.padded, self.bits) + 2

    def _offset(self, offset: torch.Tensor, rows: int) -> torch.Tensor:
        """Validated float32 offset: [D] (shared) or [rows, D] (one per row)."""
        if offset.shape not in ((self.head_dim,), (rows, self.head_dim)):
            want = f"[{self.head_dim}] or [{rows}, {self.head_dim}]"
            raise DimensionMismatchError(want, tuple(offset.shape), "offset shape")
        return offset.float()

    def _check(self, x: torch.Tensor, name: str) -> None:
        if x.dim() != 2 or x.shape[1] != self.head_dim:
            raise DimensionMismatchError(f"[N, {self.head_dim}]", tuple(x.shape), f"{name} shape")


class HeadStack:
    """Encodes H heads in one batched pass, head h with ``quantizers[h]``'s rotation and QJL
    matrix: one op per step for all heads instead of one per head (a TurboQuantizer encodes
    through a stack of one, so both paths run the same code)."""

    def __init__(self, quantizers: Sequence[TurboQuantizer]) -> None:
        first = quantizers[0]
        same = ("head_dim", "bits", "projections", "key_mode")
        for q in quantizers:
            for name in same:
                if getattr(q, name) != getattr(first, name):
                    raise InvalidConfigError(
                        name, getattr(q, name), f"{getattr(first, name)} (all heads alike)"
                    )
        self.first = first
        self.heads = len(quantizers)
        self.signs = torch.stack([q.rotation.signs for q in quantizers])  # [H, P]
        self.sketches = torch.stack([q.qjl.matrix for q in quantizers])  # [H, m, P]
        # P <= 128: each head's rotation as one matrix diag(signs) H / sqrt(P) -> one bmm.
        mats = [q.rotation.matrix for q in quantizers if q.rotation.matrix is not None]
        self.matrices = torch.stack(mats) if len(mats) == self.heads else None  # [H, D, P]

    def encode_keys(self, x: torch.Tensor, offsets: torch.Tensor | None = None) -> list[Encoded]:
        """Keys x: [H, N, D] -> one Encoded per head; ``offsets`` [H, D] (one per head)."""
        return self.encode(x, None if offsets is None else offsets[:, None], keys=True)

    def encode_values(self, x: torch.Tensor) -> list[Encoded]:
        """Values x: [H, N, D] -> one Encoded per head."""
        return self.encode(x, None, keys=False)

    def encode(self, x: torch.Tensor, offsets: torch.Tensor | None, keys: bool) -> list[Encoded]:
        """x: [H, N, D], offsets [H, 1 or N, D] -> per-head Encoded (views of one buffer)."""
        h, n, d = x.shape
        if h != self.heads or d != self.first.head_dim:
            want = f"[{self.heads}, N, {self.first.head_dim}]"
            raise DimensionMismatchError(want, tuple(x.shape), "x shape")
        qjl = keys and self.first.key_mode == "qjl"
        book = self.first.key_codebook if keys else self.first.value_codebook
        widths = self._widths(book, qjl)
        out = [torch.empty(h, n, w, dtype=dt) for w, dt in widths]  # [H, N, width] each
        step = max(1, _CHUNK // h)
        for start in range(0, n, step):
            stop = min(n, start + step)
            off = None
            if offsets is not None:
                off = offsets.float() if offsets.shape[1] == 1 else offsets[:, start:stop].float()
            part = self._chunk(x[:, start:stop].float(), off, book, qjl)
            for dst, src in zip(out, part.tensors(), strict=True):
                dst[:, start:stop] = src.view(h, stop - start, -1)
        return [Encoded(*(t[i] for t in out)) for i in range(h)]

    def _widths(self, book: Codebook | None, qjl: bool) -> list[tuple[int, torch.dtype]]:
        """(width, dtype) of each Encoded field."""
        bits = book.bits if book is not None else 0
        return [
            (packed_width(self.first.padded, bits), torch.uint8),
            (1, SCALE_DTYPE),
            (self.first.qjl.width if qjl else 0, torch.uint8),
            (1 if qjl else 0, SCALE_DTYPE),
        ]

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [H, c, D] -> [H*c, P]: per-head sign flips, then one shared Hadamard transform."""
        p = self.first.padded
        if self.matrices is not None:
            return torch.bmm(x, self.matrices).view(-1, p)
        if p != x.shape[-1]:
            x = torch.nn.functional.pad(x, (0, p - x.shape[-1]))
        return fwht((x * self.signs[:, None]).view(-1, p))

    def _sketch(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residuals r: [H*c, P] -> (packed sign bits of S_h r [H*c, m/8], bf16 norms [H*c, 1])."""
        proj = torch.bmm(r.view(self.heads, -1, r.shape[1]), self.sketches.transpose(1, 2))
        bits = pack_codes((proj >= 0).float().view(r.shape[0], -1), 1)
        return bits, torch.linalg.vector_norm(r, dim=1, keepdim=True).to(SCALE_DTYPE)

    def _chunk(
        self, x: torch.Tensor, offsets: torch.Tensor | None, book: Codebook | None, qjl: bool
    ) -> Encoded:
        """x: [H, c, D], offsets [H, 1 or c, D] -> Encoded rows [H*c] (head-major)."""
        flag = torch.zeros(x.shape[0], x.shape[1], 1, dtype=torch.bool)
        if offsets is not None:
            # ||x - o|| < ||x||  <=>  2 <x, o> > ||o||^2: no centred copy needed to decide.
            if offsets.shape[1] == 1:  # one offset per head: a batched matvec
                dots = torch.bmm(x, offsets.transpose(1, 2))  # [H, c, 1]
            else:
                dots = (x * offsets).sum(-1, keepdim=True)
            flag = dots * 2.0 > (offsets * offsets).sum(-1, keepdim=True)
            x = torch.addcmul(x, flag.float(), offsets, value=-1.0)
        flag = flag.view(-1, 1)  # [H*c, 1]
        y = self._rotate(x)  # [H*c, P], orthonormal
        norm = _row_norms(y)  # [H*c, 1] (the rotation keeps norms)
        inv = 1.0 / norm.clamp_min(1e-30)  # finite, so 0 * inv is never NaN
        root = math.sqrt(self.first.padded)
        rows = y.shape[0]
        empty = torch.empty(rows, 0, dtype=torch.uint8)
        if book is None:  # QJL with no codebook bits: the sketch carries the whole vector
            bits, rnorm = self._sketch(y * inv)
            return Encoded(empty, _with_flag(norm, flag), bits, rnorm)
        cell = book.cells(y, inv * root)  # [H*c*P]: t = y * sqrt(P) / ||x||
        codes = pack_codes(book.cell_codes.index_select(0, cell).view(y.shape), book.bits)
        if qjl:  # plain norm; the residual is sketched
            decoded = book.cell_centroids.index_select(0, cell).view(y.shape)
            bits, rnorm = self._sketch(y * inv - decoded * (1.0 / root))
            return Encoded(codes, _with_flag(norm, flag), bits, rnorm)
        length = book.cell_squares.index_select(0, cell).view(y.shape).sum(1, keepdim=True)
        scale = norm * root / length.sqrt_().clamp_min(1e-30)  # decoded norm == input norm
        return Encoded(
            codes, _with_flag(scale, flag), empty, torch.empty(rows, 0, dtype=SCALE_DTYPE)
        )


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """Euclidean norms [N, 1] of x: [N, D] float32, exact even where squares overflow float32."""
    norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    if not bool(torch.isfinite(norm).all()):  # some |x_i| > ~1e19: redo in float64
        norm = torch.linalg.vector_norm(x.double(), dim=1, keepdim=True).float()
    return norm


def _with_flag(scale: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """Non-negative scales [N, 1] -> bf16 with the flag in the sign bit (-0.0 keeps it)."""
    return torch.where(flag, -scale, scale).to(SCALE_DTYPE)


def _split_flag(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, 1] -> (scale >= 0 float32 [N, 1], flag 0/1 float32 [N, 1])."""
    return stored.float().abs(), torch.signbit(stored).float()

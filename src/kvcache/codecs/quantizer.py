"""TurboQuant-style vector quantizer, as batched building blocks for K/V codecs.

One vector ``x: [D]`` (a key or a value of one head) is stored as::

    x' = x - offset         if the caller passes an offset and it shrinks ||x|| (1 flag bit)
    t  = sqrt(P) * R x' / ||x'||     R: the rotation of rotation.py, P = D padded to 2^k
    codes = codebook(P, b).encode(t)        b bits per coordinate (codebook.py), packed (pack.py)
    scale = ||x'|| * sqrt(P) / ||centroids[codes]||     bf16; its sign bit is the offset flag
    [key_mode="qjl" only] sign bits of S r and ||r||, r = t/sqrt(P) - centroids[codes]/sqrt(P)

so that ``x ~= flag * offset + scale * R^T centroids[codes] / sqrt(P)``. The stored rows are an
:class:`~kvcache.codecs.encoded.Encoded` batch (layout there); the QJL sketch is ``qjl.py``.

Not the by-the-book TurboQuant; each choice measured on real SmolLM2 K/V (why and what it
bought: docs/design/turbo.md):

* Keys spend all ``bits`` on the MSE codebook (``key_mode="mse"``, the default) instead of
  ``bits - 1`` plus a 1-bit QJL sketch: QJL removes the bias but adds more variance than the
  error it corrects, and softmax turns variance into attention error. ``key_mode="qjl"`` keeps
  the by-the-book estimator to compare against (test_turbo checks the bias/variance trade).
* The stored scale makes each decoded vector's norm equal the input's.
* A cache passes a key mean as ``offset``; each key subtracts it only when that shrinks its
  norm (1 flag bit in the scale's sign bit; <q, offset> is added back exactly): real keys
  share a large per-channel component that softmax ignores, and attention-sink tokens, far
  from the mean, would get worse. Values are left as they are.
* One round of sign flips + WHT; bfloat16 scales (they cannot overflow).

Speed: float32 rows on the CPU go through the C++ encoder (``kvcache.kernels.encode.turbo``,
codebook codes of keys and values), which equals the torch expressions of :class:`HeadStack`
bit for bit; those (other devices, QJL keys, ``KVCACHE_ENCODE=reference``) run all heads of a
push as one batched pipeline, one op per step for every head. Every step treats rows
independently and sums in a fixed order (the rotation as butterflies, ``rotation.py``;
:func:`fixed_sum`; correctly rounded roots, :func:`correct_sqrt`), so a vector's codes do not
depend on what it was encoded with, nor on which of the two encoded it.

Devices: a quantizer's tensors (rotation, codebooks, sketch) live on its ``device``
(``device.py`` says which are served); inputs must be on it too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcache.codecs.codebook import Codebook, lloyd_max
from kvcache.codecs.device import require_on, served_device
from kvcache.codecs.encoded import SCALE_DTYPE, Encoded, split_flag, with_flag
from kvcache.codecs.pack import pack, packed_width
from kvcache.codecs.qjl import QJLSketch, QJLStack
from kvcache.codecs.rotation import BLOCK, Rotation, RotationStack
from kvcache.errors import DimensionMismatchError, InvalidConfigError
from kvcache.kernels import encode as kernel
from kvcache.validate import config_int

KEY_MODES = ("mse", "qjl")
_CHUNK = 4096  # rows (all heads together) per encode step: keeps the working set in L2
_QJL_SEED = 1_000_003  # the sketch's seed is the rotation's plus this


class TurboQuantizer:
    """Encode/decode batches of one head's keys and values with one shared random rotation."""

    def __init__(
        self,
        head_dim: int,
        bits: int,
        projections: int = 64,
        seed: int = 0,
        key_mode: str = "mse",
        device: torch.device | str | None = None,
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
        self.device = served_device(device)
        self.rotation = Rotation(self.head_dim, self.seed, self.device)
        self.padded = self.rotation.padded
        self.value_codebook = lloyd_max(self.padded, self.bits, self.device)
        self.key_bits = self.bits - 1 if key_mode == "qjl" else self.bits
        self.key_codebook = (
            lloyd_max(self.padded, self.key_bits, self.device) if self.key_bits else None
        )
        self.qjl = QJLSketch(self.padded, self.projections, self.seed + _QJL_SEED, self.device)
        self._stack = HeadStack([self])
        # the codebooks' levels over sqrt(P), as the cache's kernels read codes (a row is
        # levels[code] times its norm): made once, not on every layer call
        unit = 1.0 / math.sqrt(self.padded)
        self.value_levels = self.value_codebook.centroids * unit
        self.key_levels = self.key_codebook.centroids * unit if self.key_codebook else None

    def to(self, device: torch.device | str) -> TurboQuantizer:
        """The same quantizer (same codes for the same input) with its tensors on ``device``."""
        return TurboQuantizer(
            self.head_dim, self.bits, self.projections, self.seed, self.key_mode, device
        )

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

    def decode_keys(
        self, enc: Encoded, offset: torch.Tensor | None = None, index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Reconstructed keys [N, D] (QJL mode: codebook part plus the unbiased sketch part).
        ``offset``: as encoded ([D] or [N, D]), or a table [J, D] with ``index`` [N] (row i
        was encoded with offset[index[i]])."""
        rotated = self._centroids(enc, self.key_codebook)
        if self.key_mode == "qjl":
            rotated = rotated + self.qjl.decode(enc.sketch, enc.residual.float())
        return self._unrotate(rotated, enc, offset, index)

    def decode_values(self, enc: Encoded, offset: torch.Tensor | None = None) -> torch.Tensor:
        """Reconstructed values [N, D]."""
        return self._unrotate(self._centroids(enc, self.value_codebook), enc, offset)

    def _centroids(self, enc: Encoded, book: Codebook | None) -> torch.Tensor:
        """Codebook part of the rotated rows at unit scale: [N, P] (zeros without a codebook)."""
        if book is None:
            return torch.zeros(len(enc), self.padded, device=self.device)
        return book.decode_packed(enc.codes, self.padded) * (1.0 / math.sqrt(self.padded))

    def _unrotate(
        self,
        rotated: torch.Tensor,
        enc: Encoded,
        offset: torch.Tensor | None,
        index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scale, flag = split_flag(enc.scale)
        x = self.rotation.inverse(rotated * scale)
        if offset is None:
            return x
        off = self._offset(offset, len(enc), index)
        return x + flag * (off if index is None else off[index])

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
        index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Estimated <q_i, k_j> (unscaled): q [Q, D] (or [Q, P] if ``rotated``) -> [Q, N];
        ``offset`` and ``index`` as for :meth:`decode_keys` (a table is rotated once)."""
        qr = q.float() if rotated else self.rotate_queries(q)
        if qr.dim() != 2 or qr.shape[1] != self.padded:
            raise DimensionMismatchError(f"[Q, {self.padded}]", tuple(qr.shape), "rotated query")
        scale, flag = split_flag(enc.scale)  # [N, 1] each
        scores = qr @ self._centroids(enc, self.key_codebook).T  # [Q, N]
        if self.key_mode == "qjl":
            scores = scores + self.qjl.inner(qr, enc.sketch, enc.residual.float())
        scores = scores * scale.T
        if offset is not None:
            off = self._offset(offset, len(enc), index)
            off_rot = self.rotation.forward(off[None] if off.dim() == 1 else off)  # [1|N|J, P]
            dots = qr @ off_rot.T  # [Q, 1|N|J]
            dots = dots if index is None else dots[:, index]  # [Q, 1 or N]
            scores = scores + dots * flag.T  # <q, offset> where flagged
        return scores

    def weighted_values(
        self, weights: torch.Tensor, enc: Encoded, offset: torch.Tensor | None = None
    ) -> torch.Tensor:
        """sum_j weights[i, j] * value_j: weights [Q, N] -> [Q, D], summed in rotated space.

        One inverse rotation per output row instead of one per stored value.
        """
        scale, flag = split_flag(enc.scale)  # [N, 1] each
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

    def _offset(
        self, offset: torch.Tensor, rows: int, index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Validated float32 offset: [D] (shared), [rows, D] (one per row), or with ``index``
        [rows] a table [J, D] that the index picks from."""
        if index is not None:
            if index.shape != (rows,) or offset.dim() != 2 or offset.shape[1] != self.head_dim:
                want = f"offset [J, {self.head_dim}] and index [{rows}]"
                got = (tuple(offset.shape), tuple(index.shape))
                raise DimensionMismatchError(want, got, "offset table and index shapes")
            require_on(index, self.device, "index")
        elif offset.shape not in ((self.head_dim,), (rows, self.head_dim)):
            want = f"[{self.head_dim}] or [{rows}, {self.head_dim}]"
            raise DimensionMismatchError(want, tuple(offset.shape), "offset shape")
        require_on(offset, self.device, "offset")
        return offset.float()

    def _check(self, x: torch.Tensor, name: str) -> None:
        if x.dim() != 2 or x.shape[1] != self.head_dim:
            raise DimensionMismatchError(f"[N, {self.head_dim}]", tuple(x.shape), f"{name} shape")
        require_on(x, self.device, name)


class HeadStack:
    """Encodes H heads in one batched pass, head h with ``quantizers[h]``'s rotation and QJL
    matrix: one op per step for all heads instead of one per head (a TurboQuantizer encodes
    through a stack of one, so both paths run the same code)."""

    def __init__(self, quantizers: Sequence[TurboQuantizer]) -> None:
        first = quantizers[0]
        same = ("head_dim", "bits", "projections", "key_mode", "device")
        for q in quantizers:
            for name in same:
                if getattr(q, name) != getattr(first, name):
                    raise InvalidConfigError(
                        name, getattr(q, name), f"{getattr(first, name)} (all heads alike)"
                    )
        self.first = first
        self.heads = len(quantizers)
        self.rotations = RotationStack([q.rotation for q in quantizers])
        self.sketches = QJLStack([q.qjl for q in quantizers])
        self._cell_codes: dict[bool, torch.Tensor] = {}  # uint8 grid codes, for the kernel

    def encode_keys(self, x: torch.Tensor, offsets: torch.Tensor | None = None) -> list[Encoded]:
        """Keys x: [H, N, D] -> one Encoded per head; ``offsets`` [H, D] (one per head) or
        [H, N, D] (one per row)."""
        if offsets is not None and offsets.dim() == 2:
            offsets = offsets[:, None]
        return self.encode(x, offsets, keys=True)

    def encode_values(self, x: torch.Tensor) -> list[Encoded]:
        """Values x: [H, N, D] -> one Encoded per head."""
        return self.encode(x, None, keys=False)

    def encode(self, x: torch.Tensor, offsets: torch.Tensor | None, keys: bool) -> list[Encoded]:
        """x: [H, N, D], offsets [H, 1 or N, D] -> per-head Encoded (views of one buffer)."""
        stacked = self.encode_stacked(x, offsets, keys)
        return [Encoded(*(t[i] for t in stacked.tensors())) for i in range(self.heads)]

    def encode_stacked(self, x: torch.Tensor, offsets: torch.Tensor | None, keys: bool) -> Encoded:
        """x: [H, N, D], offsets [H, 1 or N, D] -> one Encoded whose fields are [H, N, width]
        (a cache's seal of a few dozen rows is one chunk: its tensors, with no copy)."""
        h, n, d = x.shape
        if h != self.heads or d != self.first.head_dim:
            want = f"[{self.heads}, N, {self.first.head_dim}]"
            raise DimensionMismatchError(want, tuple(x.shape), "x shape")
        require_on(x, self.first.device, "x")
        if offsets is not None:
            require_on(offsets, self.first.device, "offsets")
        qjl = keys and self.first.key_mode == "qjl"
        book = self.first.key_codebook if keys else self.first.value_codebook
        if book is not None and self.kernel_serves(x, keys):
            xs = x.float().transpose(0, 1).contiguous()  # [N, H, D]
            off = None if offsets is None else offsets.float().transpose(0, 1)
            width = packed_width(self.first.padded, book.bits)
            codes = torch.empty(n, h, width, dtype=torch.uint8)
            scale = torch.empty(n, h, 1, dtype=SCALE_DTYPE)
            self.encode_into(xs, torch.arange(n), off, keys, codes, scale)
            empty = torch.empty(h, n, 0, dtype=torch.uint8)
            return Encoded(
                codes.transpose(0, 1).contiguous(),
                scale.transpose(0, 1).contiguous(),
                empty,
                empty.to(SCALE_DTYPE),
            )
        step = max(BLOCK, _CHUNK // h // BLOCK * BLOCK)  # rows per head per step
        if n <= step:
            off = None if offsets is None else offsets.float()
            part = self._chunk(x.float(), off, book, qjl)
            return Encoded(*(t.view(h, n, -1) for t in part.tensors()))
        out = [
            torch.empty(h, n, w, dtype=dt, device=x.device) for w, dt in self._widths(book, qjl)
        ]  # [H, N, width] each
        for start in range(0, n, step):
            stop = min(n, start + step)
            off = None
            if offsets is not None:
                off = offsets.float() if offsets.shape[1] == 1 else offsets[:, start:stop].float()
            part = self._chunk(x[:, start:stop].float(), off, book, qjl)
            for dst, src in zip(out, part.tensors(), strict=True):
                dst[:, start:stop] = src.view(h, stop - start, -1)
        return Encoded(*out)

    def _book(self, keys: bool) -> Codebook:
        book = self.first.key_codebook if keys else self.first.value_codebook
        assert book is not None
        return book

    def kernel_serves(self, x: torch.Tensor, keys: bool, *outputs: torch.Tensor) -> bool:
        """Whether the C++ encoder (``kvcache.kernels.encode.turbo``) takes rows ``x`` into
        ``outputs``: codebook codes (not QJL keys) of float32 rows on the CPU, padded to at
        most ``TURBO_MAX_PADDED`` channels."""
        return (
            not (keys and self.first.key_mode == "qjl")
            and self.first.padded <= kernel.TURBO_MAX_PADDED
            and kernel.served(x, *outputs)
        )

    def encode_into(
        self,
        x: torch.Tensor,
        cells: torch.Tensor,
        offsets: torch.Tensor | None,
        keys: bool,
        codes: torch.Tensor,
        scale: torch.Tensor,
    ) -> None:
        """Rows ``x`` [n, H, D] into ``codes`` [N', H, W] and the flagged bf16 ``scale``
        [N', H, 1] at ``cells`` [n] with the C++ encoder (the same bits as :meth:`_chunk`);
        ``offsets`` [n or 1, H, D] or None."""
        book = self._book(keys)
        table = self._cell_codes.get(keys)
        if table is None:
            table = self._cell_codes[keys] = book.cell_codes.to(torch.uint8).contiguous()
        kernel.turbo(
            x,
            cells,
            offsets,
            self.rotations.signs,
            table,
            book.cell_squares,
            book.grid_bits,
            book.bits,
            codes,
            scale,
        )

    def _widths(self, book: Codebook | None, qjl: bool) -> list[tuple[int, torch.dtype]]:
        """(width, dtype) of each Encoded field."""
        bits = book.bits if book is not None else 0
        return [
            (packed_width(self.first.padded, bits), torch.uint8),
            (1, SCALE_DTYPE),
            (self.sketches.width if qjl else 0, torch.uint8),
            (1 if qjl else 0, SCALE_DTYPE),
        ]

    def _chunk(
        self, x: torch.Tensor, offsets: torch.Tensor | None, book: Codebook | None, qjl: bool
    ) -> Encoded:
        """x: [H, c, D], offsets [H, 1 or c, D] -> Encoded rows [H*c] (head-major)."""
        h, c, _ = x.shape
        p = self.first.padded
        flag = None  # no offset: every flag clear
        if offsets is not None:
            # ||x - o|| < ||x||  <=>  2 <x, o> > ||o||^2: no centred copy needed to decide.
            dots = fixed_sum(x * offsets, p)  # [H, c, 1]
            flag = dots * 2.0 > fixed_sum(offsets * offsets, p)
            x = torch.where(flag, x - offsets, x)
            flag = flag.reshape(-1, 1)  # [H*c, 1]
        y = self.rotations.forward(x).reshape(-1, p)  # [H*c, P], orthonormal
        norm = _row_norms(y)  # [H*c, 1] (the rotation keeps norms)
        inv = 1.0 / norm.clamp_min(1e-30)  # finite, so 0 * inv is never NaN
        root = math.sqrt(p)
        rows = y.shape[0]
        empty = torch.empty(rows, 0, dtype=torch.uint8, device=x.device)
        if book is None:  # QJL with no codebook bits: the sketch carries the whole vector
            bits, rnorm = self.sketches.encode((y * inv).view(h, c, p))
            return Encoded(empty, with_flag(norm, flag), bits, rnorm)
        cell = book.cells(y, inv * root)  # [H*c*P]: t = y * sqrt(P) / ||x||
        codes = pack(book.cell_codes.index_select(0, cell).view(y.shape), book.bits)
        if qjl:  # plain norm; the residual is sketched
            decoded = book.cell_centroids.index_select(0, cell).view(y.shape)
            residual = y * inv - decoded * (1.0 / root)  # [H*c, P]
            bits, rnorm = self.sketches.encode(residual.view(h, c, p))
            return Encoded(codes, with_flag(norm, flag), bits, rnorm)
        length = fixed_sum(book.cell_squares.index_select(0, cell).view(y.shape), p)
        scale = norm * root / correct_sqrt(length).clamp_min(1e-30)  # decoded norm == input norm
        no_sketch = torch.empty(rows, 0, dtype=SCALE_DTYPE, device=x.device)
        return Encoded(codes, with_flag(scale, flag), empty, no_sketch)


def fixed_sum(v: torch.Tensor, width: int) -> torch.Tensor:
    """Sums [..., 1] over the last axis of ``v`` in a fixed order: zero-padded to ``width`` (a
    power of two), then halved, v[:w/2] + v[w/2:], until one is left. Elementwise additions
    only, so each row's bits are independent of its batch and of how a library vectorises a
    reduction (csrc/encode.cpp sums the same way)."""
    if v.shape[-1] < width:
        v = torch.nn.functional.pad(v, (0, width - v.shape[-1]))
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v


def correct_sqrt(v: torch.Tensor) -> torch.Tensor:
    """Square roots of float32 ``v`` rounded correctly (IEEE's sqrt, as csrc/encode.cpp's
    ``std::sqrt``): torch's float32 sqrt on this CPU is not (docs/design/turbo.md); a float64
    root rounded to float32 is, for float32 inputs."""
    return v.double().sqrt_().float()


_DOWN, _UP = 2.0**-80, 2.0**80  # exact rescaling of rows whose squares overflow float32


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """Euclidean norms [N, 1] of x: [N, P] float32 (P a power of two), summed in a fixed order
    (:func:`fixed_sum`); rows whose squares overflow float32 are summed at 2^-80 of their size
    (a power of two: exact) and scaled back."""
    width = x.shape[1]
    norm = correct_sqrt(fixed_sum(x * x, width))
    bad = ~torch.isfinite(norm[:, 0])  # rows with some |x_i| > ~1e19
    if bool(bad.any()):  # only those rows, so no row's norm depends on its neighbours
        small = x[bad] * _DOWN
        norm[bad] = correct_sqrt(fixed_sum(small * small, width)) * _UP
    return norm

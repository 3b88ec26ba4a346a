"""TurboQuant codecs for the cell cache (``turbo4``, ``turbo3``): the quantizer of
``kvcache.codecs.quantizer`` applied per cell and head.

Layout per layer (head h uses rotation seed ``seed + h``, as the compressed cache does)::

    codes   uint8 [N', H, P * bits / 8]   codebook indices of the rotated, normalised row
    scale   bf16  [N', H, 1]              norm-preserving scale
            (or uint8 [N', H, 1]: log2 of it in 1/8-octave steps, ``log_scale``)
    centre  fp16  [M, H, D]               keys: the sequence's key centre (kvcache.recent)
    + the recent window (window.py)

The names give the average bits per stored value, and the bits are split unevenly: keys
get one bit more than values (``turbo4`` = 5-bit keys + 3-bit values, ``turbo3`` = 4 + 2),
at the same bytes as an even split: errors in keys move every attention weight while value
errors average out over the attended rows. ``turbo3`` also stores its values' norm in one
byte (log-coded) so that K+V fit in 1/5 of fp16's bytes. Why and what each bought:
docs/design/turbo.md.

Keys and values both spend all ``bits`` on the Lloyd–Max codebook (the module docstring of
``quantizer.py`` says why QJL loses). Keys are centred by their sequence's centre (the mean of
its rows when it first seals one): any fixed offset round-trips, and cells are written out
of order and shared by sequences. The centre is a mean of keys before RoPE: the centre of
un-rotated keys holds at every position. With a rotary shift (``rotary_centre``,
``codecs.base.RotaryFrame``) keys are stored after RoPE minus that centre rotated to the row's
position, which quantizes as well (the codebook sees a rotated residual of the same norm)
and lets the attention kernel score the codes against the query rotated once into
the codes' domain, instead of transforming and rotating every key; with any other shift keys
are stored before RoPE (``pre_rope``).

Values are summed by the attention kernel in the rotated domain (weights times codebook
levels) and rotated back once per output row.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.codecs.base import TURBO, Buffer, Codec, Layout, RotaryFrame, grown
from kvcache.codecs.encoded import SCALE_DTYPE, Encoded
from kvcache.codecs.pack import packed_width
from kvcache.codecs.quantizer import HeadStack, TurboQuantizer
from kvcache.codecs.window import CentredBuffer
from kvcache.kernels.contract import MAX_DIM
from kvcache.recent import SEAL_BATCH, Windows, WindowSpec


class TurboBuffer(CentredBuffer):
    def __init__(
        self,
        n: int,
        heads: int,
        dim: int,
        codec: TurboCodec,
        windows: Windows,
        device: torch.device,
        frame: RotaryFrame | None = None,
    ) -> None:
        super().__init__(n, heads, dim, windows, device, codec.keys, frame)
        self.quantizers = [
            TurboQuantizer(dim, codec.bits, seed=codec.seed + h) for h in range(heads)
        ]
        self.stack = HeadStack(self.quantizers)
        self.bits, self.keys, self.log_scale = codec.bits, codec.keys, codec.log_scale
        self.padded = self.quantizers[0].padded
        width = packed_width(self.padded, codec.bits)
        self.codes = torch.zeros((0, heads, width), dtype=torch.uint8, device=device)
        scale_dtype = torch.uint8 if codec.log_scale else SCALE_DTYPE
        self.scale = torch.zeros((0, heads, 1), dtype=scale_dtype, device=device)

    def _allocate(self, rows: int) -> None:
        self.codes, self.scale = grown(self.codes, rows), grown(self.scale, rows)

    def _encode(self, cells: torch.Tensor, x: torch.Tensor, metas: np.ndarray) -> None:
        x = self.centred(x, metas, cells)
        if not self.log_scale and self.stack.kernel_serves(x, self.keys, self.codes, self.scale):
            self.stack.encode_into(x, cells, None, self.keys, self.codes, self.scale)
            return
        encoded = self.stack.encode_stacked(x.transpose(0, 1), None, self.keys)  # [H, T, ...]
        codes = encoded.codes.transpose(0, 1)  # [T, H, W]
        scale = encoded.scale.transpose(0, 1)  # [T, H, 1]
        if self.log_scale:
            scale = _log_code(scale)
        self.codes.index_copy_(0, cells, codes)
        self.scale.index_copy_(0, cells, scale)

    def _decode(self, cells: np.ndarray) -> torch.Tensor:
        at = self.index(cells)
        codes, scale = self.codes[at], self.scale[at]
        if self.log_scale:
            scale = _log_decode(scale)
        n = len(cells)
        rows = []
        for h, q in enumerate(self.quantizers):
            enc = Encoded(
                codes[:, h],
                scale[:, h],
                torch.empty(n, 0, dtype=torch.uint8),
                torch.empty(n, 0, dtype=SCALE_DTYPE),
            )
            rows.append(q.decode_keys(enc) if self.keys else q.decode_values(enc))
        return self.uncentred(torch.stack(rows, dim=1), cells)  # [n, H, D] float32

    def layout(self) -> Layout:
        first = self.quantizers[0]
        levels = first.key_levels if self.keys else first.value_levels
        assert levels is not None
        layout = Layout(
            TURBO,
            self.codes,
            scale=self.scale,
            centroids=levels,
            signs=self.stack.rotations.signs,
            rotation=self._value_rotation(),
            bits=self.bits,
            log_scale=self.log_scale,
            rotated=not self.keys,
        )
        return self.centred_layout(layout)

    def _value_rotation(self) -> torch.Tensor:
        """What the kernels rotate value sums back by: dense matrices for values up to
        MAX_DIM wide (keys keep the GEMM matrices or none: their queries turn by the signs)."""
        r = self.stack.rotations
        if self.keys or r.padded > MAX_DIM:
            return _or_empty(r.matrices)
        return r.dense()

    def _code_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scale, *self.centre_tensors())


class TurboCodec(Codec):
    """TurboQuant-style codes with ``bits`` per coordinate (keys: ``keys=True``);
    ``log_scale`` stores each row's norm in one byte instead of a bf16; each sequence's
    newest ``window`` rows stay in fp16."""

    def __init__(
        self,
        bits: int,
        keys: bool,
        seed: int = 0,
        log_scale: bool = False,
        name: str = "",
        window: int = 128,
        batch: int = SEAL_BATCH,
    ) -> None:
        self.bits, self.keys, self.seed, self.log_scale = bits, keys, seed, log_scale
        self.name = name or f"turbo{bits}"
        self.pre_rope = self.rotary_centre = keys
        self.spec = WindowSpec(window, 1, "sequence" if keys else "none", batch)

    def allocate(
        self, n: int, heads: int, dim: int, device: torch.device, windows: Windows | None
    ) -> Buffer:
        return self.allocate_keys(n, heads, dim, device, windows, None)

    def allocate_keys(
        self,
        n: int,
        heads: int,
        dim: int,
        device: torch.device,
        windows: Windows | None,
        frame: RotaryFrame | None,
    ) -> Buffer:
        assert windows is not None and windows.spec == self.spec, "turbo needs its windows"
        return TurboBuffer(n, heads, dim, self, windows, device, frame)

    def bytes_per_row(self, heads: int, dim: int) -> float:
        padded = 1 << max(1, (dim - 1).bit_length())
        return heads * (packed_width(padded, self.bits) + (1 if self.log_scale else 2))


# log-coded norms: code 0 is 0, code c >= 1 is 2 ** ((c - 1) / 8 - 16), so 2^-16 .. 2^15.75
_LOG_STEPS, _LOG_MIN = 8, -16


def _log_code(scale: torch.Tensor) -> torch.Tensor:
    """Non-negative norms -> uint8 codes (nearest step in log2; clamped to the range)."""
    s = scale.float()
    steps = torch.round((torch.log2(s.clamp_min(2.0**_LOG_MIN)) - _LOG_MIN) * _LOG_STEPS) + 1
    return torch.where(s > 0, steps.clamp(1, 255), torch.zeros_like(steps)).to(torch.uint8)


def _log_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> float32 norms (as the attention kernel reads them)."""
    c = code.float()
    s = torch.exp2((c - 1) / _LOG_STEPS + _LOG_MIN)
    return torch.where(code > 0, s, torch.zeros_like(s))


def _or_empty(t: torch.Tensor | None) -> torch.Tensor:
    return t if t is not None else torch.empty(0)

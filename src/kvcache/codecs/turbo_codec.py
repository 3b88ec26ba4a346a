"""TurboQuant codecs for the cell cache (``turbo4``, ``turbo3``): the quantizer of
``kvcache.codecs.turbo`` applied per cell and head.

Layout per layer (head h uses rotation seed ``seed + h``, as the compressed cache does)::

    codes  uint8 [N, H, P * bits / 8]   codebook indices of the rotated, normalised row
    scale  bf16  [N, H, 1]              norm-preserving scale
           (or uint8 [N, H, 1]: log2 of it in 1/8-octave steps, ``log_scale``)

The names give the average bits per stored value, and the bits are split unevenly: keys
get one bit more than values (``turbo4`` = 5-bit keys + 3-bit values, ``turbo3`` = 4 + 2),
at the same bytes as an even split. Errors in keys move every attention weight while
value errors average out over the attended rows; measured on SmolLM2 (1 window, KL vs fp32):
turbo4 0.021 even vs 0.011 split, turbo3 0.077 even vs 0.047 split. ``turbo3`` also stores
its values' norm in one byte (log-coded; at most 4.4 % off, next to the 2-bit codes'
~34 % relative error) so that K+V fit in 1/5 of fp16's bytes.

Keys and values both spend all ``bits`` on the Lloyd–Max codebook (the module docstring of
``turbo.py`` says why QJL loses). Keys are centred as in the compressed cache, but by a
fixed :class:`~kvcache.codecs.base.Centre` (the first write's mean), not a running mean:
cells are written out of order and shared by sequences. Keys are quantized before RoPE
where the cache can (``pre_rope``): the centre of un-rotated keys holds at every position.
Measured on SmolLM2 (1 window, keys alone): ΔPPL +10.0 % plain, +6.4 % centred, +2.2 %
centred before RoPE.
"""

from __future__ import annotations

import torch

from kvcache.codecs.base import Buffer, Centre, Codec, Locs, tensor_bytes
from kvcache.codecs.encoded import SCALE_DTYPE, Encoded
from kvcache.codecs.pack import packed_width
from kvcache.codecs.quantizer import HeadStack, TurboQuantizer


class TurboBuffer(Buffer):
    def __init__(
        self, n: int, heads: int, dim: int, codec: TurboCodec, device: torch.device
    ) -> None:
        self.quantizers = [
            TurboQuantizer(dim, codec.bits, seed=codec.seed + h) for h in range(heads)
        ]
        self.stack = HeadStack(self.quantizers)
        self.keys = codec.keys
        self.log_scale = codec.log_scale
        self.centre = Centre(heads, dim, device) if codec.keys else None
        width = packed_width(self.quantizers[0].padded, codec.bits)
        self.codes = torch.zeros((n, heads, width), dtype=torch.uint8, device=device)
        scale_dtype = torch.uint8 if codec.log_scale else SCALE_DTYPE
        self.scale = torch.zeros((n, heads, 1), dtype=scale_dtype, device=device)

    def write(self, locs: Locs, x: torch.Tensor) -> None:
        x = self.centre.remove(x) if self.centre is not None else x
        encoded = self.stack.encode(x.float().transpose(0, 1), None, self.keys)  # per head
        codes = torch.stack([e.codes for e in encoded], dim=1)  # [T, H, W]
        scale = torch.stack([e.scale for e in encoded], dim=1)  # [T, H, 1]
        if self.log_scale:
            scale = _log_code(scale)
        if isinstance(locs, slice):
            self.codes[locs], self.scale[locs] = codes, scale
        else:
            self.codes.index_copy_(0, locs, codes)
            self.scale.index_copy_(0, locs, scale)

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.log_scale:
            scale = _log_decode(scale)
        rows = []
        for h, q in enumerate(self.quantizers):
            n = codes.shape[0]
            enc = Encoded(
                codes[:, h],
                scale[:, h],
                torch.empty(n, 0, dtype=torch.uint8),
                torch.empty(n, 0, dtype=SCALE_DTYPE),
            )
            rows.append(q.decode_keys(enc) if self.keys else q.decode_values(enc))
        x = torch.stack(rows, dim=1)  # [L, H, D] float32
        x = self.centre.restore(x) if self.centre is not None else x
        return x.to(dtype)

    def read(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        return self._decode(self.codes[lo:hi], self.scale[lo:hi], dtype)

    def gather(self, cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._decode(self.codes[cells], self.scale[cells], dtype)

    def nbytes(self) -> int:
        extra = self.centre.nbytes() if self.centre is not None else 0
        return tensor_bytes(self.codes, self.scale) + extra


class TurboCodec(Codec):
    """TurboQuant-style codes with ``bits`` per coordinate (keys: ``keys=True``);
    ``log_scale`` stores each row's norm in one byte instead of a bf16."""

    def __init__(
        self, bits: int, keys: bool, seed: int = 0, log_scale: bool = False, name: str = ""
    ) -> None:
        self.bits, self.keys, self.seed, self.log_scale = bits, keys, seed, log_scale
        self.name = name or f"turbo{bits}"
        self.pre_rope = keys

    def allocate(self, n: int, heads: int, dim: int, device: torch.device) -> Buffer:
        return TurboBuffer(n, heads, dim, self, device)


# log-coded norms: code 0 is 0, code c >= 1 is 2 ** ((c - 1) / 8 - 16), so 2^-16 .. 2^15.75
_LOG_STEPS, _LOG_MIN = 8, -16


def _log_code(scale: torch.Tensor) -> torch.Tensor:
    """Non-negative norms -> uint8 codes (nearest step in log2; clamped to the range)."""
    s = scale.float()
    steps = torch.round((torch.log2(s.clamp_min(2.0**_LOG_MIN)) - _LOG_MIN) * _LOG_STEPS) + 1
    return torch.where(s > 0, steps.clamp(1, 255), torch.zeros_like(steps)).to(torch.uint8)


def _log_decode(code: torch.Tensor) -> torch.Tensor:
    c = code.float()
    s = torch.exp2((c - 1) / _LOG_STEPS + _LOG_MIN)
    return torch.where(code > 0, s, torch.zeros_like(s)).to(SCALE_DTYPE)

"""KIVI in cells: keys quantized per channel over 64 tokens of a sequence, values per token.

KIVI (Liu et al., 2024) quantizes keys per *channel* (outlier channels get their own range)
over groups of tokens and values per *token*, and keeps the newest tokens in full precision
until a whole group can be quantized at once. Here a group is 64 consecutive positions of one
sequence, wherever their cells are (``kvcache.recent``: group 64, a metadata record each)::

    seq positions   0 ........ 63 | 64 ....... 127 | 128 .......... (newest 128: fp16)
    keys            codes + record a | codes + record b | window rows
    record          scale, min [H, D] (fp16, per channel over the group's 64 rows)
    values          codes [N', H, D*bits/8] + per row scale, min [H, D/64]  (ints.py)

Keys default to being stored before RoPE (``pre_rope``: a channel's range is then stable
within a group; why and what it bought: docs/design/index.md).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.codecs.base import AFFINE_CHANNELS, Buffer, Codec, Layout, grown
from kvcache.codecs.ints import META, AffineRowsCodec
from kvcache.codecs.pack import pack, unpack, unpack4
from kvcache.codecs.window import WindowedBuffer
from kvcache.errors import DimensionMismatchError, InvalidConfigError
from kvcache.kernels import encode
from kvcache.recent import Windows, WindowSpec


class ChannelBuffer(WindowedBuffer):
    """Keys: b-bit codes with a scale and minimum per channel over each sealed group."""

    CELL_FIELDS = ("codes",)
    RECORD_FIELDS = ("scale", "low")

    def __init__(
        self, n: int, heads: int, dim: int, bits: int, windows: Windows, device: torch.device
    ) -> None:
        if (dim * bits) % 8:
            raise DimensionMismatchError(f"a multiple of {8 // bits}", dim, "kivi head_dim")
        super().__init__(n, heads, dim, windows, device)
        self.bits = bits
        self.codes = torch.zeros((0, heads, dim * bits // 8), dtype=torch.uint8, device=device)
        self.scale = torch.zeros((0, heads, dim), dtype=META, device=device)  # [M, H, D]
        self.low = torch.zeros((0, heads, dim), dtype=META, device=device)  # [M, H, D]

    def _allocate(self, rows: int) -> None:
        self.codes = grown(self.codes, rows)

    def _fresh(self, meta: int, basis: torch.Tensor, cells: np.ndarray | None = None) -> None:
        """A group's channel ranges over its rows."""
        self.scale, self.low = self.meta_rows(self.scale), self.meta_rows(self.low)
        if encode.served(basis, self.scale, self.low):
            encode.ranges(basis, meta, self.bits, self.scale, self.low)
        else:
            self.fresh_reference(meta, basis)

    def fresh_reference(self, meta: int, basis: torch.Tensor) -> None:
        """The torch expression of a record's ranges (what the kernel equals)."""
        low, high = basis.amin(dim=0), basis.amax(dim=0)  # [H, D]
        self.scale[meta] = ((high - low) / ((1 << self.bits) - 1)).to(META)
        self.low[meta] = low.to(META)

    def _encode(self, cells: torch.Tensor, x: torch.Tensor, metas: np.ndarray) -> None:
        if encode.served(x, self.codes, self.scale, self.low):
            at = torch.from_numpy(metas.astype(np.int64))
            encode.channels(x, cells, at, self.bits, self.codes, self.scale, self.low)
        else:
            self.encode_reference(cells, x, metas)

    def encode_reference(self, cells: torch.Tensor, x: torch.Tensor, metas: np.ndarray) -> None:
        """The torch expression of the codes (what the kernel equals)."""
        levels = (1 << self.bits) - 1
        at = self.index(metas).long()
        scale = self.scale[at].float().clamp_min(torch.finfo(META).tiny)  # [n, H, D]
        q = torch.round((x - self.low[at].float()) / scale).clamp_(0, levels)
        self.codes.index_copy_(0, cells, pack(q.to(torch.uint8), self.bits))

    def _reencode(self, cells: np.ndarray, x: torch.Tensor) -> None:
        """Rows of sealed groups changed (re-rotated keys): re-range each group they touch."""
        metas = self.windows.meta_of[cells]
        for meta in np.unique(metas).tolist():
            members = np.flatnonzero(self.windows.meta_of == meta)
            rows = self._decode(members)
            at = np.searchsorted(members, cells[metas == meta])
            rows[self.index(at)] = x[self.index(metas == meta)]
            rows = rows.to(torch.float16).float()
            self._fresh(meta, rows)
            self._encode(self.index(members), rows, np.full(len(members), meta))

    def _decode(self, cells: np.ndarray) -> torch.Tensor:
        at = self.index(cells)
        codes = self.codes[at]
        q = unpack4(codes) if self.bits == 4 else unpack(codes, self.bits)
        x = torch.empty((len(cells), self.heads, self.dim), dtype=torch.float32, device=self.device)
        x.copy_(q.view(x.shape))
        meta = self.index(self.windows.meta_of[cells])
        return x.mul_(self.scale[meta].float()).add_(self.low[meta].float())

    def layout(self) -> Layout:
        layout = Layout(
            AFFINE_CHANNELS,
            self.codes,
            meta_of=torch.from_numpy(self.windows.meta_of),
            meta_a=self.scale,
            meta_b=self.low,
            bits=self.bits,
        )
        return self.window_layout(layout)

    def _code_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scale, self.low)


class KiviKeyCodec(Codec):
    """KIVI keys: per-channel ranges over each sealed group of ``group`` rows."""

    pre_rope = True
    any_device = True

    def __init__(self, bits: int, group: int, residual: int) -> None:
        self.bits, self.group, self.name = bits, group, f"kivi{bits}"
        self.spec = WindowSpec(residual, group, "group", batch=group)

    def allocate(
        self, n: int, heads: int, dim: int, device: torch.device, windows: Windows | None
    ) -> Buffer:
        assert windows is not None and windows.spec == self.spec, "kivi keys need their windows"
        return ChannelBuffer(n, heads, dim, self.bits, windows, device)

    def bytes_per_row(self, heads: int, dim: int) -> float:
        return heads * (dim * self.bits / 8 + 2 * 2 * dim / self.group)


def kivi(
    bits: int, per_channel: bool, group: int = 64, residual: int = 128, value_group: int = 64
) -> Codec:
    """KIVI with ``bits`` per value: keys per channel (``per_channel``), values per token;
    each sequence's newest ``residual`` rows in fp16."""
    if bits not in (2, 4):
        raise InvalidConfigError("bits", bits, "2 or 4")
    if group < 1 or residual < group:
        raise InvalidConfigError("residual", residual, f"an int >= group ({group})")
    if per_channel:
        return KiviKeyCodec(bits, group, residual)
    return AffineRowsCodec(bits, value_group, False, residual, f"kivi{bits}")

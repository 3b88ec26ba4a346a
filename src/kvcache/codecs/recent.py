"""The newest rows of a quantized buffer also kept in fp16 (a "residual" window).

A decoding model attends most to its most recent tokens, and a quantizer's error there costs
the most: measured on SmolLM2 (1 window of the kv_quality protocol), int4 keys and values
give ΔPPL +7.6 % and KL 0.071 on their own and −0.3 % / KL 0.024 with the newest 128 rows in
fp16; int4 values alone go from KL 0.008 to 0.0017. KIVI and transformers' QuantizedCache
(``residual_length=128``) keep such a window too.

Layout, beside the inner buffer (which always holds every row's codes)::

    residual  fp16  [R, H, D]   copies of the R most recently written rows
    slot_cell int64 [R]         the cell each slot holds (-1: none), a ring in write order

A write encodes into the inner buffer as usual and copies its rows into the ring (a cell
written again moves to the newest slot); a read decodes the range and overlays the ring's
rows that fall in it. "Newest" is by write order over the whole cell pool: with many
sequences decoding together, each gets a share of the R slots.
"""

from __future__ import annotations

import torch

from kvcache.codecs.base import Buffer, Codec, Locs, tensor_bytes
from kvcache.errors import InvalidConfigError

RESIDUAL = torch.float16


class RecentBuffer(Buffer):
    def __init__(
        self, inner: Buffer, n: int, heads: int, dim: int, window: int, device: torch.device
    ):
        self.inner = inner
        self.window = min(window, n)
        self.residual = torch.zeros((self.window, heads, dim), dtype=RESIDUAL, device=device)
        self.slot_cell = torch.full((self.window,), -1, dtype=torch.int64, device=device)
        self.next = 0  # ring position of the next slot to fill

    def write(self, locs: Locs, x: torch.Tensor) -> None:
        self.inner.write(locs, x)
        if self.window == 0:
            return
        if isinstance(locs, slice):
            cells = torch.arange(locs.start, locs.stop, device=self.slot_cell.device)
        else:
            cells = locs.to(torch.int64)
        cells, x = cells[-self.window :], x[-self.window :]  # older rows would be overwritten
        n = len(cells)
        self.slot_cell[torch.isin(self.slot_cell, cells)] = -1  # rewritten cells move
        slots = (self.next + torch.arange(n, device=cells.device)) % self.window
        self.slot_cell[slots] = cells
        self.residual[slots] = x.to(RESIDUAL)
        self.next = (self.next + n) % self.window

    def read(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        out = self.inner.read(lo, hi, dtype)  # a decoded copy: safe to overwrite rows of
        sel = (self.slot_cell >= lo) & (self.slot_cell < hi)
        if bool(sel.any()):
            out[self.slot_cell[sel] - lo] = self.residual[sel].to(dtype)
        return out

    def gather(self, cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = self.inner.gather(cells, dtype)
        match = cells.to(torch.int64)[:, None] == self.slot_cell[None, :]  # [n, R]
        rows, slots = match.nonzero(as_tuple=True)
        if len(rows):
            out[rows] = self.residual[slots].to(dtype)
        return out

    def nbytes(self) -> int:
        return self.inner.nbytes() + tensor_bytes(self.residual, self.slot_cell)

    def __getattr__(self, name: str) -> object:
        if name == "inner":  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)  # the inner buffer's layout (codes, centre, ...)


class RecentCodec(Codec):
    """``inner``'s format plus the newest ``window`` rows in fp16 (``window=0``: none)."""

    def __init__(self, inner: Codec, window: int = 128) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise InvalidConfigError("recent", window, "an int >= 0")
        self.inner, self.window = inner, window
        self.name = inner.name if window == 128 else f"{inner.name}:recent={window}"
        self.pre_rope = inner.pre_rope

    def allocate(self, n: int, heads: int, dim: int, device: torch.device) -> Buffer:
        inner = self.inner.allocate(n, heads, dim, device)
        if self.window == 0:
            return inner
        return RecentBuffer(inner, n, heads, dim, self.window, device)

    def bytes_per_row(self, heads: int, dim: int) -> float:
        """One cell's codes and metadata; the fixed window is counted by ``nbytes``."""
        return self.inner.bytes_per_row(heads, dim)

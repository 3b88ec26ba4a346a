"""The newest rows of a quantized buffer also kept in fp16 (a "residual" window).

A decoding model attends most to its most recent tokens, and a quantizer's error there costs
the most: measured on SmolLM2 (1 window of the kv_quality protocol), int4 keys and values
give ΔPPL +7.6 % and KL 0.071 on their own and −0.3 % / KL 0.024 with the newest 128 rows in
fp16; int4 values alone go from KL 0.008 to 0.0017. KIVI and transformers' QuantizedCache
(``residual_length=128``) keep such a window too.

Layout, beside the inner buffer (which always holds every row's codes)::

    residual  fp16  [R, H, D]   copies of the R most recently written rows
    slot_cell int64 [R]         the cell each slot holds (-1: none), a ring in write order
                                (numpy: it is consulted on every read)

A write encodes into the inner buffer as usual and copies its rows into the ring (a cell
written again moves to the newest slot); a read decodes the range and overlays the ring's
rows that fall in it. "Newest" is by write order over the whole cell pool: with many
sequences decoding together, each gets a share of the R slots.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.codecs.base import Buffer, Codec, Locs, tensor_bytes
from kvcache.errors import InvalidConfigError

RESIDUAL = torch.float16


class RecentBuffer(Buffer):
    def __init__(
        self, inner: Buffer, n: int, heads: int, dim: int, window: int, device: torch.device
    ) -> None:
        self.inner = inner
        self.window = min(window, n)
        self.residual = torch.zeros((self.window, heads, dim), dtype=RESIDUAL, device=device)
        # slot -> cell (-1: none); numpy, as it is read on every call (counted in nbytes)
        self.slot_cell = np.full(self.window, -1, dtype=np.int64)
        self.next = 0  # ring position of the next slot to fill
        self.where: dict[int, int] = {}  # cell -> slot
        self.runs: list[tuple[int, int, int]] = []  # (slot, cell, count): consecutive both

    def write(self, locs: Locs, x: torch.Tensor) -> None:
        self.inner.write(locs, x)
        if self.window == 0:
            return
        if isinstance(locs, slice):
            cells = list(range(locs.start, locs.stop))
        else:
            cells = [int(c) for c in locs.tolist()]
        cells, x = cells[-self.window :], x[-self.window :]  # older rows would be overwritten
        for c in cells:  # a rewritten cell moves to the newest slot
            old = self.where.pop(c, None)
            if old is not None:
                self.slot_cell[old] = -1
        rows = x.to(RESIDUAL)
        for s0, n, r0 in _ring_runs(self.next, len(cells), self.window):
            for gone in self.slot_cell[s0 : s0 + n].tolist():
                if gone >= 0:
                    del self.where[gone]
            self.slot_cell[s0 : s0 + n] = cells[r0 : r0 + n]
            self.where.update(zip(cells[r0 : r0 + n], range(s0, s0 + n), strict=True))
            self.residual[s0 : s0 + n] = rows[r0 : r0 + n]
        self.next = (self.next + len(cells)) % self.window
        self.runs = _runs(self.slot_cell)

    def read(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        out = self.inner.read(lo, hi, dtype)  # a decoded copy: safe to overwrite rows of
        if len(self.runs) <= 16:  # one sequence decoding: 1 or 2 runs
            for slot, cell, n in self.runs:
                a, b = max(cell, lo), min(cell + n, hi)
                if a < b:
                    out[a - lo : b - lo] = self.residual[slot + a - cell : slot + b - cell]
            return out
        slots = np.flatnonzero((self.slot_cell >= lo) & (self.slot_cell < hi))
        if len(slots):
            rows = torch.from_numpy(self.slot_cell[slots] - lo)
            out[rows] = self.residual[torch.from_numpy(slots)].to(dtype)
        return out

    def gather(self, cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = self.inner.gather(cells, dtype)
        hits = [(i, self.where[c]) for i, c in enumerate(cells.tolist()) if c in self.where]
        if hits:
            rows, slots = (torch.tensor(v, dtype=torch.int64) for v in zip(*hits, strict=True))
            out[rows] = self.residual[slots].to(dtype)
        return out

    def nbytes(self) -> int:
        return self.inner.nbytes() + tensor_bytes(self.residual) + self.slot_cell.nbytes

    def __getattr__(self, name: str) -> object:
        if name == "inner":  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)  # the inner buffer's layout (codes, centre, ...)


def _runs(slot_cell: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal (slot, cell, count) runs where slots and cells both step by 1 (no -1 cells)."""
    used = slot_cell >= 0
    cont = np.zeros(len(slot_cell), dtype=bool)  # slot i continues the run of slot i - 1
    cont[1:] = (slot_cell[1:] - slot_cell[:-1] == 1) & used[1:] & used[:-1]
    starts = np.flatnonzero(used & ~cont)
    breaks = np.flatnonzero(~cont)  # a run from a start ends at the next break after it
    ends = np.append(breaks, len(slot_cell))[np.searchsorted(breaks, starts, side="right")]
    cells = slot_cell[starts]
    return list(zip(starts.tolist(), cells.tolist(), (ends - starts).tolist(), strict=True))


def _ring_runs(start: int, n: int, size: int) -> list[tuple[int, int, int]]:
    """(slot, count, row) runs that place ``n`` rows in a ring of ``size`` from ``start``."""
    first = min(n, size - start)
    return [(start, first, 0)] + ([(0, n - first, first)] if n > first else [])


class RecentCodec(Codec):
    """``inner``'s format plus the newest ``window`` rows in fp16 (``window=0``: none)."""

    def __init__(self, inner: Codec, window: int = 128) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise InvalidConfigError("recent", window, "an int >= 0")
        self.inner, self.window = inner, window
        self.name = inner.name
        self.pre_rope = inner.pre_rope

    def allocate(self, n: int, heads: int, dim: int, device: torch.device) -> Buffer:
        inner = self.inner.allocate(n, heads, dim, device)
        if self.window == 0:
            return inner
        return RecentBuffer(inner, n, heads, dim, self.window, device)

    def bytes_per_row(self, heads: int, dim: int) -> float:
        """One cell's codes and metadata; the fixed window is counted by ``nbytes``."""
        return self.inner.bytes_per_row(heads, dim)

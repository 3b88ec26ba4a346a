"""Per-forward read plan: which cells hold batch row b's keys for positions [begin, end).

transformers wants keys/values as ``[B, H, kv_len, D]`` whose column j is position
``begin + j`` of row b (``begin`` = the mask's kv_offset). The cell cache stores them
token-major, in cell order, rows interleaved::

    cells   0    1    2    3    4    5    6    7
    row/pos a0   a1   b0   b1   a2   b2   a3   b3      (a = row 0, b = row 1)
    table   row 0 -> [0, 1, 4, 6]   row 1 -> [2, 3, 5, 7]      (begin 0, end 4)

The plan is built once per forward (bookkeeping only, numpy) and applied to every layer of
the cache it was built for: a strided *view* of the cells when one row's cells are
contiguous and in position order (the common batch-1 case), else one ``index_select`` of
the cell range [lo, hi).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.causal import CausalCache


@dataclass(frozen=True)
class ReadPlan:
    """Cells [lo, hi) to read, and how to turn them into ``[B, H, kv_len, D]``."""

    lo: int
    hi: int
    rows: int
    length: int  # kv_len
    index: torch.Tensor | None  # [B * kv_len] cell - lo; None = cells [lo, hi) are row 0's

    @classmethod
    def build(cls, cache: CausalCache, seqs: Sequence[int], begin: int, end: int) -> ReadPlan:
        """Plan the read of positions [begin, end) of each row's sequence ``seqs[b]``."""
        length = end - begin
        table = np.empty((len(seqs), length), dtype=np.int64)  # [B, kv_len] cell indices
        for b, seq in enumerate(seqs):
            held = cache.cells_of(seq)  # by position
            pos = np.asarray(cache.positions(seq), dtype=np.int64)
            keep = (pos >= begin) & (pos < end)
            assert int(keep.sum()) == length, (
                f"row {b} (seq {seq}) holds {int(keep.sum())} of positions [{begin}, {end})"
            )
            table[b, pos[keep] - begin] = held[keep]  # positions are unique per sequence
        lo, hi = int(table.min()), int(table.max()) + 1
        if len(seqs) == 1 and hi - lo == length and bool((np.diff(table[0]) == 1).all()):
            return cls(lo, hi, 1, length, None)
        index = torch.from_numpy((table - lo).reshape(-1)).to(cache.device)
        return cls(lo, hi, len(seqs), length, index)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of cells [lo, hi) (``x``: [hi - lo, H, D]) as ``[B, H, kv_len, D]``."""
        if self.index is None:
            return x.unsqueeze(0).transpose(1, 2)  # [1, H, L, D], a view of the cells
        rows = x.index_select(0, self.index)  # [B * L, H, D]
        return rows.view(self.rows, self.length, *x.shape[1:]).transpose(1, 2)

"""Which cells each batch row attends to, as segments the kernels read once each.

A forward's rows (decode tokens, prompt chunks) see only their own sequence's cells, and of
those the positions in their visible interval [lo, hi] (causal, window, chunk rules). A
*segment* is a run of cells in position order read once for all its *entries* (a row and
its interval)::

    seq 0 (forked into 1, 2 by copy_prefix):  cells by position  [ shared prefix | own ]
    segment A  shared prefix of 0, 1, 2      entries: rows of 0, 1 and 2
    segments B, C, D  each sequence's own cells   entries: its rows

A row's result merges its entries' partial sums (softmax over all of them). Segments with
many entries (prompt chunks) go to the tile path (torch's fused kernel over decoded tiles);
the rest to the C++ kernel, long ones split so that every thread has work.
Bookkeeping only: numpy and small int tensors, built once per forward for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcache.cells import Cells

TILE_ROWS = 16  # segments with more entries than this attend through the tile path
MIN_PIECE = 512  # cells: long segments are split into pieces no shorter than this
ITEMS_PER_THREAD = 4  # aim for this many pieces (work items) per thread


@dataclass(frozen=True)
class RowBounds:
    """Who each batch row may see: its sequence and its visible positions [lo, hi]."""

    seqs: np.ndarray  # [T] int64
    lo: np.ndarray  # [T] int64
    hi: np.ndarray  # [T] int64


@dataclass(frozen=True)
class Tile:
    """A segment for the tile path: its cells and positions, and its entries' ids."""

    cells: np.ndarray  # [n] int64, by position
    pos: np.ndarray  # [n] int64
    entries: np.ndarray  # [e] ids into AttentionPlan.entries


@dataclass(frozen=True)
class AttentionPlan:
    """Segments of one forward (tensors as the C++ kernel takes them)."""

    rows: int  # T
    cells: torch.Tensor  # [C] int32: kernel segments' cells, concatenated
    pos: torch.Tensor  # [C] int32: their positions
    segs: torch.Tensor  # [S, 4] int64: cell_begin, cell_end, entry_begin, entry_end
    entries: torch.Tensor  # [E, 3] int64: row, lo, hi (kernel entries first, then tiles')
    kernel_entries: int  # entries [0, kernel_entries) belong to kernel segments
    tiles: tuple[Tile, ...]
    row_ptr: torch.Tensor  # [T + 1] int64: entries of row t are row_entries[ptr[t]:ptr[t+1]]
    row_entries: torch.Tensor  # [E] int64
    max_pos: int  # highest position read (sizes RoPE tables)

    @classmethod
    def build(cls, cells: Cells, bounds: RowBounds, kv_heads: int, threads: int) -> AttentionPlan:
        segments = _segments(cells, bounds)
        kernel = [s for s in segments if len(s[2]) <= TILE_ROWS]
        tiles = [s for s in segments if len(s[2]) > TILE_ROWS]
        kernel = _split(kernel, kv_heads, threads)
        return _assemble(kernel, tiles, bounds, len(bounds.seqs))


Segment = tuple[np.ndarray, np.ndarray, np.ndarray]  # cells, positions, batch rows


def _segments(cells: Cells, bounds: RowBounds) -> list[Segment]:
    """One segment per sequence's own cells, plus one per prefix shared in the batch."""
    _, first = np.unique(bounds.seqs, return_index=True)
    seqs = bounds.seqs[np.sort(first)].tolist()
    order = {s: cells.ordered(s) for s in seqs}
    rows = {s: np.flatnonzero(bounds.seqs == s) for s in seqs}
    out: list[Segment] = []
    for group in _fork_groups(cells, seqs, order):
        prefix = _common_prefix([order[s] for s in group]) if len(group) > 1 else 0
        if prefix:
            shared = order[group[0]][:prefix]
            out.append((shared, cells.pos[shared], np.concatenate([rows[s] for s in group])))
        for s in group:
            own = order[s][prefix:]
            out.append((own, cells.pos[own], rows[s]))
    return [_narrow(seg, bounds) for seg in out if len(seg[0])]


def _fork_groups(cells: Cells, seqs: list[int], order: dict[int, np.ndarray]) -> list[list[int]]:
    """Batch sequences grouped by a first cell they share (copy_prefix forks)."""
    groups: dict[int, list[int]] = {}
    alone: list[list[int]] = []
    for s in seqs:
        o = order[s]
        if len(o) and cells.refs[o[0]] > 1:
            groups.setdefault(int(o[0]), []).append(s)
        else:
            alone.append([s])
    return alone + list(groups.values())


def _common_prefix(orders: list[np.ndarray]) -> int:
    n = min(len(o) for o in orders)
    head = orders[0][:n]
    for o in orders[1:]:
        diff = np.flatnonzero(o[:n] != head[:n])
        n = int(diff[0]) if len(diff) else n
    return n


def _narrow(seg: Segment, bounds: RowBounds) -> Segment:
    """Only the cells some entry can see (positions are sorted within a segment)."""
    cells, pos, rows = seg
    a = int(np.searchsorted(pos, bounds.lo[rows].min(), side="left"))
    b = int(np.searchsorted(pos, bounds.hi[rows].max(), side="right"))
    return cells[a:b], pos[a:b], rows


def _split(segments: list[Segment], kv_heads: int, threads: int) -> list[Segment]:
    """Long segments in pieces, so that the pieces (the kernel's work items, every KV head
    each) keep every thread busy."""
    want = ITEMS_PER_THREAD * threads
    if len(segments) >= want or not segments:
        return segments
    total = sum(len(s[0]) for s in segments)
    piece = max(MIN_PIECE, -(-total // want))
    out: list[Segment] = []
    for cells, pos, rows in segments:
        for i in range(0, len(cells), piece):
            out.append((cells[i : i + piece], pos[i : i + piece], rows))
    return out


def _assemble(
    kernel: list[Segment], tiles: list[Segment], bounds: RowBounds, t: int
) -> AttentionPlan:
    seg_rows: list[list[int]] = []
    entry_rows: list[np.ndarray] = []
    c0 = e0 = 0
    for cells, _, rows in kernel:
        seg_rows.append([c0, c0 + len(cells), e0, e0 + len(rows)])
        entry_rows.append(rows)
        c0 += len(cells)
        e0 += len(rows)
    n_kernel = e0
    tile_list = []
    for cells, pos, rows in tiles:
        tile_list.append(Tile(cells, pos, np.arange(e0, e0 + len(rows))))
        entry_rows.append(rows)
        e0 += len(rows)
    rows_all = np.concatenate(entry_rows) if entry_rows else np.zeros(0, dtype=np.int64)
    entries = np.stack([rows_all, bounds.lo[rows_all], bounds.hi[rows_all]], axis=1)
    order = np.argsort(rows_all, kind="stable")  # entries of each row, for the merge
    row_ptr = np.zeros(t + 1, dtype=np.int64)
    np.add.at(row_ptr, rows_all + 1, 1)
    kcells = np.concatenate([s[0] for s in kernel]) if kernel else np.zeros(0, dtype=np.int64)
    kpos = np.concatenate([s[1] for s in kernel]) if kernel else np.zeros(0, dtype=np.int64)
    all_pos = [kpos] + [s[1] for s in tiles]
    top = max((int(p.max()) for p in all_pos if len(p)), default=0)
    return AttentionPlan(
        rows=t,
        cells=torch.from_numpy(kcells.astype(np.int32)),
        pos=torch.from_numpy(kpos.astype(np.int32)),
        segs=torch.tensor(seg_rows, dtype=torch.int64).reshape(-1, 4),
        entries=torch.from_numpy(np.ascontiguousarray(entries, dtype=np.int64)).reshape(-1, 3),
        kernel_entries=n_kernel,
        tiles=tuple(tile_list),
        row_ptr=torch.from_numpy(np.cumsum(row_ptr)),
        row_entries=torch.from_numpy(order.astype(np.int64)),
        max_pos=top,
    )

"""Cell bookkeeping: which token each cell holds and which sequences use it.

Bookkeeping only (ints in numpy arrays, no tensors): storage lives in ``storage.py``.

Layout, N cells and S sequence columns (a column per live sequence id)::

    cell      0     1     2     3     4     5
    pos     [ 0  ,  1  ,  0  ,  2  ,  ?  ,  1  ]
    seq 7   [ x  ,  x  ,  .  ,  x  ,  .  ,  .  ]   member[:, col(7)]
    seq 9   [ x  ,  .  ,  x  ,  .  ,  .  ,  x  ]   member[:, col(9)]
    refs    [ 2  ,  1  ,  1  ,  1  ,  0  ,  1  ]   cell 4 is free (stale pos kept)

Cell 0 is shared (``copy_prefix``); a cell is free when no sequence uses it. ``ranges``
holds, per sequence, a bounding box [lo, hi] of the cell indices that may hold it: it only
grows on placement and is recomputed exactly by eviction, ``remove`` and ``copy_prefix``.
An empty box (lo > hi) means "known sequence, no cells" (``copy_prefix`` of nothing).

``ordered(seq)`` lists a sequence's cells by position (seq 9 above: cells 0, 5, 2): the
order attention reads them in, whatever cells they landed in. Appending positions after the
last one (a decode step, a prompt chunk) extends the list in place; other changes rebuild it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EMPTY = (1, 0)  # an empty [lo, hi] box


@dataclass(frozen=True)
class Placement:
    """Where one batch goes: ``locs[i]`` is the cell of batch token i."""

    locs: np.ndarray  # [T] int64 cell indices, ascending
    contiguous: bool  # locs == range(locs[0], locs[0] + T)


class Cells:
    """Positions, sequence sets and per-sequence ranges of ``n`` cells."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = np.zeros(n, dtype=np.int64)  # [N] position of the token in each cell
        self.refs = np.zeros(n, dtype=np.int32)  # [N] number of sequences using each cell
        self.member = np.zeros((n, 4), dtype=bool)  # [N, S] cell c used by sequence column s
        self.cols: dict[int, int] = {}  # sequence id -> column of member
        self._spare: list[int] = list(range(3, -1, -1))  # unused columns (pop from the end)
        self.ranges: dict[int, tuple[int, int]] = {}  # sequence id -> [lo, hi] cell box
        self.max_pos: dict[int, int] = {}  # sequence id -> largest stored position (-1: none)
        self._order: dict[int, _Run] = {}  # sequence id -> its cells by position (lazy)

    # ---- sequences and columns -------------------------------------------------------
    def col(self, seq: int) -> int:
        """The member column of ``seq``, allocating one for a new sequence."""
        c = self.cols.get(seq)
        if c is None:
            if not self._spare:
                old = self.member.shape[1]
                self.member = np.concatenate([self.member, np.zeros_like(self.member)], axis=1)
                self._spare = list(range(2 * old - 1, old - 1, -1))
            c = self._spare.pop()
            self.cols[seq] = c
        return c

    def forget(self, seq: int) -> None:
        """Drop ``seq``'s range and column; it must hold no cell any more."""
        self.ranges.pop(seq, None)
        self.max_pos.pop(seq, None)
        self._order.pop(seq, None)
        c = self.cols.pop(seq, None)
        if c is not None:
            assert not self.member[:, c].any(), f"forgetting seq {seq} that still holds cells"
            self._spare.append(c)

    def cells_of(self, seq: int) -> np.ndarray:
        """Cell indices held by ``seq``, ascending (empty if none)."""
        lo, hi = self.ranges.get(seq, EMPTY)
        c = self.cols.get(seq)
        if c is None or lo > hi:
            return np.zeros(0, dtype=np.int64)
        return lo + np.flatnonzero(self.member[lo : hi + 1, c])

    def ordered(self, seq: int) -> np.ndarray:
        """Cell indices held by ``seq`` sorted by position (a view: do not modify)."""
        run = self._order.get(seq)
        if run is None:
            cells = self.cells_of(seq)
            run = _Run(cells[np.argsort(self.pos[cells], kind="stable")])
            self._order[seq] = run
        return run.view()

    def positions(self, seq: int) -> list[int]:
        """Sorted positions stored for ``seq``."""
        return sorted(int(p) for p in self.pos[self.cells_of(seq)])

    def free_count(self) -> int:
        return int(np.count_nonzero(self.refs == 0))

    # ---- mutation --------------------------------------------------------------------
    def occupy(self, locs: np.ndarray, positions: np.ndarray, seqs: np.ndarray) -> None:
        """Overwrite cells ``locs`` with (position, {sequence}); they must be free."""
        assert (self.refs[locs] == 0).all(), f"occupying used cells {locs[self.refs[locs] != 0]}"
        cols = np.array([self.col(int(s)) for s in seqs], dtype=np.int64)
        self.pos[locs] = positions
        self.member[locs, cols] = True
        self.refs[locs] = 1
        for s in np.unique(seqs):
            sel = seqs == s
            seq = int(s)
            self._extend(seq, int(locs[sel].min()), int(locs[sel].max()))
            run = self._order.get(seq)
            if run is not None and int(positions[sel].min()) > self.max_pos.get(seq, -1):
                new = locs[sel]
                run.append(new[np.argsort(positions[sel], kind="stable")])  # after the last
            else:
                self._order.pop(seq, None)  # rebuilt when next asked for
            top = int(positions[sel].max())
            self.max_pos[seq] = max(self.max_pos.get(seq, -1), top)

    def release(self, seq: int, cells: np.ndarray) -> None:
        """``seq`` stops using ``cells`` (which it must hold); its range is recomputed."""
        if len(cells) == 0:
            return
        c = self.cols[seq]
        assert self.member[cells, c].all(), f"seq {seq} does not hold all of {cells}"
        self.member[cells, c] = False
        self.refs[cells] -= 1
        self._order.pop(seq, None)
        self.recompute_range(seq)

    def share(self, seq: int, cells: np.ndarray) -> None:
        """``seq`` starts using ``cells`` too (prefix sharing); its range becomes their box."""
        c = self.col(seq)
        assert not self.member[cells, c].any(), f"seq {seq} already holds some of {cells}"
        self.member[cells, c] = True
        self.refs[cells] += 1
        self._order.pop(seq, None)
        self.ranges[seq] = (int(cells.min()), int(cells.max())) if len(cells) else EMPTY
        self.max_pos[seq] = int(self.pos[cells].max()) if len(cells) else -1

    def move(self, seq: int, cells: np.ndarray, offset: int | np.ndarray) -> None:
        """Shift the positions of ``cells`` (held by ``seq`` alone) by ``offset`` (one for
        all, or one per cell)."""
        assert (self.refs[cells] == 1).all(), f"moving shared cells {cells}"
        self.pos[cells] += offset
        self._order.pop(seq, None)
        self.recompute_range(seq)

    def recompute_range(self, seq: int) -> None:
        """Shrink ``seq``'s box to the cells it really holds (EMPTY if none)."""
        cells = self.cells_of(seq)
        self.ranges[seq] = (int(cells[0]), int(cells[-1])) if len(cells) else EMPTY
        self.max_pos[seq] = int(self.pos[cells].max()) if len(cells) else -1

    def _extend(self, seq: int, lo: int, hi: int) -> None:
        old_lo, old_hi = self.ranges.get(seq, EMPTY)
        if old_lo > old_hi:
            self.ranges[seq] = (lo, hi)
        else:
            self.ranges[seq] = (min(old_lo, lo), max(old_hi, hi))

    # ---- queries ---------------------------------------------------------------------
    def find_free(self, count: int, refs: np.ndarray | None = None) -> np.ndarray:
        """The ``count`` lowest-indexed free cells (fewer if there are not enough)."""
        r = self.refs if refs is None else refs
        return np.flatnonzero(r == 0)[:count]

    def check(self) -> None:
        """Assert every bookkeeping invariant (used by tests after each operation)."""
        counted = self.member.sum(axis=1)
        assert (counted == self.refs).all(), f"refs {self.refs} != member counts {counted}"
        used_cols = set(self.cols.values())
        assert len(used_cols) == len(self.cols), f"two sequences share a column: {self.cols}"
        for c in range(self.member.shape[1]):
            if c not in used_cols:
                assert not self.member[:, c].any(), f"unassigned column {c} holds cells"
        for seq, c in self.cols.items():
            held = np.flatnonzero(self.member[:, c])
            lo, hi = self.ranges.get(seq, EMPTY)
            if len(held):
                assert lo <= held[0] and held[-1] <= hi, f"seq {seq} cells {held} outside {lo, hi}"
            ps = self.pos[held]
            assert len(set(ps.tolist())) == len(ps), f"seq {seq} holds a position twice: {ps}"
            top = int(ps.max()) if len(ps) else -1
            assert self.max_pos.get(seq, -1) == top, f"seq {seq} max_pos {self.max_pos} != {top}"
            if seq in self._order:
                order = self._order[seq].view()
                want = held[np.argsort(ps, kind="stable")]
                assert np.array_equal(order, want), f"seq {seq} ordered {order} != {want}"


class _Run:
    """A growable int64 array (amortised O(1) appends): one sequence's cells by position."""

    def __init__(self, cells: np.ndarray) -> None:
        self._buf = np.array(cells, dtype=np.int64)
        self._len = len(cells)

    def append(self, cells: np.ndarray) -> None:
        need = self._len + len(cells)
        if need > len(self._buf):
            grown = np.empty(max(need, 2 * len(self._buf), 16), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : need] = cells
        self._len = need

    def view(self) -> np.ndarray:
        return self._buf[: self._len]

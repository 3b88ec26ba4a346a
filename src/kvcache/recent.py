"""Recent windows: which cells keep their rows in fp16, and when older rows become codes.

Bookkeeping only (ints and bools in numpy arrays); the buffers of ``kvcache.codecs`` hold
the rows. A quantizing codec keeps each sequence's newest ``window`` rows (by position) in
fp16 and encodes ("seals") the older ones, ``group`` consecutive rows of one sequence at a
time (1 for per-row codecs; 64 for KIVI keys, quantized per channel over 64 tokens), and
``batch`` rows at a time: a decode step then only copies its row into the window, and a
buffer encodes once every ``batch`` steps (so a window holds ``window`` to
``window + batch - 1`` rows)::

    seq 3 positions   0 ... 63 | 64 ... 127 | 128 ............ 255     window 128, group 64
    state             sealed   |  sealed    |  open (fp16 rows)
                      group a  |  group b   |

Everything is per sequence, so a sequence's codes and metadata do not depend on which other
sequences share the pool or the batch, and a window never holds more rows than its history.
A cell shared by several sequences (``copy_prefix``) is sealed by whichever passes it first.

Metadata ("meta", one id per record, shared by all layers; each layer's buffer holds its own
values under that id):

    kind       one record per                      holds (in the buffers)
    none       -                                   -
    sequence   sequence (inherited by copy_prefix)  a key centre (int4, turbo keys)
    group      sealed group                         per-channel ranges (KIVI keys)

A fresh record's values come from ``basis``: the rows a buffer averages or ranges over.

Slots: an open row lives in fp16 slot ``slot_of[cell]`` of every layer's buffer (slots are
assigned here, once for all layers). A plan records the slots its sealed rows had, since a
layer reads them (to encode) before it writes the plan's kept rows, which may reuse them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kvcache.cells import Cells

META_KINDS = ("none", "sequence", "group")
SEAL_BATCH = 32  # rows of a sequence sealed together (a multiple of the codec's group)


@dataclass(frozen=True)
class SealGroup:
    """Rows encoded together in one forward."""

    cells: np.ndarray  # [n] cells, by position
    slots: np.ndarray  # [n] their fp16 slots before this forward (-1: a new row)
    meta: int  # metadata id of these rows (-1: none)
    fresh: bool  # ``meta`` is new: its values come from the rows of ``basis``
    basis: np.ndarray  # [m] cells (old open rows or this forward's new rows)
    basis_slots: np.ndarray  # [m] their slots (-1: new)
    rows: np.ndarray  # [n] the forward's token (row of K/V) of each new cell (-1: old)
    basis_rows: np.ndarray  # [m] the same for ``basis``

    @cached_property
    def basis_source(self) -> RowSource:
        """Where the rows of ``basis`` are read from (built once for every layer)."""
        return RowSource.of(self.basis_slots, self.basis_rows)


@dataclass(frozen=True)
class RowSource:
    """Where rows to encode are read from, as index tensors: a row of this forward's K/V
    (``new_rows``, to places ``new_at`` of the result) or a window slot (``old_slots``, to
    ``old_at``). Built once per plan, used by every layer's buffers."""

    count: int
    new_at: torch.Tensor
    new_rows: torch.Tensor
    old_at: torch.Tensor
    old_slots: torch.Tensor

    @classmethod
    def of(cls, slots: np.ndarray, rows: np.ndarray) -> RowSource:
        """Rows with window ``slots`` (-1: none) or, where none, the forward's ``rows``."""
        new = slots < 0
        assert (rows[new] >= 0).all(), "a sealed row neither new nor in a window"

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a.astype(np.int64))

        return cls(
            len(slots),
            t(np.flatnonzero(new)),
            t(rows[new]),
            t(np.flatnonzero(~new)),
            t(slots[~new]),
        )


@dataclass(frozen=True)
class Sealed:
    """Every row a plan encodes, its groups' parts concatenated (built once per plan)."""

    cells: np.ndarray  # [n]
    at: torch.Tensor  # [n] the same, int64
    metas: np.ndarray  # [n] metadata id of each (-1: none)
    source: RowSource

    @property
    def top(self) -> int:
        """1 + the highest cell."""
        return int(self.cells.max()) + 1


@dataclass(frozen=True)
class SealPlan:
    """What one forward does to a codec's fp16 windows (the same for every layer)."""

    keep: np.ndarray  # new cells whose rows stay in fp16
    keep_slots: np.ndarray  # their slots
    groups: tuple[SealGroup, ...]  # rows to encode now
    keep_rows: np.ndarray  # [len(keep)] the forward's token (row of K/V) of each kept cell

    @classmethod
    def everything(cls, cells: np.ndarray) -> SealPlan:
        """Encode every new row with no metadata (a reserve forward's allocation only)."""
        none = cells[:0]
        rows = np.arange(len(cells))
        group = SealGroup(cells, np.full(len(cells), -1), -1, False, none, none, rows, none)
        return cls(none, none, (group,), none.astype(np.int64))

    @cached_property
    def sealed(self) -> Sealed:
        """The groups' rows together (call only with groups)."""
        cells = np.concatenate([g.cells for g in self.groups])
        slots = np.concatenate([g.slots for g in self.groups])
        rows = np.concatenate([g.rows for g in self.groups])
        metas = np.concatenate([np.full(len(g.cells), g.meta) for g in self.groups])
        at = torch.from_numpy(cells.astype(np.int64))
        return Sealed(cells, at, metas, RowSource.of(slots, rows))

    @cached_property
    def keep_index(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The kept rows as every layer's buffers copy them: the K/V rows to take (None: the
        first ``len(keep)`` in order, as in a decode step) and the window slots they go to."""
        rows = self.keep_rows
        every = np.array_equal(rows, np.arange(len(rows)))
        src = None if every else torch.from_numpy(rows.astype(np.int64))
        return src, torch.from_numpy(self.keep_slots.astype(np.int64))


@dataclass(frozen=True)
class WindowSpec:
    """A codec's window: rows kept per sequence, rows sealed together, metadata kind."""

    window: int
    group: int = 1
    meta: str = "none"
    batch: int = SEAL_BATCH

    def __post_init__(self) -> None:
        assert self.window >= 0 and self.group >= 1, f"bad window spec {self}"
        assert self.batch % self.group == 0, f"batch {self.batch} not a multiple of group"
        assert self.meta in META_KINDS, f"meta kind {self.meta!r} not in {META_KINDS}"


@dataclass(frozen=True)
class WindowState:
    """One sequence's part of a :class:`Windows` (what a snapshot keeps): per cell by
    position whether its row is open and its metadata record, records numbered locally."""

    open: np.ndarray  # [n] bool: row held in fp16
    record: np.ndarray  # [n] int32: local record of a sealed row (-1: none)
    sequence: int  # local record of the sequence itself (-1: none)
    count: int  # records 0 .. count-1


class Windows:
    """The fp16 windows and metadata ids of one :class:`WindowSpec` over ``n`` cells."""

    def __init__(self, n: int, spec: WindowSpec) -> None:
        self.spec = spec
        self.open = np.zeros(n, dtype=bool)  # [N] row held in fp16
        self.slot_of = np.full(n, -1, dtype=np.int32)  # [N] its fp16 slot (-1: none)
        self._used = np.zeros(0, dtype=bool)  # [slots] slot holds a row
        self.slots = 0  # 1 + the highest slot in use: every layer's window has this many rows
        self.meta_of = np.full(n, -1, dtype=np.int32)  # [N] metadata id of a sealed row
        self.seq_meta: dict[int, int] = {}  # sequence -> its record (kind "sequence")
        self._users = np.zeros(0, dtype=np.int64)  # [M] cells + sequences using each record
        self._spare: list[int] = []

    # ---- planning (start_forward) ------------------------------------------------------
    def plan(self, cells: Cells, locs: np.ndarray, seqs: np.ndarray) -> SealPlan:
        """Seal what the forward that placed ``locs`` (of ``seqs``) pushes out of windows.

        Call after the cells are occupied; commits the new state (the plan is then applied
        to every layer's buffers by their puts).
        """
        row_of = np.full(len(self.open), -1, dtype=np.int64)  # cell -> its token in the forward
        row_of[locs] = np.arange(len(locs))
        is_new = row_of >= 0
        keep: list[np.ndarray] = []
        groups: list[SealGroup] = []
        claimed = np.zeros(len(self.open), dtype=bool)  # sealed earlier in this forward
        _, first = np.unique(seqs, return_index=True)
        for seq in seqs[np.sort(first)].tolist():
            new = int(np.count_nonzero(seqs == seq))
            order = cells.ordered(seq)
            tail = order[-(self.spec.window + self.spec.batch + new) :]
            cand = tail[(self.open[tail] | is_new[tail]) & ~claimed[tail]]  # by position
            excess = len(cand) - self.spec.window
            b = self.spec.batch
            sealing = cand[: max(excess // b * b, 0)]
            claimed[sealing] = True
            if len(sealing):
                groups.extend(self._groups(seq, sealing, cand, row_of))
            keep.append(cand[len(sealing) :][is_new[cand[len(sealing) :]]])
        kept = np.concatenate(keep) if keep else locs[:0]
        for group in groups:
            self.open[group.cells] = False
            self._set_meta(group.cells, group.meta)
            self._free(group.cells)
        self.open[kept] = True
        return SealPlan(kept, self._assign(kept), tuple(groups), row_of[kept])

    def _groups(
        self, seq: int, sealing: np.ndarray, cand: np.ndarray, row_of: np.ndarray
    ) -> list[SealGroup]:
        kind = self.spec.meta
        slots = self.slot_of[sealing].copy()
        rows = row_of[sealing]
        if kind == "none":
            return [SealGroup(sealing, slots, -1, False, sealing[:0], slots[:0], rows, rows[:0])]
        if kind == "sequence":
            meta = self.seq_meta.get(seq)
            fresh = meta is None
            if meta is None:
                meta = self._new_meta()
                self.seq_meta[seq] = meta
                self._users[meta] += 1  # the sequence itself
            basis = cand if fresh else cand[:0]
            basis_slots = self.slot_of[basis].copy()
            return [SealGroup(sealing, slots, meta, fresh, basis, basis_slots, rows, row_of[basis])]
        g = self.spec.group
        out = []
        for i in range(0, len(sealing), g):
            part, part_slots, part_rows = sealing[i : i + g], slots[i : i + g], rows[i : i + g]
            meta = self._new_meta()
            out.append(
                SealGroup(part, part_slots, meta, True, part, part_slots, part_rows, part_rows)
            )
        return out

    # ---- changes -----------------------------------------------------------------------
    def release(self, cells: np.ndarray) -> None:
        """``cells`` became free: their rows and metadata go."""
        if len(cells) == 0:
            return
        self.open[cells] = False
        self._set_meta(cells, -1)
        self._free(cells)

    def share(self, src: int, dst: int) -> None:
        """``dst`` continues ``src`` (``copy_prefix``): it inherits src's record."""
        self.forget(dst)
        meta = self.seq_meta.get(src)
        if meta is not None:
            self.seq_meta[dst] = meta
            self._users[meta] += 1

    def forget(self, seq: int) -> None:
        """``seq`` holds no cell any more."""
        meta = self.seq_meta.pop(seq, None)
        if meta is not None:
            self._drop_user(meta)

    # ---- snapshots ---------------------------------------------------------------------
    def export(self, seq: int, cells: np.ndarray) -> tuple[WindowState, np.ndarray]:
        """``seq``'s state over its ``cells`` (by position), and the global ids of its records."""
        metas = self.meta_of[cells]
        own = self.seq_meta.get(seq, -1)
        ids = np.unique(np.concatenate([metas[metas >= 0], [own] if own >= 0 else []]))
        ids = ids.astype(np.int64)
        local = np.where(metas >= 0, np.searchsorted(ids, metas), -1).astype(np.int32)
        seq_local = int(np.searchsorted(ids, own)) if own >= 0 else -1
        return WindowState(self.open[cells].copy(), local, seq_local, len(ids)), ids

    def problem(self, state: WindowState) -> str | None:
        """What makes ``state`` impossible for this spec (None: it can be adopted)."""
        rec, open_ = state.record, state.open
        if rec.min(initial=0) < -1 or rec.max(initial=-1) >= state.count:
            return f"record ids outside [-1, {state.count})"
        if (rec[open_] >= 0).any():
            return "open rows with a record"
        if self.spec.meta == "none" and (state.count or state.sequence >= 0):
            return f"records for a window of kind {self.spec.meta!r}"
        if self.spec.meta != "none" and (rec[~open_] < 0).any():
            return "sealed rows without a record"
        if not -1 <= state.sequence < state.count:
            return f"sequence record {state.sequence} outside [-1, {state.count})"
        used = set(rec[rec >= 0].tolist()) | ({state.sequence} - {-1})
        if used != set(range(state.count)):
            return f"records {sorted(used)} are not 0..{state.count - 1}"
        if int(np.count_nonzero(open_)) > max(self.spec.window + self.spec.batch - 1, 0):
            return f"{int(np.count_nonzero(open_))} open rows, more than the window holds"
        return None

    def adopt(self, seq: int, cells: np.ndarray, state: WindowState) -> np.ndarray:
        """``seq``'s new ``cells`` (free until now) take ``state``: open rows get slots,
        records get fresh ids (returned, by local id)."""
        ids = np.array([self._new_meta() for _ in range(state.count)], dtype=np.int64)
        for i, meta in enumerate(ids.tolist()):
            self._set_meta(cells[state.record == i], meta)
        if state.sequence >= 0:
            meta = int(ids[state.sequence])
            self.seq_meta[seq] = meta
            self._users[meta] += 1
        opened = cells[state.open]
        self.open[opened] = True
        self._assign(opened)
        return ids

    # ---- slots -------------------------------------------------------------------------
    def _assign(self, cells: np.ndarray) -> np.ndarray:
        """Slots for ``cells``: the lowest free ones, so windows stay as small as their rows."""
        free = np.flatnonzero(~self._used[: self.slots])[: len(cells)]
        extra = np.arange(self.slots, self.slots + len(cells) - len(free))
        slots = np.concatenate([free, extra]).astype(np.int32)
        if len(extra):
            self.slots += len(extra)
            if self.slots > len(self._used):
                self._used = np.concatenate([self._used, np.zeros(self.slots, dtype=bool)])
        self._used[slots] = True
        self.slot_of[cells] = slots
        return slots

    def _free(self, cells: np.ndarray) -> None:
        held = cells[self.slot_of[cells] >= 0]
        if len(held) == 0:
            return
        self._used[self.slot_of[held]] = False
        self.slot_of[held] = -1
        used = np.flatnonzero(self._used[: self.slots])
        self.slots = int(used[-1]) + 1 if len(used) else 0  # drop free slots at the top

    # ---- metadata ids ------------------------------------------------------------------
    def _new_meta(self) -> int:
        if self._spare:
            return self._spare.pop()
        meta = len(self._users)
        self._users = np.append(self._users, 0)
        return meta

    def _set_meta(self, cells: np.ndarray, meta: int) -> None:
        old = self.meta_of[cells]
        for m in old[old >= 0].tolist():
            self._drop_user(m)
        self.meta_of[cells] = meta
        if meta >= 0:
            self._users[meta] += len(cells)

    def _drop_user(self, meta: int) -> None:
        self._users[meta] -= 1
        assert self._users[meta] >= 0, f"metadata {meta} released too often"
        if self._users[meta] == 0:
            self._spare.append(meta)

    def meta_capacity(self) -> int:
        """Number of metadata ids ever handed out (buffers size their records by it)."""
        return len(self._users)

    def check(self, cells: Cells) -> None:
        """Assert the invariants (tests call it after every operation)."""
        free = cells.refs == 0
        assert not self.open[free].any(), f"free cells open: {np.flatnonzero(self.open & free)}"
        assert (self.meta_of[free] == -1).all(), "free cells keep metadata"
        assert not (self.open & (self.meta_of >= 0)).any(), "open rows with sealed metadata"
        assert np.array_equal(self.open, self.slot_of >= 0), "open rows without a slot"
        used = self.slot_of[self.slot_of >= 0]
        assert len(set(used.tolist())) == len(used), "two rows share a slot"
        assert np.array_equal(np.sort(used), np.flatnonzero(self._used)), "slot map != used slots"
        assert self.slots == (int(used.max()) + 1 if len(used) else 0), "slots not trimmed"
        for seq in cells.ranges:
            held = cells.ordered(seq)
            n_open = int(np.count_nonzero(self.open[held]))
            slack = self.spec.window + self.spec.batch - 1
            assert n_open <= max(slack, 0), f"seq {seq} keeps {n_open} open rows > {slack}"

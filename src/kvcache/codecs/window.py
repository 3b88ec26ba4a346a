"""Quantized buffers with a recent window: rows stay in fp16 while they are among their
sequence's newest, and are encoded when the cache's plan seals them (``kvcache.recent``).

Layout beside a subclass's codes::

    residual  fp16 [R, H, D]   rows of open cells, at slot ``windows.slot_of[cell]``; R grows
                               with the slots in use and shrinks to them once they have
                               stayed under half of R for SHRINK_AFTER stores in a row
    codes...  [N', ...]        allocated up to the highest encoded cell (N' <= N), so a cache
                               whose rows all fit in their windows holds no codes at all

Every row is rounded to fp16 before it is encoded, whether it was sealed at once (a long
prompt) or after a stay in the window: a row's codes do not depend on when it was sealed.
The slot and metadata maps are the bookkeeping's (shared by every layer, counted once by
the cache, not here).
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from kvcache.codecs.base import (
    Buffer,
    Layout,
    Locs,
    RotaryFrame,
    RowFormat,
    capacity,
    tensor_bytes,
)
from kvcache.kernels.rows import put_rows
from kvcache.recent import RowSource, SealPlan, Windows

RESIDUAL = torch.float16
# Stores in a row with under half the window's rows in use before it shrinks. Rows wait in
# the window until a batch of a sequence's rows is sealed at once (``kvcache.recent``), so
# sequences decoding together empty it every batch of steps and fill it again: shrinking at
# every low and growing back reallocated the window most steps (int8, 16 sequences: 1,680
# reallocations in 64 steps of 30 layers' K and V). More than a seal batch of steps.
SHRINK_AFTER = 64


def cell_index(cells: Locs) -> np.ndarray:
    """Cell ids of ``cells`` as an int64 numpy array."""
    if isinstance(cells, slice):
        return np.arange(cells.start, cells.stop, dtype=np.int64)
    return cells.cpu().numpy().astype(np.int64, copy=False)


class WindowedBuffer(Buffer):
    """Codes plus the fp16 window rows of one layer's K or V (subclasses encode).

    ``CELL_FIELDS`` name the attributes holding per-cell codes ([N', ...]) and
    ``RECORD_FIELDS`` those holding per-record metadata ([M, ...], None when unused): what a
    snapshot copies besides the window rows.
    """

    CELL_FIELDS: tuple[str, ...] = ("codes", "scale")
    RECORD_FIELDS: tuple[str, ...] = ()

    def __init__(
        self, n: int, heads: int, dim: int, windows: Windows, device: torch.device
    ) -> None:
        self.n, self.heads, self.dim = n, heads, dim
        self.windows = windows
        self.spec = windows.spec
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.residual = torch.zeros((0, heads, dim), dtype=RESIDUAL, device=device)
        self.underused = 0  # stores in a row with under half the window's rows in use
        self.rows = 0  # cells with codes allocated (the codes tensors' first dimension)

    def index(self, a: np.ndarray) -> torch.Tensor:
        """A numpy array as a tensor on the buffer's device (shared memory on the CPU)."""
        return self.on_device(torch.from_numpy(a))

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor on the buffer's device (itself on the CPU)."""
        return t if self.on_cpu else t.to(self.device)

    # ---- what subclasses provide ----------------------------------------------------------
    @abstractmethod
    def _allocate(self, rows: int) -> None:
        """Grow every per-cell code tensor to ``rows`` rows (keeping their contents)."""

    def _fresh(  # noqa: B027 - optional hook
        self, meta: int, basis: torch.Tensor, cells: np.ndarray
    ) -> None:
        """Set record ``meta`` from the rows ``basis`` [m, H, D] of ``cells`` (codecs with
        records)."""

    @abstractmethod
    def _encode(self, cells: torch.Tensor, x: torch.Tensor, metas: np.ndarray) -> None:
        """Encode rows ``x`` [n, H, D] (float32, fp16-exact) into ``cells`` [n], row i with
        metadata record ``metas[i]`` (-1: none); one call encodes a whole seal plan."""

    @abstractmethod
    def _decode(self, cells: np.ndarray) -> torch.Tensor:
        """Encoded rows of ``cells`` (all < self.rows) as float32 [n, H, D]."""

    @abstractmethod
    def _code_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of codes and metadata (for nbytes)."""

    # ---- Buffer ---------------------------------------------------------------------------
    def store(self, locs: torch.Tensor, x: torch.Tensor, plan: SealPlan | None) -> None:
        if plan is None:
            plan = SealPlan.everything(cell_index(locs))
        if plan.groups:  # read every sealed row before a kept row reuses its slot
            values = x.to(RESIDUAL).float()  # [T, H, D]: what is encoded (fp16-exact)
            for group in plan.groups:
                if group.fresh and len(group.basis):
                    basis = self._rows(group.basis_source, values)
                    self._fresh(group.meta, basis, group.basis)
            sealed = plan.sealed
            self._reserve(sealed.top)
            self._encode(self.on_device(sealed.at), self._rows(sealed.source, values), sealed.metas)
        self._fit_window()
        if len(plan.keep):  # decode steps: one copy of every row into its slot, as fp16
            src, to = plan.keep_index  # K/V rows (None: the first len(to)), window slots
            put_rows(
                self.residual, self.on_device(to), x, None if src is None else self.on_device(src)
            )

    def rewrite(self, cells: torch.Tensor, x: torch.Tensor) -> None:
        idx = cell_index(cells)
        slots = self.windows.slot_of[idx]
        rows = x.to(RESIDUAL)
        open_ = slots >= 0
        if open_.any():
            at = self.index(slots[open_].astype(np.int64))
            self.residual.index_copy_(0, at, rows[self.index(open_)])
        coded = ~open_
        if coded.any():
            sel = self.index(coded)
            self._reencode(idx[coded], rows[sel].float())

    def _reencode(self, cells: np.ndarray, x: torch.Tensor) -> None:
        """Encode new rows into sealed cells with the metadata they already have."""
        at = self.index(cells)
        self._encode(at, x, self.windows.meta_of[cells])

    def decode(self, cells: Locs, dtype: torch.dtype) -> torch.Tensor:
        idx = cell_index(cells)
        out = torch.zeros((len(idx), self.heads, self.dim), dtype=torch.float32, device=self.device)
        slots = self.windows.slot_of[idx]
        open_ = slots >= 0
        coded = ~open_ & (idx < self.rows)  # neither: a free cell never encoded (zeros)
        if coded.any():
            out[self.index(coded)] = self._decode(idx[coded])
        if open_.any():
            at = self.index(slots[open_].astype(np.int64))
            out[self.index(open_)] = self.residual[at].float()
        return out.to(dtype)

    def window_layout(self, layout: Layout) -> Layout:
        """``layout`` with this buffer's window (slot map and rows) filled in."""
        layout.window = torch.from_numpy(self.windows.slot_of)
        layout.residual = self.residual
        return layout

    def nbytes(self) -> int:
        return tensor_bytes(self.residual, *self._code_tensors())

    # ---- snapshots ------------------------------------------------------------------------
    def _fields(self, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        found = {n: getattr(self, n) for n in names}
        return {n: t for n, t in found.items() if t is not None}

    def export_rows(self, cells: np.ndarray, records: np.ndarray) -> dict[str, torch.Tensor]:
        slots = self.windows.slot_of[cells]
        open_ = slots >= 0
        sealed = self.index(cells[~open_])
        out = {n: t.index_select(0, sealed) for n, t in self._fields(self.CELL_FIELDS).items()}
        out["residual"] = self.residual.index_select(0, self.index(slots[open_].astype(np.int64)))
        rec = self.index(records.astype(np.int64))
        for n, t in self._fields(self.RECORD_FIELDS).items():
            out[f"record.{n}"] = t.index_select(0, rec)
        return out

    def row_formats(self, sealed: int, open_: int, records: int) -> dict[str, RowFormat]:
        out = {
            n: (t.dtype, (sealed, *t.shape[1:])) for n, t in self._fields(self.CELL_FIELDS).items()
        }
        out["residual"] = (RESIDUAL, (open_, self.heads, self.dim))
        for n, t in self._fields(self.RECORD_FIELDS).items():
            out[f"record.{n}"] = (t.dtype, (records, *t.shape[1:]))
        return out

    def import_rows(
        self, cells: np.ndarray, records: np.ndarray, rows: dict[str, torch.Tensor]
    ) -> None:
        slots = self.windows.slot_of[cells]
        open_ = slots >= 0
        sealed = cells[~open_]
        if len(sealed):
            self._reserve(int(sealed.max()) + 1)
        at = self.index(sealed)
        for n, t in self._fields(self.CELL_FIELDS).items():
            t.index_copy_(0, at, rows[n].to(self.device))
        rec = self.index(records.astype(np.int64))
        for n, t in self._fields(self.RECORD_FIELDS).items():
            grown_t = self.meta_rows(t)
            grown_t.index_copy_(0, rec, rows[f"record.{n}"].to(self.device))
            setattr(self, n, grown_t)
        self._fit_window()
        kept = self.index(slots[open_].astype(np.int64))
        self.residual.index_copy_(0, kept, rows["residual"].to(self.device))

    # ---- helpers --------------------------------------------------------------------------
    def _rows(self, source: RowSource, values: torch.Tensor) -> torch.Tensor:
        """float32 rows [n, H, D] from ``source``: this forward's ``values`` [T, H, D] or
        window slots."""
        d = self.on_device
        if len(source.new_rows) == 0:  # a decode step's seal: all from the window
            return self.residual.index_select(0, d(source.old_slots)).float()
        new = values.index_select(0, d(source.new_rows))
        if len(source.old_slots) == 0:  # a prompt's rows
            return new
        out = torch.empty((source.count, self.heads, self.dim), device=self.device)
        out.index_copy_(0, d(source.new_at), new)
        old = self.residual.index_select(0, d(source.old_slots)).float()
        return out.index_copy_(0, d(source.old_at), old)

    def _reserve(self, rows: int) -> None:
        if rows > self.rows:
            rows = capacity(rows, self.rows, self.n)
            self._allocate(rows)
            self.rows = rows

    def _fit_window(self) -> None:
        """Window rows for every slot in use; shrunk to them when under half of it has been
        in use for more than SHRINK_AFTER stores in a row."""
        want = self.windows.slots
        have = self.residual.shape[0]
        self.underused = self.underused + 1 if want < have // 2 else 0
        if want > have or self.underused > SHRINK_AFTER:
            self.underused = 0
            rows = want if want < have else capacity(want, have, self.n, step=16)
            out = torch.zeros((rows, self.heads, self.dim), dtype=RESIDUAL, device=self.device)
            keep = min(rows, have)
            out[:keep] = self.residual[:keep]
            self.residual = out

    def meta_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [M, ...] grown to the bookkeeping's number of metadata records."""
        need = self.windows.meta_capacity()
        if t.shape[0] >= need:
            return t
        out = torch.zeros((capacity(need, t.shape[0], 1 << 30, step=8), *t.shape[1:]),
                          dtype=t.dtype, device=t.device)  # fmt: skip
        out[: t.shape[0]] = t
        return out


class CentredBuffer(WindowedBuffer):
    """A windowed buffer whose rows may be encoded minus their sequence's key centre
    (``centre``: fp16 [M, H, D], one record per sequence, the mean of its rows when it first
    seals some; any fixed offset round-trips, and the kernels add it back per row). With a
    ``frame`` (keys after RoPE, see RotaryFrame) the centre is the mean of the un-rotated
    rows, and a row's centre is rotated to its position."""

    RECORD_FIELDS = ("centre",)

    def __init__(
        self,
        n: int,
        heads: int,
        dim: int,
        windows: Windows,
        device: torch.device,
        centred: bool,
        frame: RotaryFrame | None = None,
    ) -> None:
        super().__init__(n, heads, dim, windows, device)
        self.centre = (
            torch.zeros((0, heads, dim), dtype=RESIDUAL, device=device) if centred else None
        )
        self.frame = frame if centred else None

    def _fresh(self, meta: int, basis: torch.Tensor, cells: np.ndarray) -> None:
        if self.centre is not None:  # the sequence's key centre: the mean of its rows now
            if self.frame is not None:
                basis = self.frame.rotate(basis, cells, -1)
            self.centre = self.meta_rows(self.centre)
            self.centre[meta] = basis.mean(dim=0).to(RESIDUAL)

    def _centres(self, metas: np.ndarray, cells: np.ndarray) -> torch.Tensor:
        """float32 [n, H, D]: the centre of record ``metas[i]`` as row ``cells[i]`` has it."""
        assert self.centre is not None
        c = self.centre[self.index(metas.astype(np.int64))].float()
        return c if self.frame is None else self.frame.rotate(c, cells)

    def centred(self, x: torch.Tensor, metas: np.ndarray, cells: torch.Tensor) -> torch.Tensor:
        """Rows ``x`` [n, H, D] of ``cells`` to encode, minus the centre of record
        ``metas[i]``."""
        if self.centre is None:
            return x
        return x - self._centres(metas, cell_index(cells))

    def uncentred(self, x: torch.Tensor, cells: np.ndarray) -> torch.Tensor:
        """Decoded rows ``x`` [n, H, D] of ``cells`` plus their centre (in place)."""
        if self.centre is not None:
            x.add_(self._centres(self.windows.meta_of[cells], cells))
        return x

    def centred_layout(self, layout: Layout) -> Layout:
        """``layout`` with the centre records and each cell's record id, then the window."""
        if self.centre is not None:
            layout.meta_of = torch.from_numpy(self.windows.meta_of)
            layout.meta_a = self.centre
            layout.centre_rope = self.frame is not None
        return self.window_layout(layout)

    def centre_tensors(self) -> tuple[torch.Tensor, ...]:
        """The centre records, if any (for nbytes)."""
        return (self.centre,) if self.centre is not None else ()

"""One forward's plan: where its tokens went and what each row may see, shared by every layer.

``CausalCache.start_forward`` builds it; ``cache.plan`` hands it out. It is valid until the
cache changes (the next ``start_forward``, ``remove`` or ``copy_prefix``). The cheap parts
are built at once, the rest the first time a layer asks:

    positions [T], sequences [T], cells [T]   the batch's tokens and the cells they landed in
    bounds()                                  visible positions [lo, hi] of each row
    history(), mask()                         ``get``'s cell range and its [T, L] bool mask
    attention_plan()                          the segments the attention kernels read
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

import numpy as np
import torch

from kvcache.kernels.plan import AttentionPlan, RowBounds
from kvcache.storage import Seals

if TYPE_CHECKING:
    from kvcache.causal import CausalCache

T = TypeVar("T")
_PLACEMENT = ("cells", "positions", "negated", "unrotation", "history")  # not visibility


class ForwardPlan:
    """The placement and visibility of one forward (see the module docstring)."""

    def __init__(
        self,
        cache: CausalCache,
        positions: np.ndarray,
        sequences: np.ndarray,
        cells: np.ndarray,
        reserve: bool,
        seals: Seals,
    ) -> None:
        self._cache = cache
        self.positions = positions  # [T] int64
        self.sequences = sequences  # [T] int64
        self.cells = cells  # [T] int64, ascending
        self.reserve = reserve
        self.seals = seals
        self.causal_rows = np.ones(len(positions), dtype=bool)  # False: set_causal exemption
        self.kernel_reason = cache.kernel_reason()  # why not the kernels (None: they may)
        self._lazy: dict[object, object] = {}

    def set_causal_rows(self, rows: np.ndarray) -> None:
        """Rows exempt from causality (False) changed: masks and reads follow."""
        if not np.array_equal(rows, self.causal_rows):
            self.causal_rows = rows
            self._lazy = {k: v for k, v in self._lazy.items() if k in _PLACEMENT}

    def _get(self, key: object, make: Callable[[], T]) -> T:
        """The value under ``key``, made on first use."""
        if key not in self._lazy:
            self._lazy[key] = make()
        return cast(T, self._lazy[key])

    # ---- tensors -------------------------------------------------------------------------
    def cells_tensor(self) -> torch.Tensor:
        """Cells of the batch tokens [T] (int64, on the cache's device)."""
        return self._get("cells", lambda: torch.from_numpy(self.cells).to(self._cache.device))

    def positions_tensor(self) -> torch.Tensor:
        """Positions of the batch tokens [T] (int64, on the cache's device)."""
        return self._get(
            "positions", lambda: torch.from_numpy(self.positions).to(self._cache.device)
        )

    def negated_positions(self) -> torch.Tensor:
        return self._get("negated", lambda: -self.positions_tensor())

    def unrotation(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE tables that un-rotate the batch's keys (a rotary shift only), [T, 1, D]."""
        return self._tables("unrotation", self.negated_positions)

    def rotation(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE tables that rotate the batch's keys to their positions (a rotary shift
        only), [T, 1, D]."""
        return self._tables("rotation", self.positions_tensor)

    def _tables(
        self, key: str, positions: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        shift = self._cache.rotary
        if shift is None:
            return None
        dtype = self._cache.dtype
        return self._get(key, lambda: shift.tables(positions(), dtype))

    # ---- visibility ----------------------------------------------------------------------
    def bounds(self) -> RowBounds:
        """Visible positions [lo, hi] of each row (the policy's rules)."""

        def make() -> RowBounds:
            lo, hi = self._cache.policy.bounds(self.positions, self.causal_rows)
            return RowBounds(self.sequences, lo, hi)

        return self._get("bounds", make)

    def attention_plan(self, kv_heads: int, threads: int) -> AttentionPlan:
        """The segments each row reads (its own sequence's cells; shared prefixes once)."""
        return self._get(
            ("attention", kv_heads, threads),
            lambda: AttentionPlan.build(self._cache.cells, self.bounds(), kv_heads, threads),
        )

    def history(self) -> tuple[int, int]:
        """The padded cell range [lo, hi) ``get`` reads: it covers the batch's sequences."""
        return self._get("history", self._history)

    def mask(self) -> torch.Tensor:
        """Bool mask [T, hi - lo] of the history range: True = may attend."""
        return self._get("mask", self._mask)

    def _history(self) -> tuple[int, int]:
        c = self._cache
        if self.reserve:
            return 0, c.num_cells
        lo, hi = int(self.cells.min()), int(self.cells.max())
        for seq in np.unique(self.sequences):
            s = int(seq)
            if c.memory is None:
                r_lo, r_hi = c.cells.ranges[s]
            else:
                cells = c.cells.cells_of(s)
                floor = c.policy.history_floor(int(self.positions[self.sequences == seq].min()))
                if floor is not None:
                    cells = cells[c.cells.pos[cells] >= floor]
                if len(cells) == 0:
                    continue
                r_lo, r_hi = int(cells[0]), int(cells[-1])
            lo, hi = min(lo, r_lo), max(hi, r_hi)
        p = c.padding
        return lo // p * p, -(-(hi + 1) // p) * p

    def _mask(self) -> torch.Tensor:
        c = self._cache
        lo, hi = self.history()
        cols = np.array([c.cells.cols.get(int(s), -1) for s in self.sequences], dtype=np.int64)
        member = c.cells.member[lo:hi]  # [L, S]
        rows = np.where(cols[None, :] >= 0, member[:, np.maximum(cols, 0)], False).T  # [T, L]
        mask = c.policy.mask(rows, self.positions, c.cells.pos[lo:hi], self.causal_rows)
        return torch.from_numpy(np.ascontiguousarray(mask)).to(c.device)

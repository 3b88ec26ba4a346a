"""Attention policies: who may attend to what (mask rules) and what may be forgotten (memory).

Every rule bounds the positions a row may see from below; causality bounds them from above.
A policy is a table of independent rules; a rule that is switched off is simply not in the
table (no ``if window is None`` in the hot path). Row i of a batch (position p, sequence s)
may attend to cell c (position q) iff s uses c and lo(p) <= q <= hi(p):

    rule      bound                  active when
    causal    q <= p                 always (rows in set_causal's exceptions skip it)
    window    q >= p - W             window W is set (W + 1 tokens visible, itself included)
    chunk     q >= p - (p mod C)     chunk C is set (a token sees only its own chunk)

Because each row's visible positions are one interval, the kernels read a sequence's cells
in position order and stop where the interval ends; the [T, L] mask of ``get`` is built from
the same bounds.

Memory says which cells a sequence may drop at ``start_forward``: with a limited memory M,
cells with q < lowest - M are released (lowest = the sequence's smallest position in the
batch, or its last position + 1 when it is not in the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# row positions [T] -> lowest visible position [T]
Rule = Callable[[np.ndarray], np.ndarray]
UNBOUNDED = np.iinfo(np.int64).max // 4  # "no bound" (kept far from overflow)


def _window(w: int) -> Rule:
    return lambda p: p - w


def _chunk(c: int) -> Rule:
    return lambda p: p - (p % c)


@dataclass(frozen=True)
class Policy:
    """Window, chunk and memory of a causal cache (None = unlimited / off)."""

    window: int | None
    chunk: int | None
    memory: int | None  # None = never evict

    def rules(self) -> list[Rule]:
        """The active lower bounds besides causality, built from the table above."""
        table: list[tuple[int | None, Callable[[int], Rule]]] = [
            (self.window, _window),
            (self.chunk, _chunk),
        ]
        return [make(value) for value, make in table if value is not None]

    def bounds(self, row_pos: np.ndarray, causal_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Visible positions [lo, hi] of each row: ``row_pos`` [T], ``causal_rows`` [T]
        (False = exempt from causality) -> lo [T], hi [T] (int64)."""
        lo = np.full(len(row_pos), -UNBOUNDED, dtype=np.int64)
        for rule in self.rules():
            lo = np.maximum(lo, rule(row_pos))
        hi = np.where(causal_rows, row_pos, UNBOUNDED).astype(np.int64)
        return lo, hi

    def mask(
        self,
        member: np.ndarray,
        row_pos: np.ndarray,
        cell_pos: np.ndarray,
        causal_rows: np.ndarray,
    ) -> np.ndarray:
        """Boolean mask [T, L]: ``member`` [T, L] (row's sequence uses the cell),
        ``row_pos`` [T], ``cell_pos`` [L], ``causal_rows`` [T] (False = exempt from causality)."""
        lo, hi = self.bounds(row_pos, causal_rows)
        q = cell_pos[None, :]  # [1, L]
        return member & (q >= lo[:, None]) & (q <= hi[:, None])

    def evict_below(self, lowest: int) -> int | None:
        """Positions below the returned bound may be dropped (None: keep everything)."""
        return None if self.memory is None else lowest - self.memory

    def history_floor(self, lowest: int) -> int | None:
        """Oldest position a batch row starting at ``lowest`` can still see (None: any)."""
        return None if self.window is None else lowest - self.window

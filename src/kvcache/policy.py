"""Attention policies: who may attend to what (mask rules) and what may be forgotten (memory).

A policy is a table of independent mask rules; a rule that is switched off is simply not in
the table (no ``if window is None`` in the hot path). Row i of a batch (position p, sequence
s) may attend to cell c (position q) iff s uses c and every active rule allows (p, q):

    rule      allows                 active when
    causal    q <= p                 always (rows in set_causal's exceptions skip it)
    window    q >= p - W             window W is set (W + 1 tokens visible, itself included)
    chunk     q >= p - (p mod C)     chunk C is set (a token sees only its own chunk)

Memory says which cells a sequence may drop at ``start_forward``: with a limited memory M,
cells with q < lowest - M are released (lowest = the sequence's smallest position in the
batch, or its last position + 1 when it is not in the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# (row positions [T, 1], cell positions [1, L]) -> allowed [T, L]
Rule = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _window(w: int) -> Rule:
    return lambda p, q: q >= p - w


def _chunk(c: int) -> Rule:
    return lambda p, q: q >= p - (p % c)


@dataclass(frozen=True)
class Policy:
    """Window, chunk and memory of a causal cache (None = unlimited / off)."""

    window: int | None
    chunk: int | None
    memory: int | None  # None = never evict

    def rules(self) -> list[Rule]:
        """The active position rules besides causality, built from the table above."""
        table: list[tuple[int | None, Callable[[int], Rule]]] = [
            (self.window, _window),
            (self.chunk, _chunk),
        ]
        return [make(value) for value, make in table if value is not None]

    def mask(
        self,
        member: np.ndarray,
        row_pos: np.ndarray,
        cell_pos: np.ndarray,
        causal_rows: np.ndarray,
    ) -> np.ndarray:
        """Boolean mask [T, L]: ``member`` [T, L] (row's sequence uses the cell),
        ``row_pos`` [T], ``cell_pos`` [L], ``causal_rows`` [T] (False = exempt from causality)."""
        p = row_pos[:, None]  # [T, 1]
        q = cell_pos[None, :]  # [1, L]
        allowed = member & ((q <= p) | ~causal_rows[:, None])
        for rule in self.rules():
            allowed &= rule(p, q)
        return allowed

    def evict_below(self, lowest: int) -> int | None:
        """Positions below the returned bound may be dropped (None: keep everything)."""
        return None if self.memory is None else lowest - self.memory

    def history_floor(self, lowest: int) -> int | None:
        """Oldest position a batch row starting at ``lowest`` can still see (None: any)."""
        return None if self.window is None else lowest - self.window

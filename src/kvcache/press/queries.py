"""The queries a press scores with: each sequence's newest query rows, per layer.

A :class:`QueryWindow` is an observer of ``CausalCache.attention``: while it is attached,
every layer's ``q`` [T, Hq, D] (rotated, as the model attends with it) passes by, and it keeps
the newest ``rows`` rows of each sequence (SnapKV's observation window: 64), never more::

    seq 3, layer l:   q [<= rows, Hq, D] float32 (float64 kept)     pos [<= rows] int64 (ascending)

So a 4k-token prefill keeps 64 rows per layer, not 4k. Sequences in ``ignored`` are not
recorded (the engine stops recording a request once it has been pressed).
"""

from __future__ import annotations

from types import TracebackType

import numpy as np
import torch

from kvcache.causal import CausalCache
from kvcache.forward import ForwardPlan


class QueryWindow:
    """The newest ``rows`` query rows of each sequence and layer, seen through a cache."""

    def __init__(self, cache: CausalCache, rows: int) -> None:
        self.cache = cache
        self.rows = rows
        self.ignored: set[int] = set()
        self._q: dict[tuple[int, int], torch.Tensor] = {}  # (seq, layer) -> [n, Hq, D]
        self._pos: dict[tuple[int, int], np.ndarray] = {}  # (seq, layer) -> [n]

    # ---- observer ------------------------------------------------------------------------
    def __call__(self, layer: int, q: torch.Tensor, plan: ForwardPlan) -> None:
        """Keep the newest rows of each sequence of this forward (called by the cache)."""
        if self.rows == 0:
            return
        seqs = plan.sequences
        for s in np.unique(seqs).tolist():
            if s in self.ignored:
                continue
            rows = np.flatnonzero(seqs == s)[-self.rows :]  # [r]
            new_q = q[torch.from_numpy(rows)]  # [r, Hq, D]
            new_q = new_q.to(torch.promote_types(new_q.dtype, torch.float32))
            new_pos = plan.positions[rows]
            key = (s, layer)
            old = self._q.get(key)
            if old is not None and len(new_pos) < self.rows:
                before = self._pos[key] < new_pos[0]  # rows re-done after a remove go
                new_q = torch.cat([old[torch.from_numpy(before)], new_q])[-self.rows :]
                new_pos = np.concatenate([self._pos[key][before], new_pos])[-self.rows :]
            self._q[key] = new_q
            self._pos[key] = new_pos

    def __enter__(self) -> QueryWindow:
        self.cache.add_observer(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cache.remove_observer(self)

    # ---- reads ---------------------------------------------------------------------------
    def queries(self, seq: int, layer: int) -> tuple[torch.Tensor, np.ndarray]:
        """q [n, Hq, D] (float32 or float64) and their positions [n] (n = 0 when none was seen)."""
        key = (seq, layer)
        q = self._q.get(key)
        if q is None:
            return torch.zeros(0), np.zeros(0, dtype=np.int64)
        return q, self._pos[key]

    def has(self, seq: int) -> bool:
        """Whether some query of ``seq`` was seen (in every layer, for a full forward)."""
        return any(s == seq for s, _ in self._q)

    def forget(self, seq: int) -> None:
        """Drop what was kept for ``seq`` (it was pressed, or it finished)."""
        for key in [k for k in self._q if k[0] == seq]:
            del self._q[key], self._pos[key]

"""ChunkKV (Liu et al., 2025), as kvpress's ``ChunkKVPress``: keep whole chunks of
neighbouring cells instead of single cells.

An inner press scores the cells; the sequence is cut, by position, into chunks of ``chunk``
cells (the last one may be shorter) and each chunk scores the mean of its cells' scores
(the cell score of ``base.py``); whole chunks are kept best first. A fact spread over a few
tokens (a number, a name) then survives or goes as one piece, where a per-cell choice keeps
some of its tokens and loses others. Unlike kvpress, which keeps int(chunks * (1 - ratio))
whole chunks, the count is exact: the last chunk taken contributes only its best cells::

    cell score  [n]        the inner press's scores -> base.aggregate; the newest cell: +inf
    chunk score [ceil(n / chunk)]   mean over the chunk's cells
    kept        whole chunks by (score desc, earlier first) while they fit, then the best
                cells of the next chunk (ties: the earlier position) up to the target

Chunks make every scoring press keep needles far more often (each needle's tokens stay
together), and key norm, the worst press cell by cell, becomes the best: default
``inner=knorm``, ``chunk=32``. For running text pressed during decode the same default is the
worst choice (``inner=snapkv`` there). Why and what it bought: docs/design/presses.md.
"""

from __future__ import annotations

import numpy as np

from kvcache.press.base import Press, Scoring, Wrapper, aggregate, newest_first

CHUNK = 32


class ChunkKV(Wrapper):
    """Whole chunks of ``chunk`` cells, ranked by an inner press's mean cell score."""

    name = "chunkkv"

    def __init__(
        self, ratio: float, compact: bool = False, inner: Press | None = None, chunk: int = CHUNK
    ) -> None:
        from kvcache.press.knorm import KeyNorm

        super().__init__(ratio, compact, inner if inner is not None else KeyNorm(ratio))
        self.chunk = chunk

    def select(self, ctx: Scoring, keep: int) -> np.ndarray:
        return chunk_select(newest_first(aggregate(self.scores(ctx))), keep, self.chunk)


def chunk_select(score: np.ndarray, keep: int, chunk: int) -> np.ndarray:
    """Indices of the ``keep`` cells kept by whole chunks of ``score`` [n] (module docstring)."""
    n = len(score)
    starts = np.arange(0, n, chunk)
    sums = np.add.reduceat(score, starts) if n else np.zeros(0)
    means = sums / np.minimum(chunk, n - starts)  # inf stays inf: the newest cell's chunk first
    kept: list[np.ndarray] = []
    left = keep
    for c in np.argsort(-means, kind="stable"):
        if left == 0:
            break
        cells = np.arange(starts[c], min(starts[c] + chunk, n))
        if len(cells) > left:  # the last chunk taken: its best cells only
            cells = cells[np.sort(np.argsort(-score[cells], kind="stable")[:left])]
        kept.append(cells)
        left -= len(cells)
    return np.sort(np.concatenate(kept)) if kept else np.zeros(0, dtype=np.int64)

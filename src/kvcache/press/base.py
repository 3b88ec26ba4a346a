"""What a press is: scores per layer and KV head, one keep/drop decision per cell.

A press (kvpress's name) decides which cells of one sequence to keep. Cells are shared by
every layer (one cell = one token's K/V in all layers), so memory is freed only by freeing
cells: a press scores each cell per layer and KV head, as its paper does, then turns those
scores into one decision per cell::

    scores      [L, Hkv, n]    higher = more worth keeping (n = the sequence's cells, by
                               position); each press computes them its own way
    normalised  [L, Hkv, n]    min-max per (layer, head) to [0, 1] (a constant head: 0)
    cell score  [n]            mean over layers and heads
    kept        the newest cell, then the best of the others, (1 - ratio) * n in all
                (rounded down; ties: the earlier position)

The newest cell is always kept: with mask-only eviction the sequence then goes on at the
same ``next_position`` (one past its newest stored token), as kvpress's pruned cache goes on
at the prompt's length, and the next query sits next to a key it can see.

``ratio`` is the fraction removed (kvpress's ``compression_ratio``), applied to the cells
the sequence holds now. The keys a press reads are the cache's own (``CausalCache.read``,
rotated as the model attended with them: dequantized codes for a quantized codec), and the
queries are what a :class:`~kvcache.press.queries.QueryWindow` kept while it observed the
prefill (``press.observe(cache)``); a press never touches a kernel's tensors.

Eviction is the cache's (``CausalCache.evict``): mask only by default: survivors keep their
positions and the sequence goes on at ``next_position``, as kvpress leaves a pruned cache.
``compact=1`` renumbers the survivors instead (keys re-rotated through the cache's shift).
Mask only is the default: as close or closer to the full cache for the presses worth using,
free (compaction re-rotates, and may re-quantize, every moved key of every layer) and stable
positions; compaction helps knorm (``knorm:0.5,compact=1``). Why and what it bought:
docs/design/presses.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from kvcache.causal import CausalCache
from kvcache.errors import CallOrderError, InvalidArgumentError
from kvcache.press.queries import QueryWindow
from kvcache.validate import int_arg

SLACK = 1e-9  # n * (1 - ratio) rounds down as kvpress's int() does, without float noise


def kept_count(n: int, ratio: float) -> int:
    """Cells kept of ``n`` at ``ratio`` removed: int(n * (1 - ratio)), as kvpress counts."""
    return int(n * (1.0 - ratio) + SLACK)


@dataclass
class Scoring:
    """What a press scores one sequence with: its cells by position and lazy reads."""

    cache: CausalCache
    seq: int
    cells: np.ndarray  # [n] by position
    pos: np.ndarray  # [n] their positions, ascending
    window: QueryWindow | None
    keep: int  # cells to keep
    tokens: np.ndarray | None = None  # [n] the context's token ids by position, when given
    memo: dict[object, torch.Tensor] = field(default_factory=dict)  # per-press reusables
    _keys: dict[int, torch.Tensor] = field(default_factory=dict)
    _values: dict[int, torch.Tensor] = field(default_factory=dict)

    def layers(self) -> list[int]:
        return self.cache.layers()

    def keys(self, layer: int) -> torch.Tensor:
        """Keys (rotated) of the cells [n, Hkv, D], float32 (float64 in a float64 cache);
        the values are not decoded for a press that reads keys alone."""
        got = self._keys.get(layer)
        if got is None:
            got = _wide(self.cache.read_keys(layer, torch.from_numpy(self.cells)))
            self._keys = {layer: got}  # one layer at a time: memory stays one layer's
        return got

    def values(self, layer: int) -> torch.Tensor:
        """Values of the cells [n, Hkv, D], as ``keys``."""
        got = self._values.get(layer)
        if got is None:
            got = _wide(self.cache.read_values(layer, torch.from_numpy(self.cells)))
            self._values = {layer: got}
        return got

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys`` and ``values``."""
        return self.keys(layer), self.values(layer)

    def queries(self, layer: int) -> tuple[torch.Tensor, np.ndarray]:
        """Observed queries [w, Hq, D] float32 of this sequence and layer, and positions [w]."""
        assert self.window is not None, "a query press scored without a window"
        return self.window.queries(self.seq, layer)


class Press(ABC):
    """Keeps the (1 - ratio) most useful cells of a sequence (see the module docstring)."""

    name: ClassVar[str]
    query_rows: int = 0  # query rows per sequence and layer it scores with (0: agnostic)

    def __init__(self, ratio: float, compact: bool = False) -> None:
        self.ratio = ratio
        self.compact = compact
        self._window: QueryWindow | None = None

    @abstractmethod
    def scores(self, ctx: Scoring) -> torch.Tensor:
        """Scores [L, Hkv, n] of the sequence's cells per layer and KV head (higher keeps)."""

    def select(self, ctx: Scoring, keep: int) -> np.ndarray:
        """Indices (into ctx.cells) of the ``keep`` cells kept."""
        return top_cells(newest_first(aggregate(self.scores(ctx))), keep)

    # ---- the API ---------------------------------------------------------------------------
    def observe(self, cache: CausalCache) -> QueryWindow:
        """A context manager: while active, the cache's attention shows each layer's queries
        to this press, which keeps the newest ``query_rows`` of each sequence."""
        if not isinstance(cache, CausalCache):
            raise InvalidArgumentError("cache", type(cache).__name__, "a kvcache.CausalCache")
        self._window = QueryWindow(cache, self.query_rows)
        return self._window

    def compress(self, cache: CausalCache, seq: int, *, tokens: Sequence[int] | None = None) -> int:
        """Evict ``seq``'s cells down to (1 - ratio) of them (after its prefill); returns
        the cells freed (cells shared with another sequence stay alive for it). ``tokens``:
        the context's token ids by position, for a press that feeds them again (kvzip)."""
        seq = int_arg("seq", seq)
        keep = kept_count(len(cache.cells_of(seq)), self.ratio)
        return self.compress_to(cache, seq, keep, tokens=tokens)

    def compress_to(
        self, cache: CausalCache, seq: int, keep: int, *, tokens: Sequence[int] | None = None
    ) -> int:
        """Evict ``seq``'s cells down to ``keep`` of them; returns the cells freed."""
        seq, keep = int_arg("seq", seq), int_arg("keep", keep)
        if keep >= len(cache.cells_of(seq)):
            return 0
        ctx = self.scoring(cache, seq, keep, tokens=tokens)
        kept = self.select(ctx, keep)
        assert len(kept) == keep, f"{self.name} kept {len(kept)} cells, not {keep}"
        drop = np.ones(len(ctx.cells), dtype=bool)
        drop[kept] = False
        return cache.evict(seq, ctx.pos[drop], compact=self.compact)

    def scoring(
        self, cache: CausalCache, seq: int, keep: int, *, tokens: Sequence[int] | None = None
    ) -> Scoring:
        """What ``select`` scores ``seq`` with, keeping ``keep`` cells (raises CallOrderError
        when the press needs queries and none of ``seq``'s was observed)."""
        cells = cache.cells_of(seq)
        pos = np.asarray(cache.positions(seq), dtype=np.int64)  # [n], the order of cells
        ids = None if tokens is None else np.asarray(tokens, dtype=np.int64).reshape(-1)
        return Scoring(cache, seq, cells, pos, self._queries(cache, seq), keep, ids)

    @property
    def reconstructs(self) -> bool:
        """Whether it feeds the context through the model again (kvzip): such a press is
        bound to a model (``bind``), takes the context's tokens and presses only once."""
        return False

    @property
    def needs_model(self) -> bool:
        """Whether it must be bound to the model before it scores (``bind``): kvzip repeats
        the context through it, snapout reads its output projections."""
        return self.reconstructs

    def extra_cells(self, n: int) -> int:
        """Free cells the pool needs beyond the sequence's ``n`` while it is pressed (kvzip
        feeds a repeat of the context into it); 0 for a press that only reads."""
        return 0

    def bind(self, reconstruction: Any) -> Press:
        """Give a press that ``needs_model`` what it needs: kvzip its model and prompts (a
        kvzip.Reconstruction), snapout the model (or such a Reconstruction); any other
        press has nothing to bind and is returned as it is."""
        return self

    def during_decode(self, max_cells: int, every: int = 1) -> DecodePress:
        """Decode-time pressing: ``step(cache, seq)`` after each decode step compresses
        ``seq`` back to ``max_cells`` every ``every`` steps."""
        if self.reconstructs:
            raise InvalidArgumentError(
                "press",
                self.name,
                "a press that scores without repeating the context (kvzip "
                "presses once, after a prefill)",
            )
        return DecodePress(self, int_arg("max_cells", max_cells), int_arg("every", every, 1))

    def _queries(self, cache: CausalCache, seq: int) -> QueryWindow | None:
        if self.query_rows == 0:
            return None
        w = self._window
        if w is None or w.cache is not cache or not w.has(seq):
            raise CallOrderError(
                f"press {self.name!r} scores with the prompt's queries: run sequence {seq}'s "
                "prefill inside `with press.observe(cache):` before compress(cache, seq)"
            )
        return w

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ratio={self.ratio})"


class Wrapper(Press):
    """A press over an inner press (AdaKV, ChunkKV): it scores the cells as the inner press
    does, with the inner press's query rows, and turns the scores into cells its own way."""

    def __init__(self, ratio: float, compact: bool, inner: Press) -> None:
        super().__init__(ratio, compact)
        self.inner = inner
        self.query_rows = inner.query_rows

    def scores(self, ctx: Scoring) -> torch.Tensor:
        return self.inner.scores(ctx)

    @property
    def reconstructs(self) -> bool:
        return self.inner.reconstructs

    @property
    def needs_model(self) -> bool:
        return self.inner.needs_model

    def extra_cells(self, n: int) -> int:
        return self.inner.extra_cells(n)

    def bind(self, reconstruction: Any) -> Press:
        self.inner.bind(reconstruction)
        return self


class DecodePress:
    """Keeps a decoding sequence at most ``max_cells`` cells, pressing every ``every`` steps.

    The first ``step`` starts observing the cache's queries (for a press that needs them);
    a sequence none of whose queries were seen yet is left alone until one is.
    """

    def __init__(self, press: Press, max_cells: int, every: int) -> None:
        self.press = press
        self.max_cells = max_cells
        self.every = every
        self._steps: dict[int, int] = {}

    def step(self, cache: CausalCache, seq: int) -> int:
        """One decode step of ``seq`` is done; returns the cells freed now (often 0)."""
        seq = int_arg("seq", seq)
        w = self.press._window
        if self.press.query_rows and (w is None or w.cache is not cache):
            self.press.observe(cache).__enter__()  # stays attached: decode queries keep coming
            return 0
        n = self._steps.get(seq, 0) + 1
        self._steps[seq] = n
        if n % self.every or len(cache.cells_of(seq)) <= self.max_cells:
            return 0
        if self.press.query_rows and not (w is not None and w.has(seq)):
            return 0
        return self.press.compress_to(cache, seq, self.max_cells)

    def close(self) -> None:
        """Stop observing (the cache no longer shows this press its queries)."""
        w = self.press._window
        if w is not None:
            w.__exit__(None, None, None)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """float32, or float64 for float64 input (exactness tests score in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def aggregate(scores: torch.Tensor) -> np.ndarray:
    """[L, H, n] -> [n]: min-max per (layer, head), then the mean (module docstring)."""
    s = scores.double()
    lo = s.amin(dim=-1, keepdim=True)
    span = s.amax(dim=-1, keepdim=True) - lo
    norm = torch.where(span > 0, (s - lo) / span.clamp_min(1e-300), torch.zeros_like(s))
    return norm.mean(dim=(0, 1)).numpy()


def newest_first(score: np.ndarray) -> np.ndarray:
    """``score`` [n] (a copy) with the newest cell (the last) above every other."""
    out = score.astype(np.float64).copy()
    if len(out):
        out[-1] = np.inf
    return out


def top_cells(score: np.ndarray, keep: int) -> np.ndarray:
    """Indices of the ``keep`` highest scores (ties: the lower index first)."""
    return np.sort(np.argsort(-score, kind="stable")[:keep])

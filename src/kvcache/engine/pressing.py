"""The engine's press: each request's cells pressed right after its prefill, and with
``press_cells`` during decode too.

``--press SPEC`` (``kvcache.press``): the press observes the cache's queries for the
engine's lifetime, keeps each prefilling sequence's newest query rows, and compresses the
sequence when its context has been computed (before its first sampled token's successor is
fed); from then on its queries are no longer recorded. Prefix reuse is off with a press: a
pressed prompt's cells no longer describe the prompt's blocks.

``--press-cells N`` (``press_cells``): the queries of each request keep being recorded (the
newest rows only), and every ``press_every`` decode steps a request holding more than N
cells is pressed back to N, as ``Press.during_decode`` does by hand; the spec's ratio still
presses the prompt (``snapout:0``: during decode only). Memory per request then stays under
N + ``press_every`` cells however long it generates; positions go on as before (mask only),
so the context still shifts at ``capacity`` positions.

A press that reads the model (``snapout``: its output projections) is bound to the
engine's model. A press that repeats the context through the model (``kvzip``) is bound to it
too, with the repeat request closed by the tokenizer's chat template (kvpress's choice, a
plain newline for a model without one); it needs room for one chunk's repeat in the pool
(``Press.extra_cells``) and a context at positions 0..n-1. A prefill that finds no such
room (or a context already shifted) is left unpressed and counted (``press_skipped``): its
request goes on exactly as without a press.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcache.causal import CausalCache
from kvcache.engine.request import Request
from kvcache.engine.stats import EngineStats
from kvcache.errors import InvalidArgumentError
from kvcache.press import Press, Reconstruction, make_press
from kvcache.press.queries import QueryWindow
from kvcache.text.tokenizer import Tokenizer

FP16 = 2


class Pressing:
    """One press over the engine's cache (see the module docstring)."""

    def __init__(
        self,
        press: Press,
        cache: CausalCache,
        stats: EngineStats,
        max_cells: int | None = None,
        every: int = 16,
    ) -> None:
        self.press, self.cache, self.stats = press, cache, stats
        self.max_cells, self.every = max_cells, every
        self.window: QueryWindow = press.observe(cache)
        self.window.__enter__()
        self._done: set[int] = set()  # ids of the requests pressed
        self._steps: dict[int, int] = {}  # request id -> decode steps since its prefill

    @classmethod
    def start(
        cls,
        spec: str | None,
        cache: CausalCache,
        stats: EngineStats,
        model: Any = None,
        tokenizer: Tokenizer | None = None,
        max_cells: int | None = None,
        every: int = 16,
    ) -> Pressing | None:
        if spec is None:
            return None
        press = make_press(spec)
        if press.reconstructs:
            press.bind(reconstruction(model, tokenizer, spec))
        elif press.needs_model:  # snapout: the output projections
            press.bind(model)
        return cls(press, cache, stats, max_cells, every)

    def sampled(self, r: Request) -> None:
        """``r`` sampled a token: its whole context is computed. The first time, press its
        prompt; after that, with ``max_cells``, press it back to ``max_cells`` every
        ``every`` decode steps once it holds more."""
        if r.id not in self._done:
            self._prefilled(r)
            return
        if self.max_cells is None:
            return
        steps = self._steps[r.id] = self._steps.get(r.id, 0) + 1
        seq = r.seq
        if steps % self.every or len(self.cache.cells_of(seq)) <= self.max_cells:
            return
        self._press(r, self.max_cells)  # the step's own query was just seen, even after a spill

    def _prefilled(self, r: Request) -> None:
        """Press ``r``'s prompt (once). A compacting press renumbers the survivors, so
        ``r.context`` keeps their tokens only (as a context shift does) and the request
        goes on at the new next position."""
        seq = r.seq
        self._done.add(r.id)
        tokens = None
        if self.press.reconstructs:  # kvzip: the context's tokens, room for their repeat
            cells = self.cache.cells_of(seq)
            positions = np.asarray(self.cache.positions(seq))
            fresh = len(cells) == r.fed and np.array_equal(positions, np.arange(len(cells)))
            if not fresh or self.cache.free_cells() < self.press.extra_cells(len(cells)):
                self.stats.press_skipped += 1  # no room for the repeat, or a shifted context
                self.window.forget(seq)
                self.window.ignored.add(seq)
                return
            tokens = r.context[: r.fed]
        self._press(r, None, tokens)
        if self.max_cells is None:  # nothing more to press: its queries are not needed
            self.window.forget(seq)
            self.window.ignored.add(seq)

    def _press(self, r: Request, keep: int | None, tokens: list[int] | None = None) -> None:
        """Press ``r``'s sequence by the press's ratio (``keep`` None) or to ``keep`` cells."""
        seq = r.seq
        cells = self.cache.cells_of(seq)  # by position
        positions = np.asarray(self.cache.positions(seq))
        if keep is None:
            freed = self.press.compress(self.cache, seq, tokens=tokens)
        else:
            freed = self.press.compress_to(self.cache, seq, keep)
        self.stats.pressed_cells += freed
        if self.press.compact and freed:
            kept = positions[np.isin(cells, self.cache.cells_of(seq))]
            assert len(r.context) == r.fed == int(positions[-1]) + 1, (len(r.context), r.fed)
            r.context = [r.context[p] for p in kept.tolist()]
            r.fed = len(r.context)

    def recompute(self, r: Request) -> None:
        """``r`` computes its context again (preempted, not restored): press it again."""
        self._done.discard(r.id)
        self._steps.pop(r.id, None)

    def preempted(self, r: Request) -> None:
        """``r`` lost its sequence: its queries and its decode step count go (its id stays
        pressed: a spilled request comes back with its pressed cells, and counts its steps
        from there; a recomputed one is pressed again, see ``recompute``)."""
        self.window.ignored.discard(r.seq)
        self.window.forget(r.seq)
        self._steps.pop(r.id, None)

    def finished(self, r: Request) -> None:
        """``r`` ended: nothing of it stays (a long-running server keeps no per-request
        state)."""
        self.preempted(r)
        self._done.discard(r.id)


def fp16_row_bytes(cache: CausalCache) -> int:
    """fp16 bytes of one token's K and V in every layer."""
    return sum(
        (k[0] * k[1] + v[0] * v[1]) * FP16
        for k, v in (cache.layer_shapes(layer) for layer in cache.layers())
    )


def reconstruction(model: Any, tokenizer: Tokenizer | None, spec: str) -> Reconstruction:
    """kvzip's repeat prompts from the tokenizer's chat template (module docstring)."""
    if model is None or tokenizer is None:
        raise InvalidArgumentError(
            "press",
            spec,
            "a press that reads the cache only: kvzip needs the engine's model "
            "and tokenizer (Engine(model, tokenizer, ...))",
        )
    return Reconstruction.for_chat(model, tokenizer)

"""The engine's press: each request's cells pressed once, right after its prefill.

``--press SPEC`` (``kvcache.press``): the press observes the cache's queries for the
engine's lifetime, keeps each prefilling sequence's newest query rows, and compresses the
sequence when its context has been computed (before its first sampled token's successor is
fed); from then on its queries are no longer recorded. Prefix reuse is off with a press: a
pressed prompt's cells no longer describe the prompt's blocks.

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

    def __init__(self, press: Press, cache: CausalCache, stats: EngineStats) -> None:
        self.press, self.cache, self.stats = press, cache, stats
        self.window: QueryWindow = press.observe(cache)
        self.window.__enter__()
        self._done: set[int] = set()  # ids of the requests pressed

    @classmethod
    def start(
        cls,
        spec: str | None,
        cache: CausalCache,
        stats: EngineStats,
        model: Any = None,
        tokenizer: Tokenizer | None = None,
    ) -> Pressing | None:
        if spec is None:
            return None
        press = make_press(spec)
        if press.reconstructs:
            press.bind(reconstruction(model, tokenizer, spec))
        elif press.needs_model:  # snapout: the output projections
            press.bind(model)
        return cls(press, cache, stats)

    def prefilled(self, r: Request) -> None:
        """``r`` computed its whole context: press its sequence (once). A compacting press
        renumbers the survivors, so ``r.context`` keeps their tokens only (as a context
        shift does) and the request goes on at the new next position."""
        seq = r.seq
        if r.id in self._done:  # pressed already (a spilled request comes back pressed)
            return
        self._done.add(r.id)
        cells = self.cache.cells_of(seq)  # by position
        positions = np.asarray(self.cache.positions(seq))
        tokens = None
        if self.press.reconstructs:  # kvzip: the context's tokens, room for their repeat
            fresh = len(cells) == r.fed and np.array_equal(positions, np.arange(len(cells)))
            if not fresh or self.cache.free_cells() < self.press.extra_cells(len(cells)):
                self.stats.press_skipped += 1  # no room for the repeat, or a shifted context
                self.window.forget(seq)
                self.window.ignored.add(seq)
                return
            tokens = r.context[: r.fed]
        self.stats.pressed_cells += self.press.compress(self.cache, seq, tokens=tokens)
        if self.press.compact:
            kept = positions[np.isin(cells, self.cache.cells_of(seq))]
            assert len(r.context) == r.fed == int(positions[-1]) + 1, (len(r.context), r.fed)
            r.context = [r.context[p] for p in kept.tolist()]
            r.fed = len(r.context)
        self.window.forget(seq)
        self.window.ignored.add(seq)

    def recompute(self, r: Request) -> None:
        """``r`` computes its context again (preempted, not restored): press it again."""
        self._done.discard(r.id)

    def finished(self, r: Request) -> None:
        """``r`` ended, or lost its sequence (preempted): its queries go (its id stays
        pressed: a spilled request comes back with its pressed cells)."""
        self.window.ignored.discard(r.seq)
        self.window.forget(r.seq)


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

"""Presses: which cells of a sequence to keep, so a long context fits a memory budget.

The API (what ``benchmarks/long_context.py`` and the engine call)::

    from kvcache.press import make_press, Press, PRESSES, total_compression
    press = make_press("snapkv:0.5")       # NAME:RATIO[,OPTION=VALUE...], RATIO = fraction
                                           # removed, 0 <= RATIO < 1 (InvalidArgumentError)
    sorted(PRESSES)                        # adakv, chunkkv, expected, knorm, kvzip, snapkv,
                                           # snapout, streaming, tova
    with press.observe(cache):             # the prefill: attention shows the press its queries
        logits = model.forward(tokens, batch, cache)
    freed = press.compress(cache, seq)     # evict seq's cells down to (1 - ratio); cells freed
    press.bind(Reconstruction(model, ...)) # kvzip only (it repeats the context through the
    press.compress(cache, seq, tokens=ids) # model): the model, then the context's tokens
    make_press("snapout:0.5").bind(model)  # snapout reads the model's output projections
    press.needs_model                      # whether bind must come first (kvzip, snapout)
    cache.held_bytes(seq)                  # bytes held by seq's cells (None: all sequences)
    total_compression(cache, seq)          # fp16 bytes of the history / held_bytes(seq)
    dp = press.during_decode(max_cells=N, every=K)
    dp.step(cache, seq)                    # after each decode step: every K, back to N cells

Layout: ``base.py`` (Press, the per-cell decision, Wrapper, DecodePress), ``queries.py`` (the query
window an observing press keeps), one file per press family, ``registry.py`` (specs);
the eviction itself is the cache's (``CausalCache.evict``, mask only by default).
"""

from __future__ import annotations

from kvcache.causal import CausalCache
from kvcache.press.base import DecodePress, Press, kept_count
from kvcache.press.kvzip import Reconstruction
from kvcache.press.registry import PRESSES, make_press
from kvcache.validate import int_arg

FP16 = 2


def total_compression(cache: CausalCache, seq: int, tokens: int | None = None) -> float:
    """fp16 bytes of the history ``seq`` has seen (``tokens``, default its next position:
    tokens x layers x 2 x kv_heads x head_dim x 2 bytes) / the bytes its cells hold."""
    seq = int_arg("seq", seq)
    n = cache.next_position(seq) if tokens is None else int_arg("tokens", tokens)
    row = sum(
        (k[0] * k[1] + v[0] * v[1]) * FP16
        for k, v in (cache.layer_shapes(layer) for layer in cache.layers())
    )
    held = cache.held_bytes(seq)
    return n * row / held if held else float("inf")


__all__ = [
    "PRESSES",
    "DecodePress",
    "Press",
    "Reconstruction",
    "kept_count",
    "make_press",
    "total_compression",
]

"""The wrapper cache: routes each layer to one of several caches.

Whisper: ``WrapperCache(EncoderCache(), CausalCache(...))`` with cross-attention layers on
type 0 and self-attention on type 1; hybrid models: a sliding-window cache and a full one.
"""

from __future__ import annotations

import contextlib

import torch

from kvcache.batch import Batch
from kvcache.errors import InvalidArgumentError, KVCacheError, NotSupportedError
from kvcache.protocol import Cache
from kvcache.validate import int_arg


class WrapperCache:
    """Forwards bookkeeping to every cache; put/get go to the one ``set_layer_type`` picked."""

    def __init__(self, *caches: Cache) -> None:
        if not caches:
            raise InvalidArgumentError("caches", caches, "at least one cache")
        for i, c in enumerate(caches):
            if not isinstance(c, Cache):
                raise InvalidArgumentError(f"caches[{i}]", type(c).__name__, "a kvcache cache")
        self.caches = caches
        self._current = 0

    def start_forward(self, batch: Batch, reserve: bool = False) -> None:
        """Start every cache in order; if one fails, drop this batch's tokens from the ones
        already started (their evictions stay) and re-raise."""
        for i, cache in enumerate(self.caches):
            try:
                cache.start_forward(batch, reserve)
            except KVCacheError:
                if not reserve:
                    self._unwind(self.caches[:i], batch)
                raise
        self._current = 0

    @staticmethod
    def _unwind(started: tuple[Cache, ...], batch: Batch) -> None:
        for cache in reversed(started):
            for seq, pos in zip(batch.sequences, batch.positions, strict=True):
                with contextlib.suppress(KVCacheError):
                    cache.remove(seq, pos)

    def set_layer_type(self, layer_type: int) -> None:
        """Route the following put/get/update calls to ``caches[layer_type]``."""
        t = int_arg("layer_type", layer_type)
        if t >= len(self.caches):
            raise InvalidArgumentError("layer_type", t, f"an index < {len(self.caches)}")
        self._current = t

    @property
    def underlying(self) -> Cache:
        """The cache the current layer type selects (e.g. to call set_causal on it)."""
        return self.caches[self._current]

    def put(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.underlying.put(layer, key, value)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.underlying.get(layer)

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.underlying.update(layer, key, value)

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        keys_rotated: bool = True,
    ) -> torch.Tensor:
        """The current layer type's cache stores k/v and attends (see CausalCache.attention)."""
        cache = self.underlying
        attention = getattr(cache, "attention", None)
        if attention is None:
            raise NotSupportedError(f"{type(cache).__name__} has no attention(layer, q, k, v)")
        if keys_rotated is True:  # the call every cache with an attention takes
            return attention(layer, q, k, v, scale=scale)
        return attention(layer, q, k, v, scale=scale, keys_rotated=keys_rotated)

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        """Remove from each cache in order; stops at the first error (then clear ``seq``)."""
        for cache in self.caches:
            cache.remove(seq, begin, end)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        for cache in self.caches:
            cache.copy_prefix(src, dst, length)

    def can_resume(self, seq: int, pos: int) -> bool:
        return all(cache.can_resume(seq, pos) for cache in self.caches)

    def memory_usage_bytes(self) -> int:
        return sum(cache.memory_usage_bytes() for cache in self.caches)

    def close(self) -> None:
        for cache in self.caches:
            cache.close()

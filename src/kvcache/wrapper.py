"""The wrapper cache: routes each layer to one of several caches.

Whisper: ``WrapperCache(EncoderCache(), CausalCache(...))`` with cross-attention layers on
type 0 and self-attention on type 1; hybrid models (:class:`HybridCache`): a sliding-window
cache and a full one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.codecs.base import Codec
from kvcache.errors import InvalidArgumentError, KVCacheError, NotSupportedError
from kvcache.protocol import Cache
from kvcache.snapshot import HybridSnapshot, ModelId
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


class HybridCache(WrapperCache):
    """A window cache for the local layers (type 0) and a full one for the global layers
    (type 1), as Ollama builds Gemma 3's; the engine's bookkeeping (cells, positions, room)
    reads the full part, which holds every position, while a prefix hit restores the local
    part from a checkpoint (:mod:`kvcache.engine.checkpoints`)::

        positions   0 .................................. n
        full        [every cell, shared by prefix hits     ]
        local                             [last window cells]
    """

    def __init__(self, local: CausalCache, full: CausalCache) -> None:
        if local.window is None or full.window is not None:
            raise InvalidArgumentError(
                "caches", (local.window, full.window), "a sliding-window cache, then a full one"
            )
        super().__init__(local, full)
        self.local = local
        self.full = full

    # ---- what the engine reads (the full part; room is the scarcer of the two) ---------
    @property
    def window(self) -> int:
        """Positions before a row that the local layers see."""
        assert self.local.window is not None
        return self.local.window

    @property
    def num_cells(self) -> int:
        return self.full.num_cells

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    @property
    def key_codec(self) -> Codec:
        return self.full.key_codec

    @property
    def value_codec(self) -> Codec:
        return self.full.value_codec

    @property
    def model_id(self) -> ModelId:
        return self.full.model_id

    def free_cells(self) -> int:
        """Free cells of the full part, which holds every position: the local part is sized for
        each live sequence's window and one forward (``Gemma3.new_cache``), and raises its own
        CacheFullError past that."""
        return self.full.free_cells()

    def used_cells(self) -> int:
        return self.full.used_cells()

    def cells_of(self, seq: int) -> np.ndarray:
        return self.full.cells_of(seq)

    def positions(self, seq: int) -> list[int]:
        return self.full.positions(seq)

    def sequences(self) -> list[int]:
        return self.full.sequences()

    def layers(self) -> list[int]:
        return sorted(self.local.layers() + self.full.layers())

    def layer_shapes(self, layer: int) -> tuple[tuple[int, int], tuple[int, int]]:
        part = self.full if layer in self.full.storage.layers else self.local
        return part.layer_shapes(layer)

    def held_bytes(self, seq: int | None = None) -> int:
        return self.local.held_bytes(seq) + self.full.held_bytes(seq)

    # ---- snapshots: both parts ----------------------------------------------------------
    def snapshot(
        self, seq: int, *, model_id: ModelId | None = None, tokens: Sequence[int] | None = None
    ) -> HybridSnapshot:
        """``seq``'s cells of both parts (the local part's last window, the full part's all)."""
        full = self.full.snapshot(seq, model_id=model_id, tokens=tokens)
        return HybridSnapshot(full, self.local.snapshot(seq, model_id=model_id))

    def restore(
        self, snapshot: HybridSnapshot, seq: int, *, model_id: ModelId | None = None
    ) -> None:
        """Both parts of ``snapshot`` as ``seq``, of the local part the window before the
        next position only (what the part keeps between forwards, which its cells are sized
        for); a failure of the local part undoes the full."""
        if not isinstance(snapshot, HybridSnapshot):
            raise InvalidArgumentError(
                "snapshot", type(snapshot).__name__, "a HybridSnapshot (of a HybridCache)"
            )
        local = snapshot.local.window_before(snapshot.positions[-1] + 1)
        self.full.restore(snapshot.full, seq, model_id=model_id)
        try:
            self.local.restore(local, seq, model_id=model_id)
        except KVCacheError:
            self.full.remove(seq, 0)
            raise

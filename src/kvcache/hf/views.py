"""The per-layer objects of ``KVCacheForTransformers.layers``.

transformers reads some facts layer by layer (``cache.layers[i].is_sliding``,
``cache.is_sliding``, ``len(cache)``, ``get_seq_length`` on the first attention layer); the
cell cache keeps one pool of cells for all layers of a window, so each view answers by asking
its owner, and per-layer mutations (reorder, crop, ...) raise: they only make sense for the
whole cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcache.errors import NotSupportedError
from kvcache.hf.layers import LayerSpec

if TYPE_CHECKING:
    from kvcache.hf.cache import KVCacheForTransformers


class LayerView(CacheLayerMixin):
    """What transformers reads per layer from ``cache.layers`` (``is_sliding``, lengths),
    answered by the owning cache: all layers of a window share one pool of cells."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: KVCacheForTransformers, index: int, spec: LayerSpec) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.is_sliding = spec.sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotSupportedError(
            "KVCacheForTransformers allocates its cells on the first forward; "
            "early_initialization is not supported"
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.update(key_states, value_states, self.index, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query_length, self.index)

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length(self.index)

    def get_max_length(self) -> int:
        return self.owner.get_max_length(self.index)

    def _whole_cache(self, name: str) -> None:
        raise NotSupportedError(
            f"{name} on one layer of KVCacheForTransformers: layers share cells, "
            f"call cache.{name}(...) on the cache itself"
        )

    def reset(self) -> None:
        self._whole_cache("reset")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._whole_cache("reorder_cache")

    def crop(self, tokens_to_remove: int) -> None:
        self._whole_cache("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole_cache("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._whole_cache("batch_select_indices")

    def offload(self) -> None:
        raise NotSupportedError("KVCacheForTransformers does not offload layers")

    def prefetch(self) -> None:
        raise NotSupportedError("KVCacheForTransformers does not offload layers")

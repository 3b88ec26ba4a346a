"""transformers integration: :class:`KVCacheForTransformers`, a ``transformers.Cache``
backed by kvcache's cell cache and codecs, for ``model.generate(past_key_values=cache)``,
and the ``"kvcache"`` attention implementation (registered on import) that attends inside
that cache, from the stored codes.

Importing this package imports ``transformers`` (the ``test`` extra); the rest of kvcache
does not need it.
"""

from kvcache.hf.attention import CacheMask, PendingRows, kvcache_attention, kvcache_mask, register
from kvcache.hf.cache import KVCacheForTransformers
from kvcache.hf.layers import LayerSpec, cell_window, layer_specs
from kvcache.hf.plan import ReadPlan

register()

__all__ = [
    "CacheMask",
    "KVCacheForTransformers",
    "LayerSpec",
    "PendingRows",
    "ReadPlan",
    "cell_window",
    "kvcache_attention",
    "kvcache_mask",
    "layer_specs",
    "register",
]

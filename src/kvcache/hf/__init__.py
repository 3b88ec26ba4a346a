"""transformers integration: :class:`KVCacheForTransformers`, a ``transformers.Cache``
backed by kvcache's cell cache and codecs, for ``model.generate(past_key_values=cache)``.

Importing this package imports ``transformers`` (the ``test`` extra); the rest of kvcache
does not need it.
"""

from kvcache.hf.cache import KVCacheForTransformers
from kvcache.hf.layers import LayerSpec, cell_window, layer_specs
from kvcache.hf.plan import ReadPlan

__all__ = ["KVCacheForTransformers", "LayerSpec", "ReadPlan", "cell_window", "layer_specs"]

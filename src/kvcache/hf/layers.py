"""Which window each decoder layer of a transformers model attends with.

Read from ``config.layer_types`` / ``config.sliding_window`` through transformers' own
``get_layer_types_and_kwargs`` (the same reading ``DynamicCache(config=...)`` does), so the
cache and the model's mask code never disagree about a layer.

Windows are kept in *transformers' convention* everywhere in this package and converted
once, in :func:`cell_window`, for the cell cache::

    transformers  window SW: key k visible to query q iff q - SW < k <= q   (SW tokens, q included)
    kvcache       window W : key k visible to query q iff q - W <= k <= q   (W + 1 tokens)
    so            W = SW - 1
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcache.errors import InvalidConfigError, NotSupportedError


@dataclass(frozen=True)
class LayerSpec:
    """How one layer attends: ``window`` in transformers' convention (None = full attention)
    and whether transformers masks it as a sliding layer (``sliding``) or as full attention
    that this cache limits to a window of its own (``window`` given, ``sliding`` False)."""

    window: int | None
    sliding: bool


def _full(window: int | None) -> Callable[[dict[str, Any]], LayerSpec]:
    return lambda kwargs: LayerSpec(window, False)


def _sliding(kwargs: dict[str, Any]) -> LayerSpec:
    sw = kwargs.get("sliding_window")
    if not isinstance(sw, int) or isinstance(sw, bool) or sw < 1:
        raise InvalidConfigError("config.sliding_window", sw, "an int >= 1 for sliding layers")
    return LayerSpec(sw, True)


def layer_specs(config: Any, window: int | None) -> list[LayerSpec]:
    """One spec per decoder layer of ``config`` (a transformers text config).

    ``window`` (transformers' convention) limits the layers the config declares full
    attention; sliding layers keep ``config.sliding_window``, which is what the model's mask
    uses. Layer types other than full and sliding attention raise NotSupportedError.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config)
    table: dict[str, Callable[[dict[str, Any]], LayerSpec]] = {
        "full_attention": _full(window),
        "sliding_attention": _sliding,
    }
    specs = []
    for i, (kind, kw) in enumerate(zip(types, kwargs, strict=True)):
        make = table.get(kind)
        if make is None:
            raise NotSupportedError(
                f"layer {i} of {type(config).__name__} has type {kind!r}; KVCacheForTransformers "
                f"supports {sorted(table)} (no chunked, linear, shared-KV or dummy layers)"
            )
        specs.append(make(kw))
    if not specs:
        raise InvalidConfigError("config", type(config).__name__, "a config with decoder layers")
    return specs


def cell_window(hf_window: int) -> int:
    """The cell cache's window for a transformers window (see the module docstring)."""
    assert hf_window >= 1, f"transformers window {hf_window} < 1"
    return hf_window - 1


def kv_offset(hf_window: int | None, past: int) -> int:
    """First position a forward starting at ``past`` may attend to (transformers' kv_offset)."""
    return 0 if hf_window is None else max(past - hf_window + 1, 0)


def uniform_kv_shape(config: Any) -> tuple[int, int] | None:
    """(kv_heads, head_dim) shared by every layer of ``config``, None if layers differ or
    the config does not say (then storage is allocated layer by layer, as puts arrive)."""
    shapes = set()
    for layer in config.per_layer_config:
        heads = getattr(layer, "num_key_value_heads", None) or getattr(
            layer, "num_attention_heads", None
        )
        dim = getattr(layer, "head_dim", None)
        if dim is None and heads is not None:
            hidden, q_heads = getattr(layer, "hidden_size", None), layer.num_attention_heads
            dim = hidden // q_heads if isinstance(hidden, int) and q_heads else None
        if not isinstance(heads, int) or not isinstance(dim, int):
            return None
        shapes.add((heads, dim))
    return shapes.pop() if len(shapes) == 1 else None

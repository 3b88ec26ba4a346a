"""kvcache: the key/value cache of transformer inference.

Caches (one protocol, :class:`kvcache.protocol.Cache`): :class:`CausalCache` (many sequences
in one cell pool, causal / sliding window / window+memory / chunked), :class:`EncoderCache`
(cross-attention K/V), :class:`WrapperCache` (routes layers to caches), and the small
per-layer :class:`KVCache`. :func:`transcribe` turns speech into text with Whisper decoding on
the cell cache (:mod:`kvcache.transcription`); :mod:`kvcache.generate` completes text
prompts through the engine (:mod:`kvcache.engine`) that ``kvcache serve`` runs too.

Importing ``kvcache`` loads the caches only: the speech, generation and serving stacks
(and their dependencies: soundfile, fastapi, uvicorn, redis) load when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.encoder import EncoderCache
from kvcache.protocol import Cache, ShiftFn
from kvcache.simple import KVCache
from kvcache.wrapper import WrapperCache

if TYPE_CHECKING:
    from kvcache.transcription import transcribe

# public names loaded on first use: name -> module that defines it
_LAZY = {"transcribe": "kvcache.transcription"}


def __getattr__(name: str) -> Any:
    """``kvcache.transcribe``, imported when first asked for (the speech stack is large)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Batch",
    "Cache",
    "CausalCache",
    "EncoderCache",
    "KVCache",
    "ShiftFn",
    "WrapperCache",
    "transcribe",
]
__version__ = "0.1.0"

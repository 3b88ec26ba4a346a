"""kvcache: the key/value cache of transformer inference.

Caches (one protocol, :class:`kvcache.protocol.Cache`): :class:`CausalCache` (many sequences
in one cell pool, causal / sliding window / window+memory / chunked), :class:`EncoderCache`
(cross-attention K/V), :class:`WrapperCache` (routes layers to caches), and the small
per-layer :class:`KVCache`. :func:`transcribe` turns speech into text with Whisper decoding on
the cell cache (:mod:`kvcache.transcription`).
"""

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.encoder import EncoderCache
from kvcache.protocol import Cache, ShiftFn
from kvcache.simple import KVCache
from kvcache.transcription import transcribe
from kvcache.wrapper import WrapperCache

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

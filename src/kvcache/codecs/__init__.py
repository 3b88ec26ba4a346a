"""Storage formats of the cell cache, by name: ``make_codec("int8")``.

name      keys/values stored as                                bits per value (D=64)
fp32      float32                                              32
fp16      float16                                              16
bf16      bfloat16                                             16
int8      int8 + fp16 scale per (token, head)                  8.25
int4      4-bit asymmetric, fp16 scale + min per 32 channels   5
int4g64   the same with groups of 64 channels                  4.5
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcache.codecs.base import Buffer, Codec
from kvcache.codecs.floats import FloatCodec
from kvcache.codecs.ints import Int4Codec, Int8Codec
from kvcache.errors import InvalidConfigError

CODECS: dict[str, Callable[[], Codec]] = {
    "fp32": lambda: FloatCodec(torch.float32),
    "fp16": lambda: FloatCodec(torch.float16),
    "bf16": lambda: FloatCodec(torch.bfloat16),
    "int8": Int8Codec,
    "int4": Int4Codec,
    "int4g64": lambda: Int4Codec(group=64),
}


def make_codec(spec: str | Codec, name: str = "codec") -> Codec:
    """A codec from its registry name (or a Codec instance, returned as is)."""
    if isinstance(spec, Codec):
        return spec
    factory = CODECS.get(spec) if isinstance(spec, str) else None
    if factory is None:
        raise InvalidConfigError(name, spec, f"one of {sorted(CODECS)} or a Codec instance")
    return factory()


__all__ = ["CODECS", "Buffer", "Codec", "FloatCodec", "Int4Codec", "Int8Codec", "make_codec"]

"""Storage formats of the cell cache, by name: ``make_codec("int8")``.

name      keys/values stored as                                bits per value (D=64)
fp32      float32                                              32
fp16      float16                                              16
bf16      bfloat16                                             16
int8      int8 + fp16 scale per (token, head)                  8.25
int4      4-bit asymmetric, fp16 scale + min per 32 channels   5     (keys centred)
int4g64   the same with groups of 64 channels                  4.5   (keys centred)
kivi4/2   keys per channel over blocks of 64 tokens, values per    4.5 / 2.5 (+ fp16 for
          token; the newest 128 tokens in fp16                     the newest 128 tokens)
turbo4/3  rotation + Lloyd-Max codebook per (token, head)          4.25 / 3.25 (keys centred)

kivi and turbo keys are quantized before RoPE in a cell cache that has a shift function
(``Codec.pre_rope``; see ``kvcache.storage``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcache.codecs.base import Buffer, Codec
from kvcache.codecs.floats import FloatCodec
from kvcache.codecs.ints import Int4Codec, Int8Codec
from kvcache.codecs.kivi import KiviCodec
from kvcache.codecs.turbo_codec import TurboCodec
from kvcache.errors import InvalidConfigError

# name -> factory(is_key)
CODECS: dict[str, Callable[[bool], Codec]] = {
    "fp32": lambda key: FloatCodec(torch.float32),
    "fp16": lambda key: FloatCodec(torch.float16),
    "bf16": lambda key: FloatCodec(torch.bfloat16),
    "int8": lambda key: Int8Codec(),
    "int4": lambda key: Int4Codec(centre=key),
    "int4g64": lambda key: Int4Codec(group=64, centre=key),
    "kivi4": lambda key: KiviCodec(4, per_channel=key),
    "kivi2": lambda key: KiviCodec(2, per_channel=key),
    "turbo4": lambda key: TurboCodec(4, keys=key),
    "turbo3": lambda key: TurboCodec(3, keys=key),
}


def make_codec(spec: str | Codec, role: str = "key") -> Codec:
    """A codec from its registry name for ``role`` "key" or "value" (a Codec is returned
    as is)."""
    if isinstance(spec, Codec):
        return spec
    factory = CODECS.get(spec) if isinstance(spec, str) else None
    if factory is None:
        raise InvalidConfigError(
            f"{role}_codec", spec, f"one of {sorted(CODECS)} or a Codec instance"
        )
    return factory(role == "key")


__all__ = [
    "CODECS",
    "Buffer",
    "Codec",
    "FloatCodec",
    "Int4Codec",
    "Int8Codec",
    "KiviCodec",
    "make_codec",
]

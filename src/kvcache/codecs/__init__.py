"""Storage formats of the cell cache, by name: ``make_codec("int8")``.

name      keys/values stored as                                  bits per value (D=64)
fp32      float32                                                32
fp16      float16                                                16
bf16      bfloat16                                               16
int8      int8 + fp16 scale per (token, head)                    8.25
int4      4-bit asymmetric, fp16 scale + min per 32 channels     5 (keys centred, their
                                                                 ranges refitted)
int4g64   the same with groups of 64 channels                    4.5 (keys likewise)
kivi4/2   keys per channel (groups of 64 tokens), values per token   4.5 / 2.5
turbo4/3  rotation + Lloyd-Max codebook per (token, head); keys   4.25 / 3.19 (keys
          get 5 / 4 bits, values 3 / 2                           centred)
A/B       codec A for keys, B for values: "int8/int4"

int4, turbo and kivi keep each sequence's newest 128 rows in fp16 (``kvcache.recent``;
``"int4:recent=0"`` turns it off, ``"kivi4:residual=256"`` resizes kivi's), and every
quantizing codec seals a sequence's rows 32 at a time (``"int8:batch=1"``: as written; kivi
keys: 64, a group); ``"int4:refits=0"`` codes int4's keys against their groups' min/max.

kivi keys are quantized before RoPE in a cell cache that has a shift function
(``Codec.pre_rope``; see ``kvcache.storage``); turbo keys too, unless the shift is a rotary
embedding: then after RoPE, centred in its frame (``Codec.rotary_centre``,
``codecs.base.RotaryFrame``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from kvcache.codecs.base import Buffer, Codec, Layout
from kvcache.codecs.floats import FloatCodec
from kvcache.codecs.ints import AffineRowsCodec, Int8Codec, int4
from kvcache.codecs.kivi import kivi
from kvcache.codecs.turbo_codec import TurboCodec
from kvcache.errors import InvalidConfigError
from kvcache.recent import SEAL_BATCH

RECENT = 128  # newest rows of each sequence kept in fp16 by int4 / turbo / kivi


# name -> factory(is_key, **options); options come from "name:option=int,..."
CODECS: dict[str, Callable[..., Codec]] = {
    "fp32": lambda key: FloatCodec(torch.float32),
    "fp16": lambda key: FloatCodec(torch.float16),
    "bf16": lambda key: FloatCodec(torch.bfloat16),
    "int8": lambda key, batch=SEAL_BATCH: Int8Codec(batch),
    "int4": lambda key, recent=RECENT, batch=SEAL_BATCH, refits=None: int4(
        32, key, recent, batch, refits
    ),
    "int4g64": lambda key, recent=RECENT, batch=SEAL_BATCH, refits=None: int4(
        64, key, recent, batch, refits
    ),
    "kivi4": lambda key, residual=RECENT: kivi(4, per_channel=key, residual=residual),
    "kivi2": lambda key, residual=RECENT: kivi(2, per_channel=key, residual=residual),
    "turbo4": lambda key, recent=RECENT, key_bits=5, value_bits=3, batch=SEAL_BATCH: _turbo(
        "turbo4", key, recent, key_bits, value_bits, batch
    ),
    "turbo3": lambda key, recent=RECENT, key_bits=4, value_bits=2, batch=SEAL_BATCH: _turbo(
        "turbo3", key, recent, key_bits, value_bits, batch
    ),
}


def _turbo(name: str, key: bool, recent: int, key_bits: int, value_bits: int, batch: int) -> Codec:
    """Turbo codes, ``key_bits`` for keys and ``value_bits`` for values (see turbo_codec);
    2-bit values keep their norm in one byte."""
    bits = key_bits if key else value_bits
    if not 1 <= bits <= 8:
        raise InvalidConfigError("key_bits" if key else "value_bits", bits, "an int in 1..8")
    if recent < 0:
        raise InvalidConfigError("recent", recent, "an int >= 0")
    if batch < 1:
        raise InvalidConfigError("batch", batch, "an int >= 1 (rows of a sequence sealed together)")
    log_scale = not key and bits <= 2
    return TurboCodec(bits, keys=key, log_scale=log_scale, name=name, window=recent, batch=batch)


def make_codec(spec: str | Codec, role: str = "key") -> Codec:
    """A codec from its registry name for ``role`` "key" or "value" (a Codec is returned
    as is). Integer options follow a colon: ``"int4:recent=0"``, ``"kivi4:residual=256"``;
    ``"KEY/VALUE"`` names one codec per role: ``"int8/int4"``."""
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, str) and "/" in spec:  # "KEY/VALUE": this role's half
        key_spec, _, value_spec = spec.partition("/")
        return make_codec(key_spec if role == "key" else value_spec, role)
    name, _, opts = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    factory = CODECS.get(name)
    if factory is None:
        raise InvalidConfigError(
            f"{role}_codec", spec, f"one of {sorted(CODECS)} or a Codec instance"
        )
    kwargs: dict[str, int] = {}
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        if not value.lstrip("-").isdigit():
            raise InvalidConfigError(f"{role}_codec", spec, "options as name:option=int,...")
        kwargs[key.strip()] = int(value)
    allowed = list(inspect.signature(factory).parameters)[1:]  # after is_key
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise InvalidConfigError(
            f"{role}_codec", spec, f"options of {name}: {list(allowed) or 'none'}"
        )
    codec: Codec = factory(role == "key", **kwargs)
    if kwargs:  # the name tells the variant apart (prefix-cache namespaces use it)
        codec.name = f"{name}:" + ",".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
    return codec


__all__ = [
    "CODECS",
    "AffineRowsCodec",
    "Buffer",
    "Codec",
    "FloatCodec",
    "Int8Codec",
    "Layout",
    "TurboCodec",
    "make_codec",
]

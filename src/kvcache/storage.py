"""Per-layer K/V buffers of a cell cache, preallocated and written in place.

Layout (token-major, one row per cell, shared cell index across layers)::

    keys[layer]   : [N, kv_heads, head_dim_k]   in the key codec's format
    values[layer] : [N, kv_heads, head_dim_v]   in the value codec's format

A layer's buffers are allocated on its first write (K and V head dims may differ), zero
filled, and never reallocated. Reads hand back a cell range only: a view for a float codec
in the compute dtype, a decoded copy of that range (never of the whole cache) otherwise.
"""

from __future__ import annotations

import torch

from kvcache.codecs import Codec
from kvcache.codecs.base import Locs
from kvcache.errors import DimensionMismatchError, InvalidArgumentError


class LayerStorage:
    """K and V buffers of one layer, each in its codec's format."""

    def __init__(
        self,
        n: int,
        key: torch.Tensor,
        value: torch.Tensor,
        codecs: tuple[Codec, Codec],
        device: torch.device,
    ) -> None:
        self.key_shape = (int(key.shape[1]), int(key.shape[2]))  # (H, Dk)
        self.value_shape = (int(value.shape[1]), int(value.shape[2]))  # (H, Dv)
        self.keys = codecs[0].allocate(n, *self.key_shape, device)  # [N, H, Dk]
        self.values = codecs[1].allocate(n, *self.value_shape, device)  # [N, H, Dv]

    def check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Raise if a put's per-token shapes differ from what this layer holds."""
        if tuple(key.shape[1:]) != self.key_shape:
            raise DimensionMismatchError(
                self.key_shape, tuple(key.shape[1:]), "key [kv_heads, head_dim]"
            )
        if tuple(value.shape[1:]) != self.value_shape:
            raise DimensionMismatchError(
                self.value_shape, tuple(value.shape[1:]), "value [kv_heads, head_dim]"
            )

    def nbytes(self) -> int:
        return self.keys.nbytes() + self.values.nbytes()


class Storage:
    """The K/V buffers of every layer of one cell cache, read back as ``dtype``."""

    def __init__(
        self, n: int, dtype: torch.dtype, device: torch.device, key_codec: Codec, value_codec: Codec
    ) -> None:
        self.n = n
        self.dtype = dtype
        self.device = device
        self.codecs = (key_codec, value_codec)
        self.layers: dict[int, LayerStorage] = {}

    def layer(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> LayerStorage:
        """The layer's storage, allocated on first use from the put's shapes."""
        st = self.layers.get(layer)
        if st is None:
            st = LayerStorage(self.n, key, value, self.codecs, self.device)
            self.layers[layer] = st
        st.check(key, value)
        return st

    def write(self, layer: int, locs: Locs, key: torch.Tensor, value: torch.Tensor) -> None:
        """Encode token rows into cells ``locs`` (a slice when the cells are contiguous)."""
        st = self.layer(layer, key, value)
        st.keys.write(locs, key)
        st.values.write(locs, value)

    def view(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cells [lo, hi) of a layer as ``dtype``: keys [L, H, Dk], values [L, H, Dv]
        (views for a float codec of that dtype, else decoded copies of just that range)."""
        st = self.layers[layer]
        return st.keys.read(lo, hi, self.dtype), st.values.read(lo, hi, self.dtype)

    def nbytes(self) -> int:
        return sum(st.nbytes() for st in self.layers.values())


def check_kv(key: object, value: object, tokens: int) -> None:
    """Raise a typed error unless key and value are float tensors [tokens, H, D]."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(name, type(t).__name__, "a torch.Tensor")
        if t.dim() != 3:
            raise DimensionMismatchError(
                "rank 3 [tokens, kv_heads, head_dim]", tuple(t.shape), f"{name} rank"
            )
        if not t.is_floating_point():
            raise InvalidArgumentError(f"{name}.dtype", t.dtype, "a floating dtype")
        if t.shape[0] != tokens:
            raise DimensionMismatchError(tokens, t.shape[0], f"{name} tokens (batch length)")
    assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
    if key.shape[1] != value.shape[1]:
        raise DimensionMismatchError(key.shape[1], value.shape[1], "value kv_heads (= key's)")

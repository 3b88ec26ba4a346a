"""Per-layer K/V tensors of a cell cache, preallocated and written in place.

Layout (token-major, one row per cell, shared cell index across layers)::

    keys[layer]   : [N, kv_heads, head_dim_k]
    values[layer] : [N, kv_heads, head_dim_v]

A layer's tensors are allocated on its first write (K and V head dims may differ), zero
filled, and never reallocated. Reads hand back views of a cell range, never copies.
"""

from __future__ import annotations

import torch

from kvcache.errors import DimensionMismatchError, InvalidArgumentError


class LayerStorage:
    """K and V tensors of one layer."""

    def __init__(
        self,
        n: int,
        key: torch.Tensor,
        value: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.keys = torch.zeros((n, *key.shape[1:]), dtype=dtype, device=device)  # [N, H, Dk]
        self.values = torch.zeros((n, *value.shape[1:]), dtype=dtype, device=device)  # [N, H, Dv]

    def check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Raise if a put's per-token shapes differ from what this layer holds."""
        if key.shape[1:] != self.keys.shape[1:]:
            raise DimensionMismatchError(
                tuple(self.keys.shape[1:]), tuple(key.shape[1:]), "key [kv_heads, head_dim]"
            )
        if value.shape[1:] != self.values.shape[1:]:
            raise DimensionMismatchError(
                tuple(self.values.shape[1:]), tuple(value.shape[1:]), "value [kv_heads, head_dim]"
            )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


class Storage:
    """The K/V tensors of every layer of one cell cache."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device) -> None:
        self.n = n
        self.dtype = dtype
        self.device = device
        self.layers: dict[int, LayerStorage] = {}

    def layer(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> LayerStorage:
        """The layer's storage, allocated on first use from the put's shapes."""
        st = self.layers.get(layer)
        if st is None:
            st = LayerStorage(self.n, key, value, self.dtype, self.device)
            self.layers[layer] = st
        st.check(key, value)
        return st

    def write(
        self, layer: int, locs: torch.Tensor | slice, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Write token rows into cells ``locs`` (a slice when the cells are contiguous)."""
        st = self.layer(layer, key, value)
        if isinstance(locs, slice):
            st.keys[locs] = key
            st.values[locs] = value
        else:
            st.keys.index_copy_(0, locs, key.to(self.dtype))
            st.values.index_copy_(0, locs, value.to(self.dtype))

    def view(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of cells [lo, hi) of a layer: keys [L, H, Dk], values [L, H, Dv]."""
        st = self.layers[layer]
        return st.keys[lo:hi], st.values[lo:hi]

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

"""Per-layer K/V buffers of a cell cache, preallocated and written in place.

Layout (token-major, one row per cell, shared cell index across layers)::

    keys[layer]   : [N, kv_heads, head_dim_k]   in the key codec's format
    values[layer] : [N, kv_heads, head_dim_v]   in the value codec's format

A layer's buffers are allocated on its first write (K and V head dims may differ), zero
filled, and never reallocated. Reads hand back a cell range only: a view for a float codec
in the compute dtype, a decoded copy of that range (never of the whole cache) otherwise.

Keys can be stored *before* RoPE (``rope=`` a shift function): a write un-rotates each key
by its position (``rope(layer, k, -pos)``) before the codec sees it and a read rotates the
decoded keys back by their cells' positions. Quantizers that work per channel see each
channel's own distribution then, instead of pairs of channels mixed at a speed that depends
on the position (KVQuant, Hooper et al. 2024, section 3.2). What callers write and read is
always the rotated key.
"""

from __future__ import annotations

import torch

from kvcache.codecs import Codec
from kvcache.codecs.base import Locs
from kvcache.errors import DimensionMismatchError, InvalidArgumentError
from kvcache.protocol import ShiftFn


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
    """The K/V buffers of every layer of one cell cache, read back as ``dtype``.

    With ``rope`` (a :data:`~kvcache.protocol.ShiftFn`) keys are stored un-rotated: every
    write, read and gather then needs the positions of its rows.
    """

    def __init__(
        self,
        n: int,
        dtype: torch.dtype,
        device: torch.device,
        key_codec: Codec,
        value_codec: Codec,
        rope: ShiftFn | None = None,
    ) -> None:
        self.n = n
        self.dtype = dtype
        self.device = device
        self.codecs = (key_codec, value_codec)
        self.rope = rope
        self._negated: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions, -positions)
        self.layers: dict[int, LayerStorage] = {}

    def layer(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> LayerStorage:
        """The layer's storage, allocated on first use from the put's shapes."""
        st = self.layers.get(layer)
        if st is None:
            st = LayerStorage(self.n, key, value, self.codecs, self.device)
            self.layers[layer] = st
        st.check(key, value)
        return st

    def write(
        self,
        layer: int,
        locs: Locs,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Encode token rows into cells ``locs`` (a slice when the cells are contiguous);
        ``positions`` [T] of the rows are needed when keys are stored before RoPE."""
        st = self.layer(layer, key, value)
        st.keys.write(locs, self._unrotate(layer, key, positions))
        st.values.write(locs, value)

    def view(
        self, layer: int, lo: int, hi: int, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cells [lo, hi) of a layer as ``dtype``: keys [L, H, Dk], values [L, H, Dv]
        (views for a float codec of that dtype, else decoded copies of just that range);
        ``positions`` [L] of those cells are needed when keys are stored before RoPE."""
        st = self.layers[layer]
        keys = self._rotate(layer, st.keys.read(lo, hi, self.dtype), positions)
        return keys, st.values.read(lo, hi, self.dtype)

    def gather(
        self, layer: int, cells: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K/V rows of ``cells`` (rotated keys), as ``dtype``."""
        st = self.layers[layer]
        keys = self._rotate(layer, st.keys.gather(cells, self.dtype), positions)
        return keys, st.values.gather(cells, self.dtype)

    def _unrotate(
        self, layer: int, key: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """Keys as stored: un-rotated by their positions when stored before RoPE."""
        if self.rope is None:
            return key
        positions = _required(positions)
        if self._negated is None or self._negated[0] is not positions:
            self._negated = (positions, -positions)  # one tensor for every layer's write
        return self.rope(layer, key, self._negated[1])

    def _rotate(
        self, layer: int, keys: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """Decoded keys as the model wrote them (rotated back when stored before RoPE)."""
        if self.rope is None:
            return keys
        return self.rope(layer, keys, _required(positions)).to(self.dtype)

    def nbytes(self) -> int:
        return sum(st.nbytes() for st in self.layers.values())


def _required(positions: torch.Tensor | None) -> torch.Tensor:
    if positions is None:
        raise InvalidArgumentError("positions", None, "row positions (keys stored pre-RoPE)")
    return positions


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

"""Per-layer K/V buffers of a cell cache, written in place through a codec.

Layout (token-major, one row per cell, shared cell index across layers)::

    keys[layer]   : [N, kv_heads, head_dim_k]   in the key codec's format
    values[layer] : [N, kv_heads, head_dim_v]   in the value codec's format
    windows       : per distinct codec window (kvcache.recent), the fp16 slot and metadata
                    record of every cell, shared by every layer's buffers

A layer's buffers are allocated on its first write (K and V head dims may differ) and
written in place; quantizing codecs allocate codes only up to the highest encoded cell.
Reads hand back decoded rows of the requested cells (a view for a float codec read in its
own dtype); the attention kernels read the buffers' layouts directly. What is stored is what
the cache hands in: keys stored before RoPE are un-rotated by the cache (``causal.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.cells import Cells
from kvcache.codecs import Codec
from kvcache.codecs.base import Buffer, Layout, Locs, RotaryFrame
from kvcache.errors import DimensionMismatchError, InvalidArgumentError
from kvcache.recent import SealPlan, Windows, WindowSpec

Seals = tuple[SealPlan | None, SealPlan | None]  # one forward's plans: keys', values'


class LayerStorage:
    """K and V buffers of one layer, each in its codec's format."""

    def __init__(
        self, keys: Buffer, values: Buffer, key_shape: tuple[int, int], value_shape: tuple[int, int]
    ):
        self.keys, self.values = keys, values
        self.key_shape = key_shape  # (H, Dk)
        self.value_shape = value_shape  # (H, Dv)

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
        self,
        n: int,
        dtype: torch.dtype,
        device: torch.device,
        key_codec: Codec,
        value_codec: Codec,
        frame: RotaryFrame | None = None,
    ) -> None:
        """``frame``: keys after RoPE centred in a rotary frame (a ``rotary_centre`` key
        codec; see RotaryFrame)."""
        for codec in (key_codec, value_codec):
            codec.check_device(device)
        self.n = n
        self.dtype = dtype
        self.device = device
        self.codecs = (key_codec, value_codec)
        self.frame = frame
        specs = {c.spec for c in self.codecs if c.spec is not None}
        self.windows: dict[WindowSpec, Windows] = {s: Windows(n, s) for s in specs}
        self.roles = tuple(self.windows_of(c) for c in self.codecs)  # keys', values' windows
        self.layers: dict[int, LayerStorage] = {}

    def windows_of(self, codec: Codec) -> Windows | None:
        return None if codec.spec is None else self.windows[codec.spec]

    def plan(self, cells: Cells, locs: np.ndarray, seqs: np.ndarray) -> Seals:
        """What a forward that placed ``locs`` does to the keys' and the values' windows
        (commits their state; K and V with the same window share one plan)."""
        plans = {id(w): w.plan(cells, locs, seqs) for w in self.windows.values()}
        key, value = (None if w is None else plans[id(w)] for w in self.roles)
        return key, value

    def layer(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> LayerStorage:
        """The layer's storage, allocated on first use from the put's shapes."""
        st = self.layers.get(layer)
        if st is None:
            k_shape = (int(key.shape[1]), int(key.shape[2]))
            v_shape = (int(value.shape[1]), int(value.shape[2]))
            st = self.new_layer(k_shape, v_shape)
            self.layers[layer] = st
        st.check(key, value)
        return st

    def new_layer(self, k_shape: tuple[int, int], v_shape: tuple[int, int]) -> LayerStorage:
        """Empty buffers for a layer of these (kv_heads, head_dim) shapes, not yet registered."""
        kc, vc = self.codecs
        return LayerStorage(
            kc.allocate_keys(self.n, *k_shape, self.device, self.windows_of(kc), self.frame),
            vc.allocate(self.n, *v_shape, self.device, self.windows_of(vc)),
            k_shape,
            v_shape,
        )

    def write(
        self,
        layer: int,
        locs: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        seals: Seals,
    ) -> None:
        """Store token rows into cells ``locs`` [T] as the forward's seal plans say."""
        st = self.layer(layer, key, value)
        st.keys.store(locs, key, seals[0])
        st.values.store(locs, value, seals[1])

    def read(self, layer: int, cells: Locs) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K and V rows of ``cells`` as ``dtype`` (views for a float codec in that
        dtype when ``cells`` is a slice): [n, H, Dk], [n, H, Dv]."""
        return self.read_keys(layer, cells), self.read_values(layer, cells)

    def read_keys(self, layer: int, cells: Locs) -> torch.Tensor:
        """Decoded K rows of ``cells`` only, as ``read``'s first: [n, H, Dk]."""
        return self._layer(layer).keys.decode(cells, self.dtype)

    def read_values(self, layer: int, cells: Locs) -> torch.Tensor:
        """Decoded V rows of ``cells`` only, as ``read``'s second: [n, H, Dv]."""
        return self._layer(layer).values.decode(cells, self.dtype)

    def layouts(self, layer: int) -> tuple[Layout, Layout]:
        st = self._layer(layer)
        return st.keys.layout(), st.values.layout()

    def rewrite_keys(self, layer: int, cells: torch.Tensor, keys: torch.Tensor) -> None:
        self._layer(layer).keys.rewrite(cells, keys)

    def release(self, cells: np.ndarray) -> None:
        """``cells`` became free: their window rows and metadata go."""
        for w in self.windows.values():
            w.release(cells)

    def forget(self, seq: int) -> None:
        for w in self.windows.values():
            w.forget(seq)

    def share(self, src: int, dst: int) -> None:
        for w in self.windows.values():
            w.share(src, dst)

    def nbytes(self) -> int:
        """Every buffer of every layer, plus the windows' slot and metadata maps."""
        maps = sum(w.slot_of.nbytes + w.meta_of.nbytes for w in self.windows.values())
        return sum(st.nbytes() for st in self.layers.values()) + (maps if self.layers else 0)

    def _layer(self, layer: int) -> LayerStorage:
        st = self.layers.get(layer)
        if st is None:
            raise InvalidArgumentError("layer", layer, f"one of {sorted(self.layers)}")
        return st


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

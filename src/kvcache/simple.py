"""The small per-layer append cache (seed API): one sequence, one growing buffer per layer.

Layout per layer: ``[capacity, num_heads, head_dim]`` buffers whose first ``lengths[layer]``
rows are valid. Buffers grow geometrically (doubling, capped at ``max_seq_len``), so an
append copies only the new rows except on the rare growth step: no per-call concatenation
of the whole history.
"""

from __future__ import annotations

import torch

from kvcache.errors import CacheFullError, DimensionMismatchError, InvalidArgumentError
from kvcache.validate import config_int, is_int

_INITIAL_ROWS = 16


class KVCache:
    """Per-layer K/V of one sequence with a hard ``max_seq_len``."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.num_layers = config_int("num_layers", num_layers, 1)
        self.num_heads = config_int("num_heads", num_heads, 1)
        self.head_dim = config_int("head_dim", head_dim, 1)
        self.max_seq_len = config_int("max_seq_len", max_seq_len, 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidArgumentError("dtype", dtype, "a floating torch.dtype")
        self.dtype = dtype
        rows = min(_INITIAL_ROWS, self.max_seq_len)
        shape = (rows, self.num_heads, self.head_dim)
        self._k = [torch.zeros(shape, dtype=dtype) for _ in range(self.num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype) for _ in range(self.num_layers)]
        self.lengths = [0] * self.num_layers

    def append_kv(self, layer: int, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Append tokens [new_tokens, num_heads, head_dim] to a layer.

        Raises InvalidArgumentError (bad layer or dtype), DimensionMismatchError (bad shape)
        or CacheFullError (would exceed max_seq_len); on error nothing is appended.
        """
        if not is_int(layer) or not 0 <= int(layer) < self.num_layers:
            raise InvalidArgumentError("layer", layer, f"an int in [0, {self.num_layers})")
        layer = int(layer)
        want = (self.num_heads, self.head_dim)
        for name, t in (("new_k", new_k), ("new_v", new_v)):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(name, type(t).__name__, "a torch.Tensor")
            if t.dim() != 3 or tuple(t.shape[1:]) != want:
                raise DimensionMismatchError(
                    f"[new_tokens, {want[0]}, {want[1]}]", tuple(t.shape), f"{name} shape"
                )
            if not t.is_floating_point():
                raise InvalidArgumentError(f"{name}.dtype", t.dtype, "a floating dtype")
        if new_k.shape[0] != new_v.shape[0]:
            raise DimensionMismatchError(new_k.shape[0], new_v.shape[0], "new_v tokens (= new_k's)")
        n, old = new_k.shape[0], self.lengths[layer]
        if old + n > self.max_seq_len:
            raise CacheFullError(n, self.max_seq_len - old, self.max_seq_len)
        self._reserve(layer, old + n)
        self._k[layer][old : old + n] = new_k
        self._v[layer][old : old + n] = new_v
        self.lengths[layer] = old + n

    def _reserve(self, layer: int, rows: int) -> None:
        have = self._k[layer].shape[0]
        if rows <= have:
            return
        grown = min(max(rows, 2 * have), self.max_seq_len)
        for bufs in (self._k, self._v):
            new = torch.zeros((grown, self.num_heads, self.head_dim), dtype=self.dtype)
            new[: self.lengths[layer]] = bufs[layer][: self.lengths[layer]]
            bufs[layer] = new

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views of a layer's stored K and V [len, num_heads, head_dim]; None if no such layer."""
        if not is_int(layer) or not 0 <= int(layer) < self.num_layers:
            return None
        n = self.lengths[int(layer)]
        return self._k[int(layer)][:n], self._v[int(layer)][:n]

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per-layer views of the stored keys."""
        return [k[:n] for k, n in zip(self._k, self.lengths, strict=True)]

    @property
    def values(self) -> list[torch.Tensor]:
        """Per-layer views of the stored values."""
        return [v[:n] for v, n in zip(self._v, self.lengths, strict=True)]

    @property
    def seq_len(self) -> int:
        """Tokens held by the longest layer (all layers, once a forward has finished)."""
        return max(self.lengths)

    def current_len(self) -> int:
        return self.seq_len

    def memory_usage_bytes(self) -> int:
        """Bytes of the K/V actually stored (rows held x heads x dim x element size x 2)."""
        per_row = self.num_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        return 2 * per_row * sum(self.lengths)

    def allocated_bytes(self) -> int:
        """Bytes of the buffers as allocated (>= memory_usage_bytes, growth headroom)."""
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    def clear(self) -> None:
        """Forget every token (buffers are kept for reuse)."""
        self.lengths = [0] * self.num_layers

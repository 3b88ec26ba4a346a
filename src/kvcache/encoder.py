"""The encoder cache: position-independent K/V (cross-attention), computed once.

One item per layer (e.g. Whisper's cross-attention K/V of an audio chunk, an image's
projected states), shared by every sequence. It is written only in a forward whose batch
carries encoder inputs, and stays valid until ``remove`` covers the encoder's position.
"""

from __future__ import annotations

import torch

from kvcache.batch import Batch
from kvcache.errors import CallOrderError, InvalidArgumentError
from kvcache.validate import int_arg


class EncoderCache:
    """Cross-attention K/V per layer; ``get`` returns mask None (every row sees all of it)."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._cached = False
        self._cached_pos: int | None = None  # position of the token that carried the input
        self._pending_pos: int | None = None
        self._reserve = False
        self._started = False

    @property
    def encoder_cached(self) -> bool:
        """Whether stored K/V are valid (a put happened and no remove covered them)."""
        return self._cached

    def start_forward(self, batch: Batch, reserve: bool = False) -> None:
        """Note the encoder position of this batch (its last encoder input); never fails."""
        if not isinstance(batch, Batch):
            raise InvalidArgumentError("batch", type(batch).__name__, "a kvcache.Batch")
        if batch.encoder_inputs:
            self._pending_pos = batch.positions[batch.encoder_inputs[-1]]
        self._reserve = reserve
        self._started = True

    def put(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a layer's encoder K/V (any shape, e.g. [frames, H, D]); replaces the old."""
        if not self._started:
            raise CallOrderError("no forward in progress: call start_forward(batch) first")
        layer = int_arg("layer", layer)
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise InvalidArgumentError(name, type(t).__name__, "a floating torch.Tensor")
        if not self._reserve:
            self._cached_pos = self._pending_pos
            self._cached = True
        self.keys[layer] = self._store(self.keys.get(layer), key)
        self.values[layer] = self._store(self.values.get(layer), value)

    def put_item(self, layer: int, item: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Overwrite item ``item`` (first axis) of a layer's stored K/V in place: one input
        among several held side by side (e.g. one file's audio window) changes, the rest stays."""
        layer, item = int_arg("layer", layer), int_arg("item", item)
        if layer not in self.keys:
            raise CallOrderError(f"encoder layer {layer} holds nothing: put(layer, ...) first")
        old_k, old_v = self.keys[layer], self.values[layer]
        if item >= old_k.shape[0]:
            raise InvalidArgumentError("item", item, f"an index < {old_k.shape[0]}")
        for name, new, old in (("key", key, old_k), ("value", value, old_v)):
            if not isinstance(new, torch.Tensor) or tuple(new.shape) != tuple(old.shape[1:]):
                got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
                raise InvalidArgumentError(name, got, f"a tensor of shape {tuple(old.shape[1:])}")
        old_k[item].copy_(key)
        old_v[item].copy_(value)

    @staticmethod
    def _store(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        if old is not None and old.shape == new.shape and old.dtype == new.dtype:
            return old.copy_(new)  # reuse the buffer: write in place
        return new.detach().clone()

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The layer's encoder K/V and no mask."""
        layer = int_arg("layer", layer)
        if layer not in self.keys:
            raise CallOrderError(f"encoder layer {layer} holds nothing: put(layer, ...) first")
        return self.keys[layer], self.values[layer], None

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        self.put(layer, key, value)
        return self.get(layer)

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        """Invalidate the stored K/V when the encoder's position lies in [begin, end)."""
        int_arg("seq", seq)
        begin = int_arg("begin", begin)
        if end is not None:
            end = int_arg("end", end, minimum=begin)
        p = self._cached_pos
        if self._cached and p is not None and begin <= p and (end is None or p < end):
            self._cached = False

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """No-op: encoder K/V are shared by every sequence already (Ollama panics here)."""
        int_arg("src", src), int_arg("dst", dst), int_arg("length", length)

    def can_resume(self, seq: int, pos: int) -> bool:
        return True

    def memory_usage_bytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def close(self) -> None:
        self.keys.clear()
        self.values.clear()
        self._cached = False

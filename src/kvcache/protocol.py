"""The protocol every cache implements, so models and wrappers can take any of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from kvcache.batch import Batch

# (layer, keys [n, H, D], offsets [n] int64) -> keys re-rotated by offsets positions
ShiftFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@runtime_checkable
class RotaryShift(Protocol):
    """A shift that is a rotary embedding in rotate-half layout (HuggingFace Llama's): the
    cache's kernels apply it from cos/sin tables instead of calling it per layer.

    ``tables(positions, dtype)`` -> ``(cos, sin_signed)`` [n, 1, D] with
    ``rotate(x, cos, sin_signed) = x * cos + (x[D/2:], x[:D/2]) * sin_signed``.
    """

    def __call__(self, layer: int, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor: ...
    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rotate(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class Cache(Protocol):
    """What a model calls: one start_forward per forward, then put/get per layer."""

    def start_forward(self, batch: Batch, reserve: bool = False) -> None: ...
    def put(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None: ...
    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...
    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...
    def remove(self, seq: int, begin: int, end: int | None = None) -> None: ...
    def copy_prefix(self, src: int, dst: int, length: int) -> None: ...
    def can_resume(self, seq: int, pos: int) -> bool: ...
    def memory_usage_bytes(self) -> int: ...
    def close(self) -> None: ...

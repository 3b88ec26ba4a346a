"""What a codec is: how one layer's K (or V) rows are stored in the cells.

A :class:`Codec` makes :class:`Buffer` s; a buffer holds N cells of ``[heads, dim]`` rows
in its own format and hands back float tensors for a cell range (a view when the format
is the compute dtype itself, else a dequantized copy of just that range). The cache does
not know or care which format it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

Locs = torch.Tensor | slice  # cell indices (LongTensor) or a contiguous slice of cells


class Buffer(ABC):
    """N cells of [heads, dim] rows in one storage format."""

    @abstractmethod
    def write(self, locs: Locs, x: torch.Tensor) -> None:
        """Encode rows ``x`` [T, H, D] into cells ``locs``."""

    @abstractmethod
    def read(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows of cells [lo, hi) as ``dtype`` [L, H, D] (a view where no decoding is needed)."""

    @abstractmethod
    def gather(self, cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of the given cells as ``dtype`` [n, H, D] (a copy)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of every tensor the buffer holds (codes and all metadata)."""


class Codec(ABC):
    """A storage format for K or V rows; ``name`` is its registry key."""

    name: str

    @abstractmethod
    def allocate(self, n: int, heads: int, dim: int, device: torch.device) -> Buffer:
        """A zero-initialised buffer of ``n`` cells."""

    def bytes_per_row(self, heads: int, dim: int) -> float:
        """Stored bytes of one cell's [heads, dim] row, metadata included."""
        return self.allocate(1, heads, dim, torch.device("cpu")).nbytes()


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)

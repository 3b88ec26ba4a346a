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
    """A storage format for K or V rows; ``name`` is its registry key.

    ``pre_rope``: as a key codec, this format quantizes keys better before RoPE (a cell
    cache with a shift function then stores them un-rotated, see ``storage.py``).
    """

    name: str
    pre_rope: bool = False

    @abstractmethod
    def allocate(self, n: int, heads: int, dim: int, device: torch.device) -> Buffer:
        """A zero-initialised buffer of ``n`` cells."""

    def bytes_per_row(self, heads: int, dim: int) -> float:
        """Stored bytes of one cell's [heads, dim] row, metadata included."""
        return self.allocate(1, heads, dim, torch.device("cpu")).nbytes()


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Centre:
    """A per-(head, channel) offset subtracted before encoding keys and added back after
    decoding: the mean of the buffer's first written rows, fixed from then on (fp16 [H, D],
    counted in ``nbytes``).

    Keys of a head share a large common component (Llama's "massive" key channels); a
    quantizer that spends its range on it has little left for what tells tokens apart.
    Any fixed offset round-trips exactly, so cells written before or after, freed or
    shared, all decode with the same one; it only has to be a typical key.
    """

    def __init__(self, heads: int, dim: int, device: torch.device) -> None:
        self.value = torch.zeros((heads, dim), dtype=torch.float16, device=device)
        self._float = self.value.float()
        self.fixed = False

    def remove(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H, D] minus the centre, as float32 (the first call fixes the centre)."""
        x = x.float()
        if not self.fixed and x.shape[0] > 0:
            self.fix(x.mean(dim=0).to(torch.float16))
        return x - self._float

    def fix(self, value: torch.Tensor) -> None:
        """Set the centre [H, D] (fp16) now; rows already written would decode wrongly."""
        self.value, self._float, self.fixed = value, value.float(), True

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """Add the centre back to decoded rows ``x`` [L, H, D] (in place)."""
        return x.add_(self._float if x.dtype == torch.float32 else self.value.to(x.dtype))

    def nbytes(self) -> int:
        return tensor_bytes(self.value)

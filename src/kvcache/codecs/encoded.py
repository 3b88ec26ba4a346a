"""The stored form of a batch of TurboQuant-coded vectors (what a cache keeps per row).

Layout of an :class:`Encoded` batch of N vectors (every field is ``[N, width]``)::

    codes    uint8 [N, ceil(P*b/8)]    packed codebook indices (``pack.py``'s layout)
    scale    bf16  [N, 1]              per-vector scale; its sign bit = "offset subtracted"
    sketch   uint8 [N, ceil(m/8)]      QJL sign bits of the residual (width 0 without QJL)
    residual bf16  [N, 1]              QJL residual norm ||r|| (width 0 without QJL)

The scale's sign bit carries a flag for free (scales are >= 0; -0.0 keeps the flag of a zero
vector): :func:`with_flag` and :func:`split_flag` put it in and take it out.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

SCALE_DTYPE = torch.bfloat16  # bfloat16 cannot overflow; float16 measured equal quality


@dataclass(frozen=True)
class Encoded:
    """A batch of N encoded vectors; every field is [N, width] (layout in the module doc)."""

    codes: torch.Tensor
    scale: torch.Tensor
    sketch: torch.Tensor
    residual: torch.Tensor

    def __len__(self) -> int:
        return self.codes.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The stored buffers, in field order (what a cache preallocates and counts)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def nbytes(self) -> int:
        """Bytes of every stored buffer (codes, scales, sketches, residual norms)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def rows(self, start: int, stop: int) -> Encoded:
        """Views of rows [start, stop)."""
        return Encoded(*(t[start:stop] for t in self.tensors()))


def with_flag(scale: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor:
    """Non-negative scales [N, 1] -> bf16 with the flag in the sign bit (-0.0 keeps it;
    None: every flag clear)."""
    return (
        scale.to(SCALE_DTYPE) if flag is None else torch.where(flag, -scale, scale).to(SCALE_DTYPE)
    )


def split_flag(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, 1] -> (scale >= 0 float32 [N, 1], flag 0/1 float32 [N, 1])."""
    return stored.float().abs(), torch.signbit(stored).float()

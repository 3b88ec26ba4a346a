"""Bit packing of small unsigned codes into uint8 (little end first), vectorized."""

from __future__ import annotations

import torch


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes q [..., D] (uint8, < 2**bits) -> bytes [..., D * bits / 8]."""
    per = 8 // bits
    q = q.to(torch.uint8).reshape(*q.shape[:-1], -1, per)  # [..., D/per, per]
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def unpack(b: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes [..., D * bits / 8] -> codes [..., D] (uint8)."""
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(b >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*b.shape[:-1], -1)


def check_bits(bits: int) -> bool:
    return bits in (1, 2, 4, 8)

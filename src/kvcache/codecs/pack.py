"""Bit packing of small unsigned codes into uint8 (little end first), vectorized."""

from __future__ import annotations

import sys

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


def unpack4(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., D/2] -> 4-bit codes [..., D] (uint8), as ``unpack(b, 4)`` but in 3
    contiguous integer ops: each byte widened to int16 becomes ``(b | b << 4) & 0x0F0F``,
    whose two bytes in memory are (low nibble, high nibble) on a little-endian machine, so
    viewing the int16 lanes as uint8 is the unpacked row (no stack, no reshape copy)."""
    if sys.byteorder != "little":
        return unpack(b, 4)
    t = b.contiguous().to(torch.int16)
    u = torch.bitwise_left_shift(t, 4)
    u.bitwise_or_(t).bitwise_and_(0x0F0F)
    return u.view(torch.uint8)


def check_bits(bits: int) -> bool:
    return bits in (1, 2, 4, 8)

"""Encoders of the codecs in C++ (``csrc/encode.cpp``): rows to codes, written into the
buffer's cells in one call (int8; affine rows: int4 and KIVI's values; KIVI's keys: a
record's channel ranges, then codes against them; turbo's rotated codebook codes).

A decode step that seals a sequence's oldest window rows encodes a few dozen rows per layer
and K/V; as torch expressions that is ~20 small ops a call, and with sequences of different
lengths some sequence seals on every other step. The kernels equal the torch expressions of
``kvcache.codecs.ints``, ``kvcache.codecs.kivi`` and ``kvcache.codecs.quantizer`` bit for bit
(tests/test_encode.py, tests/test_turbo.py);
``KVCACHE_ENCODE=reference`` (or a tensor the kernels do not serve: not float32, not on the
CPU) takes the torch path.
"""

from __future__ import annotations

import os

import torch

from kvcache.kernels.build import extension

ENCODE_ENV = "KVCACHE_ENCODE"  # "reference": the codecs' torch expressions
TURBO_MAX_PADDED = 1024  # turbo rows the kernel encodes: at most this many padded channels


def served(x: torch.Tensor, *outputs: torch.Tensor) -> bool:
    """Whether the kernels encode rows ``x`` into ``outputs``."""
    return (
        os.environ.get(ENCODE_ENV, "") != "reference"
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and all(t.device.type == "cpu" and t.is_contiguous() for t in outputs)
    )


def int8(x: torch.Tensor, cells: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Rows ``x`` [n, H, D] into ``codes`` [N, H, D] int8 and ``scale`` [N, H, 1] fp16 at
    ``cells`` [n]."""
    extension().encode_int8(x.contiguous(), cells.long().contiguous(), codes, scale)


def affine(
    x: torch.Tensor,
    cells: torch.Tensor,
    bits: int,
    group: int,
    codes: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
    refits: int = 0,
) -> None:
    """Rows ``x`` [n, H, D] into packed ``codes`` [N, H, D*bits/8] and the groups' ``scale``
    and ``low`` [N, H, D/group] fp16 at ``cells`` [n], each group's range refitted
    ``refits`` times (``codecs.ints.affine_ranges``)."""
    extension().encode_affine(
        x.contiguous(), cells.long().contiguous(), bits, group, codes, scale, low, refits
    )


def ranges(x: torch.Tensor, meta: int, bits: int, scale: torch.Tensor, low: torch.Tensor) -> None:
    """Record ``meta`` of ``scale`` and ``low`` [M, H, D] fp16: the per-channel range of rows
    ``x`` [m, H, D] in ``bits``-bit steps, and its minimum."""
    extension().range_channels(x.contiguous(), int(meta), bits, scale, low)


def channels(
    x: torch.Tensor,
    cells: torch.Tensor,
    metas: torch.Tensor,
    bits: int,
    codes: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
) -> None:
    """Rows ``x`` [n, H, D] coded against the ranges of their records ``metas`` [n] into the
    packed ``codes`` [N, H, D*bits/8] at ``cells`` [n]."""
    extension().encode_channels(
        x.contiguous(),
        cells.long().contiguous(),
        metas.long().contiguous(),
        bits,
        codes,
        scale,
        low,
    )


def turbo(
    x: torch.Tensor,
    cells: torch.Tensor,
    offsets: torch.Tensor | None,
    signs: torch.Tensor,
    cell_codes: torch.Tensor,
    cell_squares: torch.Tensor,
    grid_bits: int,
    bits: int,
    codes: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """Rows ``x`` [n, H, D] rotated (head h's ``signs`` [H, P], then the Walsh-Hadamard
    butterflies), normed and coded on the codebook's grid (``cell_codes`` uint8 and
    ``cell_squares`` [16 * 2^grid_bits]) into packed ``codes`` [N, H, P*bits/8] and the
    flagged bf16 ``scale`` [N, H, 1] at ``cells`` [n]; ``offsets`` [n or 1, H, D] are
    subtracted from the rows whose norm they shrink."""
    extension().encode_turbo(
        x.contiguous(),
        cells.long().contiguous(),
        torch.empty(0) if offsets is None else offsets.float().contiguous(),
        signs.float().contiguous(),
        cell_codes,
        cell_squares,
        int(grid_bits),
        int(bits),
        codes,
        scale,
    )

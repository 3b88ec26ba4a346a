"""The one bit packer of the codecs: rows of small unsigned codes (1..8 bits) <-> uint8 bytes.

Layout (a compiled kernel reads it; ``tests/test_pack.py`` pins it byte by byte): a row of C
codes of ``bits`` bits becomes ``ceil(C * bits / 8)`` bytes, little end first: code i
occupies bits ``[i * bits, (i + 1) * bits)`` of the row, bit 0 being the low bit of byte 0.
So at 4 bits byte j holds code 2j in its low nibble and code 2j+1 in its high nibble; at 3
bits codes 0..7 fill bytes 0..2 (code 2 straddles bytes 0 and 1). Unused high bits of the
last byte are 0. Leading dimensions are kept: codes ``[..., C]`` -> bytes ``[..., W]``.

How, per width (the fastest measured here, see ``benchmarks/pack_speed.py``):

    bits  pack                                    unpack
    8     a uint8 copy                            a uint8 copy
    4     2 strided uint8 shifts + or             int16 widening trick (``unpack4``)
    2     4 strided uint8 shifts + or             4 shifted, masked copies, interleaved
    1     8 strided uint8 shifts + or             one lookup in a [256, 8] byte table
    3,5,6,7  k codes -> one word (k strided       the word widened to int32/int64, shifted
          adds, exact in float32/float64/int64),  by a [k] vector, masked
          viewed as its k*bits/8 bytes
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from kvcache.errors import InvalidArgumentError
from kvcache.validate import is_int

# bits -> (codes per word k, bytes per word): k*bits is a whole number of bytes, and the
# word is exact in float32 (<= 24 bits) or float64 (<= 48 bits); 7 bits go through int64.
_WORDS = {1: (8, 1), 2: (4, 1), 3: (8, 3), 4: (2, 1), 5: (8, 5), 6: (4, 3), 7: (8, 7), 8: (1, 1)}

Packer = Callable[[torch.Tensor, int], torch.Tensor]  # ([..., C], bits) -> [..., W] uint8
Unpacker = Callable[[torch.Tensor, int, int], torch.Tensor]  # ([..., W], bits, C) -> [..., C]


def packed_width(count: int, bits: int) -> int:
    """Bytes per row for ``count`` codes of ``bits`` bits."""
    return (count * bits + 7) // 8


def check_bits(bits: int) -> bool:
    """Whether ``bits`` is a width this packer handles (1..8)."""
    return is_int(bits) and 1 <= bits <= 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., C] (integers < 2**bits, any dtype) -> bytes [..., ceil(C*bits/8)] uint8."""
    _check(bits)
    return PACKERS[bits](codes, bits)


def unpack(
    packed: torch.Tensor,
    bits: int,
    count: int | None = None,
    dtype: torch.dtype | None = torch.uint8,
) -> torch.Tensor:
    """Inverse of :func:`pack`: bytes [..., W] -> codes [..., count] (count defaults to every
    code the bytes hold, W * 8 // bits) as ``dtype``; None keeps the integer dtype the
    strategy makes (uint8, int32 or int64: an index for ``index_select`` without a copy)."""
    _check(bits)
    count = packed.shape[-1] * 8 // bits if count is None else count
    width = packed_width(count, bits)
    assert packed.shape[-1] == width, f"{count} codes of {bits} bits in {packed.shape[-1]} bytes"
    out = UNPACKERS[bits](packed, bits, count)
    return out if dtype is None else out.to(dtype)


def unpack4(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., D/2] -> 4-bit codes [..., D] (uint8), as ``unpack(b, 4)`` but in 3
    contiguous integer ops: each byte widened to int16 becomes ``(b | b << 4) & 0x0F0F``,
    whose two bytes in memory are (low nibble, high nibble) on a little-endian machine, so
    viewing the int16 lanes as uint8 is the unpacked row (no stack, no reshape copy)."""
    if sys.byteorder != "little":
        return unpack_shifts(b.reshape(-1, b.shape[-1]), 4, 2 * b.shape[-1]).view(*b.shape[:-1], -1)
    t = b.contiguous().to(torch.int16)
    u = torch.bitwise_left_shift(t, 4)
    u.bitwise_or_(t).bitwise_and_(0x0F0F)
    return u.view(torch.uint8)


def byte_codes(bits: int, device: torch.device | None = None) -> torch.Tensor:
    """[256, 8/bits] uint8: the codes a packed byte holds, low bits first (bits | 8)."""
    return _byte_codes(bits, torch.device("cpu") if device is None else device)


@functools.cache
def _byte_codes(bits: int, device: torch.device) -> torch.Tensor:
    assert 8 % bits == 0, f"byte tables need bits dividing 8, got {bits}"
    per = 8 // bits
    shifts = torch.arange(per) * bits  # [per]
    table = (torch.arange(256)[:, None] >> shifts) & ((1 << bits) - 1)  # [256, per]
    return table.to(torch.uint8).to(device)


def _check(bits: int) -> None:
    if not check_bits(bits):
        raise InvalidArgumentError("bits", bits, "an int in 1..8")


# -- strategies: codes [..., C] <-> bytes [..., W] (``benchmarks/pack_speed.py`` times them)


def pack_copy(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """bits == 8: a byte per code (a copy, never a view of the input)."""
    return codes.to(torch.uint8, copy=True)


def pack_bytes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """bits in (1, 2, 4): byte j = sum_i code_{j*per+i} << (bits*i), as uint8 shifts and ors."""
    per = 8 // bits
    q = codes.to(torch.uint8)
    if q.shape[-1] % per:
        q = torch.nn.functional.pad(q, (0, per - q.shape[-1] % per))
    out = q[..., 0::per].clone(memory_format=torch.contiguous_format)  # [..., W]
    for i in range(1, per):
        out |= q[..., i::per] << (bits * i)
    return out


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Any bits: k codes make one word of k*bits/8 bytes, added up exactly in a float
    (torch's integer shifts are not vectorized here) and viewed as its low bytes."""
    assert sys.byteorder == "little", "byte views assume a little-endian machine"
    lead, count = codes.shape[:-1], codes.shape[-1]
    flat = codes.reshape(-1, count)  # [N, C]
    n = flat.shape[0]
    k, nb = _WORDS[bits]
    groups = (count + k - 1) // k
    if groups * k != count:
        flat = torch.nn.functional.pad(flat, (0, groups * k - count))
    # float32 holds whole numbers < 2^24 exactly; on a GPU float64 even then: TF32 (often
    # switched on there) would round a float32 product
    short = nb <= 3 and codes.device.type == "cpu"
    dtype = torch.float32 if short else torch.float64 if bits != 7 else torch.int64
    c = flat.to(dtype)
    if dtype == torch.int64:  # 7 bits' 56-bit words: k strided adds (no integer matmul on a GPU)
        word = c[:, 0::k].clone(memory_format=torch.contiguous_format)  # [N, G]
        for i in range(1, k):
            word.add_(c[:, i::k], alpha=1 << (bits * i))
    else:  # [N, G, k] against the k place values in one product: every partial sum a whole
        # number under 2^24 (float32) or 2^53 (float64), so exact in any order
        places = torch.tensor([1 << (bits * i) for i in range(k)], dtype=dtype, device=c.device)
        word = c.view(n, groups, k) @ places  # [N, G]
    if nb == 1:
        return word.to(torch.uint8).view(*lead, groups)[..., : packed_width(count, bits)]
    word = word.to(torch.int32 if nb <= 3 else torch.int64)
    out = word.view(torch.uint8).view(n, groups, word.element_size())[:, :, :nb]
    return out.reshape(*lead, groups * nb)[..., : packed_width(count, bits)]


def unpack_copy(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """bits == 8: the bytes themselves (a copy)."""
    return packed.to(torch.uint8, copy=True)


def unpack_int16(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """bits == 4: :func:`unpack4`."""
    out = unpack4(packed)
    return out if out.shape[-1] == count else out[..., :count]


def unpack_table(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """bits in (1, 2, 4): one lookup per byte in the [256, 8/bits] table of its codes."""
    table = byte_codes(bits, packed.device)  # [256, 8/bits]
    out = table.index_select(0, packed.reshape(-1).int()).view(*packed.shape[:-1], -1)
    return out if out.shape[-1] == count else out[..., :count]


def unpack_words(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Any bits: each word's bytes widened to an int, shifted by a [k] vector, masked
    (int32 codes for words of <= 3 bytes, else int64)."""
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, packed.shape[-1])  # [N, W]
    n = flat.shape[0]
    k, nb = _WORDS[bits]
    groups = (count + k - 1) // k
    p = torch.nn.functional.pad(flat, (0, groups * nb - flat.shape[1])).view(n, groups, nb)
    wide, size = (torch.int32, 4) if nb <= 3 else (torch.int64, 8)
    word = torch.nn.functional.pad(p, (0, size - nb)).view(wide)  # [N, G, 1]
    shifts = torch.arange(k, dtype=wide, device=flat.device) * bits  # [k]
    codes = (word >> shifts) & ((1 << bits) - 1)  # [N, G, k]
    return codes.view(*lead, groups * k)[..., :count]


def unpack_shifts(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """bits in (1, 2, 4): 8/bits shifted and masked copies of the bytes, interleaved (any
    byte order)."""
    per = 8 // bits
    parts = [(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    out = torch.stack(parts, dim=-1).view(*packed.shape[:-1], -1)
    return out if out.shape[-1] == count else out[..., :count]


# bits -> strategy, the fastest measured here for the shapes the codecs use
PACKERS: dict[int, Packer] = {
    1: pack_bytes, 2: pack_bytes, 3: pack_words, 4: pack_bytes,
    5: pack_words, 6: pack_words, 7: pack_words, 8: pack_copy,
}  # fmt: skip
UNPACKERS: dict[int, Unpacker] = {
    1: unpack_table, 2: unpack_shifts, 3: unpack_words, 4: unpack_int16,
    5: unpack_words, 6: unpack_words, 7: unpack_words, 8: unpack_copy,
}  # fmt: skip


def candidates(bits: int) -> tuple[list[Packer], list[Unpacker]]:
    """Every strategy that can serve ``bits`` (the benchmark times them, the tests check them
    against a bit-by-bit reference): the tables above pick one of each."""
    divides = 8 % bits == 0
    packers: list[Packer] = [pack_words]
    packers += [pack_bytes] if divides else []
    packers += [pack_copy] if bits == 8 else []
    unpackers: list[Unpacker] = [unpack_words]
    unpackers += [unpack_table, unpack_shifts] if divides else []
    unpackers += [unpack_int16] if bits == 4 else [unpack_copy] if bits == 8 else []
    return packers, unpackers

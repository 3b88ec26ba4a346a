"""The one bit packer: its byte layout pinned literally for every width (a compiled kernel
reads it), a bit-by-bit reference over random shapes, and typed errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.codecs.pack import (
    PACKERS,
    UNPACKERS,
    candidates,
    pack,
    packed_width,
    unpack,
    unpack4,
)
from kvcache.errors import InvalidArgumentError

# bits -> (codes of one row, its bytes in hex). Code i occupies bits [i*bits, (i+1)*bits),
# little end first: at 4 bits, byte 0 is 0x21 = code 1 (low nibble) and code 2 (high).
LAYOUT = {
    1: ([1, 0, 1, 1, 0, 0, 0, 1, 1], "8d01"),
    2: ([1, 2, 3, 0, 3], "3903"),
    3: ([1, 2, 3, 4, 5, 6, 7, 0, 5], "d1581f05"),
    4: ([1, 2, 3, 4, 15], "21430f"),
    5: ([1, 2, 3, 4, 5, 6, 7, 31, 17], "410c52ccf911"),
    6: ([1, 2, 3, 63, 40], "8130fc28"),
    7: ([1, 2, 3, 4, 5, 6, 7, 127, 99], "01c18050301cfe63"),
    8: ([1, 2, 255, 128], "0102ff80"),
}


@pytest.mark.parametrize("bits", sorted(LAYOUT))
def test_layout_is_pinned_byte_by_byte(bits):
    codes, hexbytes = LAYOUT[bits]
    want = torch.tensor(list(bytes.fromhex(hexbytes)), dtype=torch.uint8)
    row = torch.tensor(codes)
    assert torch.equal(pack(row[None], bits)[0], want)
    assert torch.equal(unpack(want[None], bits, len(codes))[0], row.to(torch.uint8))
    # leading dimensions are kept, rows packed independently
    rows = torch.stack([row, row.flip(0)]).expand(3, 2, len(codes))
    packed = pack(rows, bits)
    assert packed.shape == (3, 2, packed_width(len(codes), bits))
    assert torch.equal(packed[1, 0], want)
    assert torch.equal(unpack(packed, bits, len(codes)), rows.to(torch.uint8))


def pack_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit-by-bit little-endian packer of rows [N, C]."""
    n, count = codes.shape
    out = torch.zeros(n, packed_width(count, bits), dtype=torch.uint8)
    for i in range(count):
        for j in range(bits):
            pos = i * bits + j
            bit = ((codes[:, i].long() >> j) & 1).to(torch.uint8)
            out[:, pos // 8] |= bit << (pos % 8)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bits=st.integers(1, 8),
    count=st.integers(1, 70),
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    dtype=st.sampled_from([torch.uint8, torch.int32, torch.float32]),
    seed=st.integers(0, 2**31),
)
def test_pack_matches_bit_by_bit_reference_and_round_trips(bits, count, lead, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, count), generator=g).to(dtype)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, packed_width(count, bits))
    flat = codes.reshape(-1, count)
    assert torch.equal(packed.reshape(flat.shape[0], -1), pack_reference(flat, bits))
    assert torch.equal(unpack(packed, bits, count), codes.to(torch.uint8))
    if count * bits % 8 == 0:  # whole bytes: the count can be left out
        assert torch.equal(unpack(packed, bits), codes.to(torch.uint8))
    if bits == 4 and count % 2 == 0:
        assert torch.equal(unpack4(packed), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", range(1, 9))
def test_every_candidate_strategy_equals_the_reference(bits):
    """What the benchmark times must be right, and the tables pick among them."""
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (7, 40), generator=g)
    packers, unpackers = candidates(bits)
    assert PACKERS[bits] in packers and UNPACKERS[bits] in unpackers
    want = pack_reference(codes, bits)
    for packer in packers:
        assert torch.equal(packer(codes, bits), want), packer.__name__
    for unpacker in unpackers:
        got = unpacker(want[None], bits, 40)[0]  # with a leading dimension
        assert not got.is_floating_point() and torch.equal(got.long(), codes), unpacker.__name__
    assert unpack(want, bits, 40).dtype == torch.uint8
    kept = unpack(want, bits, 40, dtype=None)  # the strategy's own integer dtype
    assert kept.dtype in (torch.uint8, torch.int32, torch.int64) and torch.equal(kept.long(), codes)


def test_outputs_never_alias_inputs():
    codes = torch.arange(16, dtype=torch.uint8).view(2, 8)
    packed = pack(codes, 8)
    packed += 1
    assert torch.equal(codes, torch.arange(16, dtype=torch.uint8).view(2, 8))
    codes_back = unpack(packed, 8)
    codes_back += 1
    assert torch.equal(packed, torch.arange(1, 17, dtype=torch.uint8).view(2, 8))


@pytest.mark.parametrize("bits", [0, 9, 2.0, True])
def test_bad_widths_raise_a_typed_error(bits):
    with pytest.raises(InvalidArgumentError, match="bits"):
        pack(torch.zeros(1, 8, dtype=torch.uint8), bits)
    with pytest.raises(InvalidArgumentError, match="bits"):
        unpack(torch.zeros(1, 8, dtype=torch.uint8), bits)

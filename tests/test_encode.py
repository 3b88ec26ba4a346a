"""kernels.encode: the codecs' encoders in C++ equal their torch expressions bit for bit
(codes, fp16 scales and minimums; turbo's codes and flagged bf16 scales), write only the
cells they are given, refuse bad arguments, and a cache that seals through them holds the
codes the torch path writes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.codecs.encoded import Encoded
from kvcache.codecs.ints import AffineRowsBuffer, Int8Buffer
from kvcache.codecs.kivi import ChannelBuffer
from kvcache.codecs.pack import packed_width
from kvcache.codecs.quantizer import HeadStack, TurboQuantizer, correct_sqrt, fixed_sum
from kvcache.kernels import encode
from kvcache.kernels.encode import ENCODE_ENV
from kvcache.models.rope import Rope


def _rows(n: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    """fp16-exact rows over 10 decades of magnitude, with a zero row, a constant row, a row
    of equal halves and fp16 subnormals (what stores hand the encoders: fp16 rounded)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g) * torch.logspace(-6, 4, n)[:, None, None]
    x[1] = 0.0
    x[2] = 1.5
    x[3, :, : dim // 2], x[3, :, dim // 2 :] = -2.0, 3.0
    x[4] = torch.randn(heads, dim, generator=g) * 3e-7
    return x.half().float()


def _fields_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (fp16 compared as its bits, so -0.0 != 0.0 and NaNs compare)."""
    if a.dtype == torch.float16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return torch.equal(a, b)


@pytest.mark.parametrize("dim", [64, 128])
def test_int8_kernel_equals_the_torch_expression(dim: int) -> None:
    heads, cells_n = 3, 40
    x = _rows(24, heads, dim, seed=dim)
    cells = torch.randperm(cells_n, generator=torch.Generator().manual_seed(1))[:24]
    got, want = (
        SimpleNamespace(
            codes=torch.zeros(cells_n, heads, dim, dtype=torch.int8),
            scale=torch.zeros(cells_n, heads, 1, dtype=torch.float16),
        )
        for _ in range(2)
    )
    assert encode.served(x, got.codes, got.scale)
    encode.int8(x, cells, got.codes, got.scale)
    Int8Buffer.encode_reference(want, cells, x)  # type: ignore[arg-type]
    assert _fields_equal(got.codes, want.codes) and _fields_equal(got.scale, want.scale)
    untouched = np.setdiff1d(np.arange(cells_n), cells.numpy())
    assert not got.codes[untouched].any() and not got.scale[untouched].float().any()
    assert got.codes.abs().max() == 127  # the codes use their range


@pytest.mark.parametrize(("bits", "group", "dim", "refits"),
                         [(4, 32, 64, 0), (4, 64, 64, 0), (4, 32, 128, 0), (2, 32, 64, 0),
                          (4, 2, 64, 0), (2, 4, 64, 0), (4, 32, 64, 4), (4, 64, 64, 4),
                          (2, 32, 64, 2), (4, 2, 64, 3), (4, 6, 96, 4)])  # fmt: skip
def test_affine_kernel_equals_the_torch_expression(
    bits: int, group: int, dim: int, refits: int
) -> None:
    """Every group's codes, scale and minimum bit for bit, with and without least-squares
    refits of the ranges (groups of 6 channels: sums over a zero-padded width of 8)."""
    heads, cells_n = 3, 40
    x = _rows(24, heads, dim, seed=bits * 100 + group)
    cells = torch.randperm(cells_n, generator=torch.Generator().manual_seed(2))[:24]

    def fresh() -> SimpleNamespace:
        return SimpleNamespace(
            codes=torch.zeros(cells_n, heads, dim * bits // 8, dtype=torch.uint8),
            scale=torch.zeros(cells_n, heads, dim // group, dtype=torch.float16),
            low=torch.zeros(cells_n, heads, dim // group, dtype=torch.float16),
            bits=bits,
            group=group,
            dim=dim,
            refits=refits,
        )

    got, want = fresh(), fresh()
    encode.affine(x, cells, bits, group, got.codes, got.scale, got.low, refits)
    AffineRowsBuffer.encode_reference(want, cells, x)  # type: ignore[arg-type]
    for name in ("codes", "scale", "low"):
        assert _fields_equal(getattr(got, name), getattr(want, name)), name
    untouched = np.setdiff1d(np.arange(cells_n), cells.numpy())
    assert not got.codes[untouched].any() and not got.low[untouched].float().any()
    codes = got.codes[cells]
    assert (codes & ((1 << bits) - 1)).max() == (1 << bits) - 1  # the top level is used


@pytest.mark.parametrize("group", [32, 64])
def test_refitted_ranges_decode_closer_than_min_max(group: int) -> None:
    """Least-squares refits keep a group's min/max pair unless another decodes its rows with
    less squared error: no group gets worse, and on Gaussian rows most get better."""
    dim, heads, n = 64, 4, 64
    x = (torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(9)) * 2).half().float()
    cells = torch.arange(n)

    def errors(refits: int) -> torch.Tensor:
        codes = torch.zeros(n, heads, dim // 2, dtype=torch.uint8)
        scale, low = (torch.zeros(n, heads, dim // group, dtype=torch.float16) for _ in range(2))
        encode.affine(x, cells, 4, group, codes, scale, low, refits)
        q = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(n, heads, -1, group).double()
        got = q * scale.double()[..., None] + low.double()[..., None]
        return ((got - x.double().view(got.shape)) ** 2).sum(-1)  # [n, H, D/G]

    plain, refitted = errors(0), errors(4)
    assert (refitted <= plain * (1 + 1e-6)).all()
    assert (refitted < plain * 0.98).float().mean() > 0.5
    assert refitted.sum() < 0.95 * plain.sum()


@pytest.mark.parametrize(("bits", "dim"), [(4, 64), (2, 64), (4, 128)])
def test_channel_kernels_equal_the_torch_expressions(bits: int, dim: int) -> None:
    """KIVI keys: a record's channel ranges over its rows, then each row's codes against its
    record (rows of two records interleaved, the records' rows in the cells named)."""
    heads, cells_n, records = 3, 40, 4
    x = _rows(24, heads, dim, seed=bits * 10 + dim)
    cells = torch.randperm(cells_n, generator=torch.Generator().manual_seed(3))[:24]
    metas = np.array([1, 3] * 12)

    def fresh() -> SimpleNamespace:
        return SimpleNamespace(
            codes=torch.zeros(cells_n, heads, dim * bits // 8, dtype=torch.uint8),
            scale=torch.zeros(records, heads, dim, dtype=torch.float16),
            low=torch.zeros(records, heads, dim, dtype=torch.float16),
            bits=bits,
            index=torch.from_numpy,
        )

    got, want = fresh(), fresh()
    for meta in (1, 3):
        encode.ranges(x[metas == meta], meta, bits, got.scale, got.low)
        ChannelBuffer.fresh_reference(want, meta, x[metas == meta])  # type: ignore[arg-type]
    encode.channels(x, cells, torch.from_numpy(metas), bits, got.codes, got.scale, got.low)
    ChannelBuffer.encode_reference(want, cells, x, metas)  # type: ignore[arg-type]
    for name in ("codes", "scale", "low"):
        assert _fields_equal(getattr(got, name), getattr(want, name)), name
    assert not got.scale[[0, 2]].float().any()  # other records untouched
    untouched = np.setdiff1d(np.arange(cells_n), cells.numpy())
    assert not got.codes[untouched].any()
    assert (got.codes[cells] & ((1 << bits) - 1)).max() == (1 << bits) - 1
    with pytest.raises(RuntimeError, match="record 4 outside"):
        encode.channels(x, cells, torch.full((24,), 4), bits, got.codes, got.scale, got.low)
    with pytest.raises(RuntimeError, match="record -1 outside"):
        encode.ranges(x, -1, bits, got.scale, got.low)


def _turbo_stack(dim: int, bits: int) -> HeadStack:
    return HeadStack([TurboQuantizer(dim, bits, seed=s) for s in range(3)])


@pytest.mark.parametrize(("dim", "bits", "offsets", "n"), [(64, 5, "none", 64),
                                                           (64, 3, "shared", 64),
                                                           (80, 4, "rows", 64),
                                                           (128, 8, "rows", 2048),
                                                           (32, 2, "none", 64),
                                                           (256, 1, "shared", 64)])  # fmt: skip
def test_turbo_kernel_equals_the_torch_expression(
    dim: int, bits: int, offsets: str, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rotation (butterflies), norms, grid cells, packed codes and flagged bf16 scales of the
    C++ encoder equal HeadStack's torch expressions bit for bit, for keys and values, with no
    offset, one per head or one per row, rows over 10 decades, a zero row and rows whose
    squares overflow float32 (D 80 pads to 128: zeros go through the butterflies). A norm one
    ulp off moves an 8-bit code of about one row-head in a thousand: 2048 rows there."""
    stack = _turbo_stack(dim, bits)
    x = _rows(n, 3, dim, seed=dim + bits)
    x[5], x[6, :, :3] = 1e20, -3e19  # squares past float32's range
    g = torch.Generator().manual_seed(bits)
    shape = {"none": None, "shared": (3, 1, dim), "rows": (3, n, dim)}[offsets]
    off = None if shape is None else torch.randn(shape, generator=g) * 0.5
    assert stack.kernel_serves(x, True)
    for keys in (True, False):
        monkeypatch.setenv(ENCODE_ENV, "kernel")
        got = stack.encode_stacked(x.transpose(0, 1), off, keys)
        monkeypatch.setenv(ENCODE_ENV, "reference")
        want = stack.encode_stacked(x.transpose(0, 1), off, keys)
        assert torch.equal(got.codes, want.codes), keys
        assert torch.equal(got.scale.view(torch.int16), want.scale.view(torch.int16)), keys
        flags = torch.signbit(got.scale)
        if off is not None:  # the offset was subtracted from some rows and not from others
            assert flags.any() and not flags.all()
        else:
            assert not flags.any()
        assert got.scale[:, 5].float().abs().min() > 1e18  # the overflowing rows kept their norm


def test_turbo_rows_wider_than_the_kernel_takes_go_through_torch() -> None:
    """A head of 1100 channels pads to 2048, past the kernel's 1024: torch encodes it, and
    the codes decode to the row's direction."""
    stack = _turbo_stack(1100, 4)
    x = torch.randn(3, 2, 1100, generator=torch.Generator().manual_seed(12))  # [H, N, D]
    assert not stack.kernel_serves(x.transpose(0, 1).contiguous(), True)
    enc = stack.encode_stacked(x, None, True)
    assert enc.codes.shape == (3, 2, packed_width(2048, 4))
    back = stack.first.decode_keys(Encoded(*(t[0] for t in enc.tensors())))
    cos = torch.nn.functional.cosine_similarity(back, x[0], dim=-1)
    assert (cos > 0.99).all()


def test_the_turbo_kernel_writes_only_its_cells() -> None:
    stack = _turbo_stack(64, 5)
    x = _rows(24, 3, 64, seed=7)
    cells = torch.randperm(40, generator=torch.Generator().manual_seed(8))[:24]
    codes = torch.zeros(40, 3, packed_width(64, 5), dtype=torch.uint8)
    scale = torch.zeros(40, 3, 1, dtype=torch.bfloat16)
    stack.encode_into(x, cells, None, True, codes, scale)
    want = stack.encode_stacked(x.transpose(0, 1), None, True)
    assert torch.equal(codes[cells], want.codes.transpose(0, 1))
    assert torch.equal(scale[cells].view(torch.int16), want.scale.transpose(0, 1).view(torch.int16))
    untouched = np.setdiff1d(np.arange(40), cells.numpy())
    assert not codes[untouched].any() and not scale[untouched].float().any()


def test_the_turbo_reference_sums_by_halving() -> None:
    """fixed_sum adds v[:w/2] + v[w/2:] until one is left (csrc/encode.cpp's order), which a
    library's vectorised sum need not: rows where the order changes the float32 result."""
    g = torch.Generator().manual_seed(11)
    v = (
        torch.randn(4096, 64, generator=g)
        * torch.logspace(-8, 8, 64)[torch.randperm(64, generator=g)]
    )
    want = v.numpy().copy()
    half = 32
    while half:
        want[:, :half] = want[:, :half] + want[:, half : 2 * half]
        half //= 2
    assert np.array_equal(fixed_sum(v, 64)[:, 0].numpy(), want[:, 0])
    padded = fixed_sum(v[:, :40], 64)[:, 0]  # zeros past the row
    assert np.array_equal(
        padded.numpy(), fixed_sum(torch.nn.functional.pad(v[:, :40], (0, 24)), 64)[:, 0].numpy()
    )


def test_the_torch_square_root_of_the_turbo_reference_is_rounded_correctly() -> None:
    """The C++ encoder's std::sqrt is IEEE's (correctly rounded); torch's float32 sqrt here is
    not, so the reference takes its roots through float64."""
    v = torch.rand(200_000, generator=torch.Generator().manual_seed(9)) * 10.0
    assert np.array_equal(correct_sqrt(v).numpy(), np.sqrt(v.numpy()))


def test_bad_turbo_arguments_are_refused_and_write_nothing() -> None:
    stack = _turbo_stack(64, 3)
    book = stack.first.value_codebook
    table = book.cell_codes.to(torch.uint8)
    x = _rows(6, 3, 64, seed=10)[:4].contiguous()
    codes = torch.zeros(8, 3, packed_width(64, 3), dtype=torch.uint8)
    scale = torch.zeros(8, 3, 1, dtype=torch.bfloat16)
    signs = stack.rotations.signs

    def call(**change: object) -> None:
        args = dict(x=x, cells=torch.arange(4), offsets=None, signs=signs, cell_codes=table,
                    cell_squares=book.cell_squares, grid_bits=book.grid_bits, bits=3,
                    codes=codes, scale=scale)  # fmt: skip
        args.update(change)
        encode.turbo(**args)  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match="cell 8 outside"):
        call(cells=torch.tensor([0, 1, 2, 8]))
    with pytest.raises(RuntimeError, match="cell code 4 of more than 2 bits"):
        call(bits=2, codes=torch.zeros(8, 3, packed_width(64, 2), dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="cell_codes uint8"):
        call(grid_bits=book.grid_bits + 1)
    with pytest.raises(RuntimeError, match="offsets must be"):
        call(offsets=torch.zeros(2, 3, 64))
    with pytest.raises(RuntimeError, match="pad to 64"):
        call(x=x[..., :31].contiguous())
    with pytest.raises(RuntimeError, match="scale must be"):
        call(scale=torch.zeros(8, 3, 1, dtype=torch.float16))
    assert not codes.any() and not scale.float().any()


def test_bad_arguments_are_refused_and_write_nothing() -> None:
    x = _rows(6, 2, 64, seed=3)[:4].contiguous()
    codes = torch.zeros(8, 2, 32, dtype=torch.uint8)
    scale, low = (
        torch.zeros(8, 2, 2, dtype=torch.float16),
        torch.zeros(8, 2, 2, dtype=torch.float16),
    )
    with pytest.raises(RuntimeError, match="cell 8 outside"):
        encode.affine(x, torch.tensor([0, 1, 2, 8]), 4, 32, codes, scale, low)
    with pytest.raises(RuntimeError, match="2 or 4 bits"):
        encode.affine(x, torch.arange(4), 3, 32, codes, scale, low)
    with pytest.raises(RuntimeError, match="scale must be"):
        encode.affine(x, torch.arange(4), 4, 16, codes, scale, low)  # 4 groups, 2 scales
    with pytest.raises(RuntimeError, match="x must be"):
        encode.affine(x[:, :1].contiguous(), torch.arange(4), 4, 32, codes, scale, low)
    assert not codes.any() and not scale.float().any() and not low.float().any()
    i8 = torch.zeros(8, 2, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="cells must be"):
        encode.int8(x, torch.arange(3), i8, torch.zeros(8, 2, 1, dtype=torch.float16))
    assert not i8.any()


def test_groups_of_fewer_than_a_byte_of_codes_take_the_torch_path() -> None:
    """2-bit codes in groups of 2 channels (half a byte a group): the kernel refuses such
    groups, so the buffer encodes them with torch, and they decode within half a step."""
    from kvcache.codecs.ints import AffineRowsCodec

    codec = AffineRowsCodec(2, 2, centre=False, window=0, name="int2g2")
    cache = CausalCache(64, codec=codec)
    x = (torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(5)) * 3).half().float()
    cache.start_forward(Batch.single(0, 0, 32))
    cache.put(0, x, x)
    _, got = cache.read(0, torch.from_numpy(cache.cells_of(0)))
    pairs = x.view(32, 2, 32, 2)
    step = (pairs.amax(-1) - pairs.amin(-1)) / 3
    err = (got.view(32, 2, 32, 2) - pairs).abs().amax(-1)
    # half a step, plus the fp16 rounding of the group's scale and minimum (3 steps' worth)
    assert (err <= step * 0.51 + pairs.abs().amax(-1) * 2.0**-9 + 1e-7).all()
    assert err.max() > 0  # it really quantizes
    cache.close()


def _staggered_cache(codec: str) -> tuple[CausalCache, dict[int, list[torch.Tensor]]]:
    """Four sequences of different lengths past the windows, decoding 40 steps: some sequence
    seals rows at most steps (int8, without a window, seals a decode step's own row with 31
    of the window's), and the prompts seal rows straight from the forward's own K/V. Returns
    the cache and each sequence's layer-0 value rows as put."""
    layers, heads, dim = 2, 3, 64
    g = torch.Generator().manual_seed(4)
    cache = CausalCache(4 * 260, max_sequences=4, shift=Rope(dim, 100000.0), codec=codec)
    lengths = [150, 163, 171, 190]
    put: dict[int, list[torch.Tensor]] = {s: [] for s in range(4)}
    for s, n in enumerate(lengths):
        cache.start_forward(Batch.single(s, 0, n))
        for layer in range(layers):
            k, v = torch.randn(2, n, heads, dim, generator=g)
            cache.put(layer, k, v)
            if layer == 0:
                put[s].append(v)
    for i in range(40):
        cache.start_forward(Batch(positions=[n + i for n in lengths], sequences=[0, 1, 2, 3]))
        for layer in range(layers):
            k, v = torch.randn(2, 4, heads, dim, generator=g)
            cache.put(layer, k, v)
            if layer == 0:
                for s in range(4):
                    put[s].append(v[s : s + 1])
    return cache, put


def test_sealed_rows_are_the_rows_put() -> None:
    """int8 values decoded from a staggered cache are the rows put within half a step (a row
    read from the wrong place in a seal is far outside)."""
    cache, put = _staggered_cache("int8")
    for s, parts in put.items():
        want = torch.cat(parts).half().float()
        _, got = cache.read(0, torch.from_numpy(cache.cells_of(s)))
        step = want.abs().amax(-1, keepdim=True) / 127
        assert ((got - want).abs() <= step * 0.5 * 1.01 + 1e-6).all(), s
    cache.close()


@pytest.mark.parametrize(
    "codec", ["int8", "int4", "kivi4", "kivi2", "int8/int4", "turbo4", "turbo3"]
)
def test_a_cache_sealing_through_the_kernels_holds_the_torch_paths_codes(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENCODE_ENV, "kernel")
    fast, _ = _staggered_cache(codec)
    monkeypatch.setenv(ENCODE_ENV, "reference")
    plain, _ = _staggered_cache(codec)
    compared = 0
    for layer in fast.storage.layers:
        for role in ("keys", "values"):
            a, b = (
                getattr(fast.storage.layers[layer], role),
                getattr(plain.storage.layers[layer], role),
            )
            for name in (*a.CELL_FIELDS, *a.RECORD_FIELDS, "residual"):
                if getattr(a, name, None) is None:
                    continue
                assert _fields_equal(getattr(a, name), getattr(b, name)), (layer, role, name)
                compared += 1
    assert compared >= 12
    fast.close()
    plain.close()

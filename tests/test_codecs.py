"""Codecs of the cell cache: round-trip error bounds, honest byte counts, and the same mask
semantics as the float cache through remove / copy_prefix / window eviction."""

from __future__ import annotations

import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.codecs import CODECS, make_codec
from kvcache.errors import InvalidConfigError
from support import render

H, D = 3, 64


def outlier_rows(n: int, seed: int = 0) -> torch.Tensor:
    """Rows like real keys: a few channels much larger than the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, D, generator=g)
    x[..., 5] *= 12.0
    x[..., 40] += 6.0
    return x


def roundtrip(name: str, x: torch.Tensor, role: str = "key") -> torch.Tensor:
    buf = make_codec(name, role).allocate(len(x), H, D, torch.device("cpu"))
    buf.write(slice(0, len(x)), x)
    return buf.read(0, len(x), torch.float32)


def test_float_codecs_round_trip():
    x = outlier_rows(64)
    assert torch.equal(roundtrip("fp32", x), x)
    assert torch.allclose(roundtrip("fp16", x), x, rtol=1e-3, atol=1e-4)
    assert torch.allclose(roundtrip("bf16", x), x, rtol=1e-2, atol=1e-3)


def test_int8_error_is_within_half_a_step():
    x = outlier_rows(256)
    err = (roundtrip("int8", x) - x).abs()  # [T, H, D]
    step = x.abs().amax(-1, keepdim=True) / 127  # [T, H, 1]
    assert (err <= step * 0.5 * 1.01 + 1e-6).all()
    assert err.max() > 0  # it really quantizes


@pytest.mark.parametrize("name, group", [("int4", 32), ("int4g64", 64)])
@pytest.mark.parametrize("role", ["key", "value"])
def test_int4_error_is_within_half_a_step_per_group(name, group, role):
    x = outlier_rows(256)
    err = (roundtrip(name, x, role) - x).abs().reshape(256, H, -1, group)
    # keys are centred first: the steps are those of x minus the (fp16) mean of the rows
    xc = x - x.mean(0).half().float() if role == "key" else x
    xg = xc.reshape(256, H, -1, group)
    step = (xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)) / 15
    assert (err <= step * 0.5 * 1.01 + 1e-3).all()
    assert err.mean() > 1e-3  # it really quantizes


def test_key_centring_cuts_the_error_of_offset_channels():
    x = outlier_rows(256)
    x[..., 7] += 20.0  # a channel with a large common offset, as real keys have
    key_err = (roundtrip("int4", x, "key") - x).pow(2).mean()
    value_err = (roundtrip("int4", x, "value") - x).pow(2).mean()  # values are not centred
    assert key_err < value_err / 3
    later = outlier_rows(8, seed=1)  # later writes keep the first write's centre
    buf = make_codec("int4", "key").allocate(264, H, D, torch.device("cpu"))
    buf.write(slice(0, 256), x)
    centre = buf.centre.value.clone()
    buf.write(torch.arange(256, 264), later)
    assert torch.equal(buf.centre.value, centre)
    assert (buf.read(256, 264, torch.float32) - later).abs().max() < 2.0


@pytest.mark.parametrize(
    "name, row_bytes",
    [
        ("fp32", H * D * 4),
        ("fp16", H * D * 2),
        ("bf16", H * D * 2),
        ("int8", H * D + H * 2),  # codes + fp16 scale per head
        ("int4", H * D // 2 + H * (D // 32) * 2 * 2),  # nibbles + fp16 scale, min per group
        ("int4g64", H * D // 2 + H * 2 * 2),
    ],
)
@pytest.mark.parametrize("role", ["key", "value"])
def test_bytes_count_every_buffer(name, row_bytes, role):
    codec = make_codec(f"{name}:recent=0" if name.startswith("int4") else name, role)
    buf = codec.allocate(100, H, D, torch.device("cpu"))
    tensors = [v for v in vars(buf).values() if isinstance(v, torch.Tensor)]
    centre = getattr(buf, "centre", None)
    if centre is not None:
        tensors.append(centre.value)  # the keys' fp16 centre [H, D], once per buffer
    assert buf.nbytes() == sum(t.numel() * t.element_size() for t in tensors)
    fixed = H * D * 2 if centre is not None else 0
    assert (centre is not None) == (role == "key" and name.startswith("int4"))
    assert buf.nbytes() == 100 * row_bytes + fixed
    assert codec.bytes_per_row(H, D) == row_bytes + fixed  # one cell plus the centre


def test_unknown_codec_is_a_typed_error():
    with pytest.raises(InvalidConfigError, match="one of"):
        CausalCache(8, codec="int3")
    with pytest.raises(InvalidConfigError, match="key_codec"):
        CausalCache(8, key_codec="nope")
    assert set(CODECS) >= {"fp32", "fp16", "bf16", "int8", "int4"}


def test_key_and_value_codecs_may_differ():
    cache = CausalCache(16, key_codec="int8", value_codec="fp16")
    cache.start_forward(Batch.single(0, 0, 4))
    x = outlier_rows(4)
    keys, values, _ = cache.update(0, x, x)
    assert keys.dtype == values.dtype == torch.float32
    assert cache.memory_usage_bytes() == 16 * ((H * D + H * 2) + H * D * 2)
    assert not torch.equal(keys, values[: len(keys)])


def scenario(cache: CausalCache) -> list[tuple[list[str], torch.Tensor]]:
    """A mixed workload: two sequences, sharing, eviction-free removal with shifting."""
    out = []

    def fwd(positions, seqs):
        cache.start_forward(Batch(positions, seqs))
        g = torch.Generator().manual_seed(sum(positions) + 7 * len(seqs))
        x = torch.randn(len(positions), H, D, generator=g)
        k, _, mask = cache.update(0, x, x)
        out.append((render(mask), k.clone()))

    fwd(list(range(6)), [0] * 6)
    cache.copy_prefix(0, 1, 4)
    fwd([6, 4, 5], [0, 1, 1])
    cache.remove(1, 0)
    cache.remove(0, 2, 4)  # moves positions 4..6 of seq 0 down by 2 (re-rotated keys)
    fwd([5, 6], [0, 0])
    return out


def rope_like(layer: int, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    ang = offsets.to(keys.dtype)[:, None, None] * 0.1
    half = keys.shape[-1] // 2
    x1, x2 = keys[..., :half], keys[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)


@pytest.mark.parametrize(
    "name, tol", [("fp16", 1e-2), ("bf16", 5e-2), ("int8", 0.05), ("int4", 0.6)]
)
def test_compressed_cache_keeps_float_semantics(name, tol):
    ref = scenario(CausalCache(32, max_sequences=2, shift=rope_like))
    got = scenario(CausalCache(32, max_sequences=2, shift=rope_like, codec=name))
    for (mask_r, k_r), (mask_g, k_g) in zip(ref, got, strict=True):
        assert mask_r == mask_g
        visible = [r != "x" for r in mask_r[-1].split()]
        assert (k_r[visible] - k_g[visible]).abs().max() < tol


@pytest.mark.parametrize("name", ["int8", "int4", "kivi4", "kivi2", "turbo4", "turbo3"])
def test_window_eviction_with_codec_matches_float(name):
    def run(codec):
        cache = CausalCache(64, window=3, max_batch=4, codec=codec)
        masks = []
        for start in range(0, 20, 2):
            cache.start_forward(Batch.single(0, start, 2))
            _, _, mask = cache.update(0, torch.randn(2, H, D), torch.randn(2, H, D))
            masks.append(render(mask))
        return masks, cache.positions(0)

    assert run(None) == run(name)


def test_read_decodes_only_the_history_range():
    cache = CausalCache(1000, codec="int8")
    cache.start_forward(Batch.single(0, 0, 5))
    keys, values, mask = cache.update(0, outlier_rows(5), outlier_rows(5))
    assert keys.shape == (5, H, D) and mask.shape == (5, 5)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_keys_per_channel_newest_rows_in_fp16(bits):
    x = outlier_rows(320)  # 5 blocks of 64; the newest 2 stay open (residual 128)
    got = roundtrip(f"kivi{bits}", x, "key")
    assert torch.allclose(got[192:], x[192:], rtol=1e-3, atol=1e-3)  # fp16 residual
    err = (got[:192] - x[:192]).abs().reshape(3, 64, H, D)
    xb = x[:192].reshape(3, 64, H, D)
    step = (xb.amax(1, keepdim=True) - xb.amin(1, keepdim=True)) / (2**bits - 1)
    assert (err <= step * 0.5 * 1.01 + 2e-2).all()  # per channel: outliers get their range
    assert err.mean() > 1e-3


def test_kivi_values_per_token():
    x = outlier_rows(320)
    err = (roundtrip("kivi4", x, "value")[:192] - x[:192]).abs()
    step = (x[:192].amax(-1, keepdim=True) - x[:192].amin(-1, keepdim=True)) / 15
    assert (err <= step * 0.5 * 1.01 + 2e-2).all()


@pytest.mark.parametrize("role", ["key", "value"])
def test_kivi_row_by_row_equals_one_write(role):
    x = outlier_rows(300)
    codec = make_codec("kivi4", role)
    one = codec.allocate(300, H, D, torch.device("cpu"))
    one.write(slice(0, 300), x)
    rows = codec.allocate(300, H, D, torch.device("cpu"))
    for i in range(300):
        rows.write(slice(i, i + 1), x[i : i + 1])
    assert torch.equal(one.read(0, 300, torch.float32), rows.read(0, 300, torch.float32))
    assert torch.equal(one.read(70, 75, torch.float32), one.read(0, 300, torch.float32)[70:75])


def test_kivi_rewrite_in_sealed_block_reopens_it():
    x = outlier_rows(512)
    buf = make_codec("kivi4", "key").allocate(512, H, D, torch.device("cpu"))
    buf.write(slice(0, 512), x)
    before = buf.read(0, 64, torch.float32)
    new = torch.full((1, H, D), 3.0)
    buf.write(torch.tensor([10]), new)  # block 0 was sealed long ago
    after = buf.read(0, 64, torch.float32)
    assert torch.allclose(after[10], new[0])
    keep = torch.ones(64, dtype=torch.bool)
    keep[10] = False
    assert torch.allclose(after[keep], before[keep], atol=1e-2)
    cells = torch.tensor([3, 10, 500])
    gathered = buf.gather(cells, torch.float32)
    assert torch.equal(gathered, buf.read(0, 512, torch.float32)[cells])


def test_kivi_bytes_count_codes_meta_and_residual():
    key = make_codec("kivi4", "key").allocate(1000, H, D, torch.device("cpu"))
    blocks = -(-1000 // 64)
    codes = blocks * 64 * H * D // 2
    assert key.nbytes() == codes + 2 * blocks * H * D * 2 + 128 * H * D * 2
    value = make_codec("kivi2", "value").allocate(1000, H, D, torch.device("cpu"))
    assert value.nbytes() == blocks * 64 * H * (D // 4 + 2 * 2) + 128 * H * D * 2


@pytest.mark.parametrize(
    "name, role, cosine, row_bytes, norm_rtol",
    [
        ("turbo4", "key", 0.995, 5 * 64 // 8 + 2, 1e-2),  # 5-bit codes + a bf16 norm
        ("turbo4", "value", 0.97, 3 * 64 // 8 + 2, 1e-2),
        ("turbo3", "key", 0.99, 4 * 64 // 8 + 2, 1e-2),
        ("turbo3", "value", 0.92, 2 * 64 // 8 + 1, 0.05),  # a log-coded 1-byte norm
    ],
)
def test_turbo_rows_round_trip_and_bytes(name, role, cosine, row_bytes, norm_rtol):
    x = outlier_rows(200)
    buf = make_codec(f"{name}:recent=0", role).allocate(len(x), H, D, torch.device("cpu"))
    buf.write(slice(0, len(x)), x)
    got = buf.read(0, len(x), torch.float32)
    cos = torch.nn.functional.cosine_similarity(got.reshape(-1, D), x.reshape(-1, D))
    assert cos.mean() > cosine and cos.min() > cosine - 0.06
    # norm-preserving, for keys of the centred rows (centre: fp16 mean of the first write)
    c = buf.centre.value.float() if role == "key" else torch.zeros(H, D)
    assert torch.allclose((got - c).norm(dim=-1), (x - c).norm(dim=-1), rtol=norm_rtol)
    fixed = H * D * 2 if role == "key" else 0  # the keys' fp16 centre
    assert buf.nbytes() == len(x) * H * row_bytes + fixed


def test_turbo_split_keeps_the_average_bits_and_the_even_split_is_an_option():
    def bits(spec: str) -> float:  # bits per stored K+V value, one cell, no window
        k = make_codec(spec, "key").allocate(1000, H, D, torch.device("cpu")).nbytes()
        v = make_codec(spec, "value").allocate(1000, H, D, torch.device("cpu")).nbytes()
        return (k + v - H * D * 2) * 8 / (1000 * 2 * H * D)

    assert bits("turbo4:recent=0") == bits("turbo4:recent=0,key_bits=4,value_bits=4") == 4.25
    assert bits("turbo3:recent=0") <= 3.2  # 1/5 of fp16's 16 bits
    with pytest.raises(InvalidConfigError, match="key_bits"):
        make_codec("turbo4:key_bits=9", "key")


@pytest.mark.parametrize("name", ["int4", "turbo4"])
def test_newest_rows_read_back_in_fp16(name):
    x = outlier_rows(300)
    buf = make_codec(name, "value").allocate(300, H, D, torch.device("cpu"))
    for i in range(300):  # one row per write, as decoding does
        buf.write(torch.tensor([i]), x[i : i + 1])
    got = buf.read(0, 300, torch.float32)
    assert torch.equal(got[172:], x[172:].half().float())  # the newest 128 rows
    assert (got[:172] - x[:172]).abs().max() > 1e-2  # the older ones are quantized
    part = buf.read(150, 200, torch.float32)  # a range across the window's edge
    assert torch.equal(part, got[150:200])
    cells = torch.tensor([299, 3, 171, 172])
    assert torch.equal(buf.gather(cells, torch.float32), got[cells])
    buf.write(slice(3, 4), x[3:4])  # a rewritten cell becomes the newest; 172 drops out
    again = buf.read(0, 300, torch.float32)
    assert torch.equal(again[3], x[3].half().float())
    assert not torch.equal(again[172], x[172].half().float())
    assert torch.equal(again[173:], got[173:])


def test_recent_window_bytes_and_options():
    plain = make_codec("int4:recent=0", "value").allocate(1000, H, D, torch.device("cpu"))
    windowed = make_codec("int4", "value").allocate(1000, H, D, torch.device("cpu"))
    assert windowed.nbytes() == plain.nbytes() + 128 * H * D * 2 + 128 * 8  # rows + cell ids
    assert make_codec("int4:recent=16", "value").name == "int4:recent=16"
    assert make_codec("kivi4:residual=256", "key").residual == 256
    for bad in ("int4:recent=x", "int4:window=3", "fp32:recent=1", "int4:recent=-1"):
        with pytest.raises(InvalidConfigError):
            make_codec(bad)


def test_fast_unpack_and_int4_decode_equal_the_plain_formulas():
    from kvcache.codecs.pack import unpack, unpack4

    b = torch.randint(0, 256, (37, 3, 32), dtype=torch.uint8)
    assert torch.equal(unpack4(b), unpack(b, 4))
    x = outlier_rows(37)
    buf = make_codec("int4:recent=0", "value").allocate(37, H, D, torch.device("cpu"))
    buf.write(slice(0, 37), x)
    q = unpack(buf.codes, 4).float().reshape(37, H, 2, 32)
    plain = torch.addcmul(buf.low.float()[..., None], q, buf.scale.float()[..., None])
    assert torch.equal(buf.read(0, 37, torch.float32), plain.reshape(37, H, D))


def test_key_value_spec_and_variant_names():
    assert make_codec("int8/int4", "key").name == "int8"
    assert make_codec("int8/int4", "value").name == "int4"
    cache = CausalCache(8, codec="int8/kivi4")
    assert (cache.key_codec.name, cache.value_codec.name) == ("int8", "kivi4")
    # variants get their own names: prefix-cache namespaces must tell them apart
    assert make_codec("int4:recent=0").name == "int4:recent=0"
    assert make_codec("turbo3:key_bits=3,value_bits=3").name == "turbo3:key_bits=3,value_bits=3"
    with pytest.raises(InvalidConfigError):
        make_codec("int8/nope", "value")

"""The TurboQuant building blocks against references: a dense Hadamard matrix, Max's (1960)
Gaussian Lloyd–Max constants, a bit-by-bit packer, brute-force nearest centroids, the
rate-distortion of the codebook, and the QJL estimator's expectation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcache.codecs.codebook import LEVEL_STEPS, lloyd_max
from kvcache.codecs.lloyd import BetaCoordinate, lloyd_levels
from kvcache.codecs.pack import pack
from kvcache.codecs.qjl import QJLSketch
from kvcache.codecs.quantizer import HeadStack, TurboQuantizer
from kvcache.codecs.rotation import Rotation, RotationStack, fwht, hadamard, padded_dim
from kvcache.compressed import KVCacheCompressor, KVCacheConfig, MultiHeadKVCache
from kvcache.errors import (
    DimensionMismatchError,
    InvalidArgumentError,
    InvalidConfigError,
    NotSupportedError,
)


def dense_hadamard(p: int) -> torch.Tensor:
    """Reference: H_p / sqrt(p) from the definition H[i, j] = (-1)^popcount(i & j), float64."""
    i = torch.arange(p)
    bits = (i[:, None] & i[None, :]).numpy()
    parity = np.vectorize(lambda v: bin(int(v)).count("1") % 2)(bits)
    return torch.tensor(1.0 - 2.0 * parity, dtype=torch.float64) / math.sqrt(p)


@pytest.mark.parametrize("p", [2, 4, 64, 128, 256, 1024])
def test_fwht_equals_dense_hadamard_and_is_an_involution(p):
    x = torch.randn(5, p, dtype=torch.float64)
    ref = x @ dense_hadamard(p)
    assert torch.allclose(fwht(x.float()).double(), ref, atol=1e-5)  # p > 128: 2 radix stages
    assert torch.allclose(fwht(fwht(x.float())).double(), x, atol=1e-5)


@pytest.mark.parametrize("dim", [2, 3, 64, 100, 200])
def test_rotation_is_orthonormal_and_inverted(dim):
    rot = Rotation(dim, seed=3)
    x = torch.randn(50, dim)
    y = rot.forward(x)
    assert y.shape == (50, padded_dim(dim))
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-5)
    assert torch.allclose(rot.inverse(y), x, atol=1e-5)


def test_hadamard_is_sylvester():
    h = hadamard(8)
    assert torch.equal(h @ h.T, 8 * torch.eye(8))
    assert torch.allclose(h.double() / math.sqrt(8), dense_hadamard(8))


# Max (1960), MSE of the optimal quantizer of a unit Gaussian with 2, 4, 8, 16 levels.
MAX_GAUSSIAN_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_at_large_dim_is_max_gaussian_quantizer(bits):
    book = lloyd_max(4096, bits)  # rotated coordinates ~ N(0, 1/P): Max's codebook
    assert book.mse == pytest.approx(MAX_GAUSSIAN_MSE[bits], rel=2e-3)
    c = book.centroids
    assert torch.all(c[1:] > c[:-1])
    assert torch.allclose(c, -c.flip(0), atol=1e-6)  # symmetric


@pytest.mark.parametrize("dim", [2, 8, 64])
@pytest.mark.parametrize("bits", [2, 3, 8])
def test_codebook_is_a_lloyd_fixed_point_and_a_minimum(dim, bits):
    c, mse = lloyd_levels(dim, bits)
    dist = BetaCoordinate(dim)
    assert np.max(np.abs(dist.centroids(c) - c)) < 1e-9
    rng = np.random.default_rng(0)
    for _ in range(5):  # any small move of the levels costs MSE
        moved = np.sort(c + rng.normal(0, 1e-3 / math.sqrt(dim), c.shape))
        assert dist.mse(moved) > mse


@pytest.mark.parametrize("dim", [8, 64])
def test_codebook_fits_the_beta_distribution_of_rotated_unit_vectors(dim):
    """Monte Carlo on uniform unit vectors: the fitted codebook reaches its stated MSE, and at
    small dim it beats the Gaussian (large-dim) codebook, which is why it is fitted per dim."""
    x = torch.randn(40000, dim, dtype=torch.float64)
    t = (x / x.norm(dim=1, keepdim=True) * math.sqrt(dim)).float()  # [N, P] unit variance
    own, gauss = lloyd_max(dim, 3), lloyd_max(4096, 3)
    err_own = ((own.decode(own.encode(t)) - t) ** 2).mean().item()
    err_gauss = ((gauss.decode(gauss.encode(t)) - t) ** 2).mean().item()
    assert err_own == pytest.approx(own.mse, rel=0.03)
    if dim == 8:
        assert err_gauss > 1.05 * err_own


def test_codebook_fit_is_deterministic():
    (a, mse_a), (b, mse_b) = lloyd_levels(64, 4), lloyd_levels(64, 4)  # two fits, no cache
    assert np.array_equal(a, b) and mse_a == mse_b
    book = lloyd_max(64, 4)
    step = float(np.abs(a).max()) * 8.0 / LEVEL_STEPS  # the levels on int16 steps
    assert torch.equal(book.centroids, torch.tensor(np.round(a * 8.0 / step) * step).float())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_codebook_levels_are_int16_steps_next_to_the_fit(bits):
    """The kernel looks the levels up as int16 steps of max |level| / 8191 (turbo_keys16):
    every level is such a step (to float32), within 1/50 of the smallest gap of its fit."""
    fit, _ = lloyd_levels(64, bits)
    levels = lloyd_max(64, bits).centroids.double()
    step = levels.abs().max() / LEVEL_STEPS
    k = torch.round(levels / step)
    assert k.abs().max() == LEVEL_STEPS
    assert torch.allclose(k * step, levels, rtol=0, atol=1e-3 * step.item())
    moved = (levels - torch.from_numpy(fit) * 8.0).abs().max().item()
    assert moved < np.diff(fit).min() * 8.0 / 50


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_encode_picks_the_nearest_centroid_up_to_the_grid(bits):
    """Boundaries sit on a grid (step <= smallest gap / 32): codes are the brute-force nearest
    centroid except for inputs within half a grid step of an unrounded midpoint."""
    book = lloyd_max(128, bits)
    t = torch.randn(5000, 8) * 1.5
    got = book.encode(t).long()
    nearest = (t[..., None] - book.centroids).abs().argmin(-1)
    differ = got != nearest
    mid = (book.centroids[1:] + book.centroids[:-1]) / 2
    half_step = 2.0 ** -(book.grid_bits + 1)
    assert half_step <= (mid[1:] - mid[:-1]).min().item() / 64 if bits > 1 else True
    near_mid = ((t[..., None] - mid).abs() < half_step + 1e-6).any(-1)
    assert not bool((differ & ~near_mid).any())
    # And they are the stored (rounded) boundaries' buckets, up to float rounding of t * 2^10.
    off = got != torch.bucketize(t, book.boundaries, right=True)
    assert not bool((off & ((t[..., None] - book.boundaries).abs() > 1e-5).all(-1)).any())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_grid_rounding_costs_under_a_thousandth_of_the_mse(bits):
    """Paired Monte Carlo: the same rotated coordinates, grid lookup vs exact nearest centroid."""
    book = lloyd_max(128, bits)
    g = torch.Generator().manual_seed(bits)  # the draw must not depend on the tests before
    x = torch.randn(4000, 128, dtype=torch.float64, generator=g)
    t = (x / x.norm(dim=1, keepdim=True) * math.sqrt(128)).float()
    grid = ((book.decode(book.encode(t)) - t) ** 2).mean().item()
    mids = (book.centroids[1:] + book.centroids[:-1]) / 2  # unrounded boundaries
    exact = ((book.centroids[torch.bucketize(t, mids)] - t) ** 2).mean().item()
    assert grid == pytest.approx(exact, rel=1e-3)
    assert grid == pytest.approx(book.mse, rel=0.02)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_decode_packed_equals_the_centroids_of_the_codes(bits):
    """The per-byte centroid tables (bits | 8) and the unpack path (other widths)."""
    codes = torch.randint(0, 1 << bits, (5, 64), generator=torch.Generator().manual_seed(bits))
    book = lloyd_max(64, bits)
    assert (book.byte_centroids is not None) == (8 % bits == 0)
    for count in (64, 61):
        got = book.decode_packed(pack(codes[:, :count], bits), count)
        assert torch.equal(got, book.centroids[codes[:, :count]])


def norm_preserving_error(mse: float) -> float:
    """Expected ||u - u_hat||^2 for a unit u decoded with its own norm: 2 - 2 cos, and
    cos = sqrt(1 - mse) for a Lloyd–Max codebook (error orthogonal to the decoded vector)."""
    return 2.0 - 2.0 * math.sqrt(1.0 - mse)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_round_trip_error_matches_rate_distortion(dim, bits):
    tq = TurboQuantizer(dim, bits, seed=1)
    x = torch.randn(3000, dim) * torch.rand(3000, 1) * 10  # random norms
    for enc, dec in ((tq.encode_values, tq.decode_values), (tq.encode_keys, tq.decode_keys)):
        got = dec(enc(x))
        rel = ((got - x).norm(dim=1) ** 2 / x.norm(dim=1) ** 2).mean().item()
        expect = norm_preserving_error(tq.value_codebook.mse)
        assert 0.9 * expect < rel < 1.1 * expect, (bits, rel, expect)
        assert torch.allclose(got.norm(dim=1), x.norm(dim=1), rtol=1e-2)  # bf16 scale


def test_round_trip_with_padding_keeps_the_bound():
    tq = TurboQuantizer(100, 4, seed=0)  # padded to 128
    x = torch.randn(2000, 100)
    rel = ((tq.decode_values(tq.encode_values(x)) - x).norm(dim=1) ** 2 / 100).mean().item()
    assert rel < 1.1 * norm_preserving_error(tq.value_codebook.mse)


def test_offset_is_subtracted_only_where_it_shrinks_the_vector():
    tq = TurboQuantizer(64, 4, seed=0)
    offset = torch.zeros(64)
    offset[:4] = 20.0  # a shared outlier component
    near = offset + torch.randn(500, 64)  # ordinary keys: centring helps
    far = -offset + torch.randn(10, 64)  # "sink" keys: centring would double their norm
    x = torch.cat([near, far, offset[None], torch.zeros(1, 64)])
    enc = tq.encode_keys(x, offset)
    flags = torch.signbit(enc.scale[:, 0])
    assert bool(flags[:500].all()) and not bool(flags[500:510].any())
    got = tq.decode_keys(enc, offset)
    assert torch.allclose(got[-2], offset) and torch.equal(got[-1], torch.zeros(64))
    plain = tq.decode_keys(tq.encode_keys(near))
    centred_err = (got[:500] - near).norm(dim=1).mean()
    assert centred_err < 0.3 * (plain - near).norm(dim=1).mean()  # error ~ ||k - mean||


@pytest.mark.parametrize("mode", ["mse", "qjl"])
def test_key_scores_equal_inner_products_with_decoded_keys(mode):
    tq = TurboQuantizer(64, 3, projections=64, seed=5, key_mode=mode)
    k, q = torch.randn(300, 64), torch.randn(7, 64)
    offset = torch.randn(64) * 0.5
    enc = tq.encode_keys(k, offset)
    ref = q @ tq.decode_keys(enc, offset).T
    assert torch.allclose(tq.key_scores(q, enc, offset), ref, atol=1e-4)
    rotated = tq.rotate_queries(q)  # rotate once, reuse for every key block
    assert torch.allclose(tq.key_scores(rotated, enc, offset, rotated=True), ref, atol=1e-4)


def test_weighted_values_equal_weights_times_decoded_values():
    tq = TurboQuantizer(64, 4, seed=2)
    v, w = torch.randn(300, 64), torch.rand(5, 300)
    offset = torch.randn(64)
    enc = tq.encode_values(v, offset)
    assert torch.allclose(
        tq.weighted_values(w, enc, offset), w @ tq.decode_values(enc, offset), atol=1e-4
    )


def test_qjl_inner_product_estimator_is_unbiased():
    """Fixed key and query; the estimator's randomness is the sketch matrix (a seed). The mean
    error over many seeds must be ~0 within 4 standard errors, where the standard error
    comes from the per-seed variance (QJL: ~ (pi/2) ||q||^2 ||r||^2 / m). The MSE-only
    estimator of the same bits is biased (the codebook shrinks inner products), which this
    tolerance detects, so the test can fail."""
    torch.manual_seed(0)
    k = torch.randn(1, 64)
    q = k + 0.5 * torch.randn(1, 64)  # correlated, so <q, k> is large and a shrink shows
    exact = (q @ k.T).item()
    seeds = 1500
    errors = {"qjl": [], "mse": []}
    for s in range(seeds):
        for mode, bits in (("qjl", 2), ("mse", 1)):  # both: 1 codebook bit per coordinate
            tq = TurboQuantizer(64, bits, projections=64, seed=s, key_mode=mode)
            errors[mode].append(tq.key_scores(q, tq.encode_keys(k)).item() - exact)
    e = torch.tensor(errors["qjl"], dtype=torch.float64)
    stderr = e.std().item() / math.sqrt(seeds)
    assert abs(e.mean().item()) < 4 * stderr, (e.mean().item(), stderr)
    theory_var = (math.pi / 2) * q.norm().item() ** 2 * k.norm().item() ** 2 * 0.3634 / 64
    assert e.var().item() < 1.5 * theory_var  # ||r||^2 ~ 0.36 ||k||^2 after 1 bit
    biased = torch.tensor(errors["mse"], dtype=torch.float64)
    assert abs(biased.mean().item()) > 4 * biased.std().item() / math.sqrt(seeds)
    assert e.var() > 2 * biased.var()  # the price of no bias: why keys default to "mse"


def test_encoding_is_deterministic_per_seed():
    x = torch.randn(20, 64)
    a = TurboQuantizer(64, 4, seed=1).encode_keys(x)
    b = TurboQuantizer(64, 4, seed=1).encode_keys(x)
    c = TurboQuantizer(64, 4, seed=2).encode_keys(x)
    assert all(torch.equal(s, t) for s, t in zip(a.tensors(), b.tensors(), strict=True))
    assert not torch.equal(a.codes, c.codes)


@pytest.mark.parametrize("mode", ["mse", "qjl"])
@pytest.mark.parametrize("bits", [1, 3, 4])
def test_nbytes_counts_every_buffer(mode, bits):
    tq = TurboQuantizer(64, bits, projections=40, seed=0, key_mode=mode)
    x = torch.randn(10, 64)
    keys, values = tq.encode_keys(x), tq.encode_values(x)
    key_bits = bits - 1 if mode == "qjl" else bits
    sketch = (5 + 2) if mode == "qjl" else 0  # 40 sign bits + bf16 residual norm
    assert tq.nbytes(keys) == 10 * (64 * key_bits // 8 + 2 + sketch) == 10 * tq.bytes_per_key()
    assert tq.nbytes(values) == 10 * (64 * bits // 8 + 2) == 10 * tq.bytes_per_value()
    assert keys.codes.dtype == values.codes.dtype == torch.uint8


def test_huge_and_zero_vectors_round_trip():
    tq = TurboQuantizer(64, 4, seed=0)
    x = torch.randn(3, 64)
    x[0] *= 1e30  # squares overflow float32: norms are taken in float64
    x[1] = 0.0
    got = tq.decode_values(tq.encode_values(x))
    assert torch.isfinite(got).all()
    assert (got[0] - x[0]).double().norm() < 0.15 * x[0].double().norm()
    assert torch.equal(got[1], torch.zeros(64))


def test_bad_configuration_and_shapes_raise_typed_errors():
    for kwargs in (
        {"head_dim": 1, "bits": 4},
        {"head_dim": 64, "bits": 0},
        {"head_dim": 64, "bits": 9},
    ):
        with pytest.raises(InvalidConfigError):
            TurboQuantizer(**kwargs)
    with pytest.raises(InvalidConfigError):
        TurboQuantizer(64, 4, projections=0)
    with pytest.raises(InvalidConfigError):
        TurboQuantizer(64, 4, key_mode="prod")
    tq = TurboQuantizer(64, 4)
    with pytest.raises(DimensionMismatchError):
        tq.encode_keys(torch.randn(3, 32))
    with pytest.raises(DimensionMismatchError):
        tq.key_scores(torch.randn(2, 32), tq.encode_keys(torch.randn(3, 64)))


def test_per_row_offsets_equal_shared_offsets_row_by_row():
    """A cell cache mixing heads in one batch passes one offset per row ([N, D])."""
    tq = TurboQuantizer(32, 4, seed=0)
    x = torch.randn(40, 32) + 4.0
    offsets = torch.stack([torch.full((32,), 4.0), torch.zeros(32)]).repeat(20, 1)  # [40, D]
    enc = tq.encode_keys(x, offsets)
    q, w = torch.randn(3, 32), torch.rand(3, 40)
    for r in range(2):  # rows r, r+2, ...: the same as encoding them with their shared offset
        shared = tq.encode_keys(x[r::2], offsets[r])
        assert torch.equal(enc.codes[r::2], shared.codes) and torch.equal(
            enc.scale[r::2], shared.scale
        )
    decoded = tq.decode_keys(enc, offsets)
    assert torch.allclose(tq.key_scores(q, enc, offsets), q @ decoded.T, atol=1e-4)
    values = tq.encode_values(x, offsets)
    ref = w @ tq.decode_values(values, offsets)
    assert torch.allclose(tq.weighted_values(w, values, offsets), ref, atol=1e-4)
    with pytest.raises(DimensionMismatchError):
        tq.encode_keys(x, torch.zeros(39, 32))


@pytest.mark.parametrize("dim", [32, 100, 200])  # one GEMM; padded; two Hadamard stages
def test_a_row_rotates_to_the_same_bits_whatever_it_is_batched_with(dim):
    """BLAS picks kernels by shape (products of 1..11 rows differ in the last bit from the
    same rows of a larger product here); the encoding rotation is elementwise butterflies in
    a fixed order, so a row's bits do not depend on its batch, for one head or a stack."""
    heads = [Rotation(dim, seed=s) for s in (4, 5, 6)]
    x = torch.randn(3, 300, dim)
    full = RotationStack(heads).forward(x)  # [3, 300, P]
    assert torch.allclose(full[1], heads[1].forward(x[1]), atol=1e-5)  # the same rotation
    alone = RotationStack(heads[2:])
    for n in (*range(1, 34), 47, 63, 64, 65, 100, 130, 255):
        for start in (0, 17, 300 - n):
            rows = slice(start, start + n)
            assert torch.equal(RotationStack(heads).forward(x[:, rows]), full[:, rows])
            assert torch.equal(alone.forward(x[2:, rows]), full[2:, rows])


def test_import_kvcache_does_not_load_scipy_until_a_codebook_is_fitted():
    import os
    import subprocess
    import sys

    import kvcache

    src = os.path.dirname(os.path.dirname(kvcache.__file__))
    script = (
        "import sys; import kvcache, kvcache.codecs, kvcache.compressed\n"
        "assert 'scipy' not in sys.modules, 'import kvcache loaded scipy'\n"
        "from kvcache.codecs.quantizer import TurboQuantizer\n"
        "TurboQuantizer(64, 4)\n"
        "assert 'scipy' in sys.modules, 'fitting did not need scipy?'\n"
    )
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_pieces_are_built_on_the_device_they_are_given():
    cpu = torch.device("cpu")
    tq = TurboQuantizer(64, 4, key_mode="qjl", device="cpu")
    tensors = [tq.rotation.signs, tq.value_codebook.centroids, tq.value_codebook.cell_codes]
    tensors += [tq.qjl.matrix, tq.value_codebook.byte_centroids, tq.key_codebook.cell_squares]
    assert all(t.device == cpu for t in tensors) and tq.device == cpu
    moved = tq.to("cpu")  # same constants, same codes
    x = torch.randn(9, 64)
    assert torch.equal(moved.encode_keys(x).codes, tq.encode_keys(x).codes)
    assert torch.equal(lloyd_max(64, 4).to(cpu).centroids, lloyd_max(64, 4).centroids)
    assert torch.equal(Rotation(64, 1).to(cpu).matrix, Rotation(64, 1).matrix)
    assert torch.equal(tq.qjl.to(cpu).matrix, tq.qjl.matrix)


def unavailable_devices() -> list[str]:
    """Devices this machine cannot serve: meta always (no data), cuda where it is absent."""
    out = ["meta"]
    if not torch.cuda.is_available():
        out += ["cuda", "cuda:0"]
    return out + [f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 7}"]


@pytest.mark.parametrize("device", unavailable_devices())
def test_a_device_that_cannot_be_served_raises_a_typed_error(device):
    for make in (
        lambda: TurboQuantizer(64, 4, device=device),
        lambda: Rotation(64, 0, device=device),
        lambda: QJLSketch(64, 8, 0, device=device),
        lambda: lloyd_max(64, 4, device),
        lambda: lloyd_max(64, 4).to(device),
        lambda: KVCacheCompressor(KVCacheConfig(64, 4), device=device),
        lambda: MultiHeadKVCache(2, KVCacheConfig(64, 4), device=device),
    ):
        with pytest.raises(NotSupportedError, match="device="):
            make()
    with pytest.raises(InvalidConfigError, match="device"):
        TurboQuantizer(64, 4, device="no-such-device")


def test_inputs_on_another_device_raise_a_typed_error():
    tq = TurboQuantizer(64, 4)
    on_meta = torch.zeros(3, 64, device="meta")
    with pytest.raises(InvalidArgumentError, match="x.device"):
        tq.encode_keys(on_meta)
    with pytest.raises(InvalidArgumentError, match="offset.device"):
        tq.encode_keys(torch.zeros(3, 64), torch.zeros(64, device="meta"))
    stack = HeadStack([tq, TurboQuantizer(64, 4, seed=1)])
    with pytest.raises(InvalidArgumentError, match="x.device"):
        stack.encode_values(torch.zeros(2, 3, 64, device="meta"))
    head = KVCacheCompressor(KVCacheConfig(64, 4))
    with pytest.raises(InvalidArgumentError, match="key.device"):
        head.push(on_meta, torch.zeros(3, 64))
    assert head.is_empty()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_quantizer_decodes_like_the_cpu_one():  # runs only where a GPU is lent
    x = torch.randn(200, 64)
    cpu, gpu = TurboQuantizer(64, 4, seed=3), TurboQuantizer(64, 4, seed=3, device="cuda")
    assert gpu.value_codebook.centroids.is_cuda and gpu.rotation.signs.is_cuda
    got = gpu.decode_values(gpu.encode_values(x.cuda())).cpu()
    want = cpu.decode_values(cpu.encode_values(x))
    assert (got - want).abs().max() < 0.05 * x.abs().max()
    head = KVCacheCompressor(KVCacheConfig(64, 4), device="cuda")
    head.push(x, x)
    assert head.attend(x[0]).is_cuda


def test_an_offset_table_with_an_index_equals_the_per_row_offsets_it_picks():
    """How the compressed cache scores keys centred by different snapshots in one call."""
    tq = TurboQuantizer(32, 4, seed=1)
    table = torch.randn(3, 32) * 4  # [J, D]
    index = torch.tensor([0, 0, 1, 2, 2, 2, 1, 0])  # [N]
    x = table[index] + torch.randn(8, 32)
    enc = tq.encode_keys(x, table[index])
    q = torch.randn(5, 32)
    rows = tq.key_scores(q, enc, table[index])
    assert torch.allclose(tq.key_scores(q, enc, table, index=index), rows, atol=1e-4)
    assert torch.allclose(tq.decode_keys(enc, table, index), tq.decode_keys(enc, table[index]))
    with pytest.raises(DimensionMismatchError):
        tq.key_scores(q, enc, table, index=index[:5])
    with pytest.raises(DimensionMismatchError):
        tq.decode_keys(enc, table[:, :16], index)

"""kernels.qlinear: GGUF weight blocks dequantized bit for bit as gguf does, and the int8
decode-row kernel against dequantize-then-matmul in float64.

The bound. The kernel quantizes each block b of G activations (32 for the q8_0 family, 256 for
the K-quants) to codes q = round(x / d_b), d_b = amax_b / 127, and sums the weights' exact
integer products with those codes in float32. So per output n, with w the gguf weights:

    |y - w . x|  <=  sum_b (d_b / 2) sum_{k in b} |w_k|  (1 + 2^-20)          the int8 step
                   + sum_k |w_k| |x_k| 2^-21                                   rounding x / d
                   + (K / G + 16) 2^-23 sum_k A_k (|x_k| + d_b)                 float32 sums

where A_k = |d sc q|_k + |dm mn|_k is the weight's magnitude before its minimum is added (the
kernel sums the codes' and the minimums' terms apart; gguf's weights with the minimums zeroed
give the first). The test also asks that the error reaches a few percent of the bound
somewhere (the bound is not slack enough to hide a wrong scale or a swapped nibble order).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kvcache.errors import DimensionMismatchError, InvalidArgumentError
from kvcache.kernels import linear as L
from kvcache.kernels import qlinear as Q

TYPES = list(Q.BLOCK_TYPES)
# every layout the kernels read: the GGUF rows of each type, and Q4_0 / Q4_1 rows interleaved
# by 8 ("x8", how the loaders hand layer weights to the decode kernels)
KINDS = TYPES + [n + "x8" for n in Q.INTERLEAVED]
# byte offsets of each block's float16 fields (scales d, then the minimum's factor)
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
# byte offsets of the minimum's factor (zeroed to get A_k's code term)
MINS = {"Q4_1": 2, "Q4_K": 2}


def base(name: str) -> str:
    """The GGUF type of a layout name ("Q4_1x8" -> "Q4_1")."""
    return name.removesuffix("x8")


def fit(name: str, rows: int) -> int:
    """``rows`` rounded down to whole groups of 8 for an interleaved layout."""
    return rows // 8 * 8 if name.endswith("x8") else rows


def random_blocks(name: str, rows: int, k: int, seed: int, extreme: bool = False) -> np.ndarray:
    """uint8 [rows, k / values * nbytes] in the file's order: random codes, finite random
    float16 scales (with ``extreme``, also +-65504, subnormals and zeros among them)."""
    name = base(name)
    t = Q.BLOCK_TYPES[name]
    rng = np.random.default_rng(seed)
    n = rows * (k // t.values)
    blocks = rng.integers(0, 256, size=(n, t.nbytes), dtype=np.uint8)
    for off in HALVES[name]:
        h = (rng.standard_normal(n) * 0.02).astype(np.float16)
        if extreme:
            pick = rng.integers(0, 6, size=n)
            special = np.array([65504, -65504, 6e-8, -6e-5, 0.0, -0.0], dtype=np.float16)
            h = np.where(rng.random(n) < 0.3, special[pick], h).astype(np.float16)
        blocks[:, off : off + 2] = h.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def weight(name: str, data: np.ndarray, k: int) -> Q.QuantizedWeight:
    """The blocks ``data`` (file order) as a weight in layout ``name``."""
    part = Q.WeightPart(Q.BLOCK_TYPES[base(name)], torch.from_numpy(data))
    w = Q.QuantizedWeight((part,), k)
    if name.endswith("x8"):
        w = Q.interleave(w)
        assert w.parts[0].interleaved and not torch.equal(w.parts[0].data, part.data), name
    return w


def gguf_values(name: str, data: np.ndarray) -> np.ndarray:
    t = GGMLQuantizationType(Q.BLOCK_TYPES[base(name)].ggml)
    return np.asarray(dequantize(data, t), dtype=np.float32).reshape(data.shape[0], -1)


def code_magnitude(name: str, data: np.ndarray) -> np.ndarray:
    """A_k of the bound: |weights with the minimums zeroed| + |the minimums' term|."""
    w = gguf_values(name, data)
    name = base(name)
    if name not in MINS:
        return np.abs(w)
    t = Q.BLOCK_TYPES[name]
    blocks = data.reshape(-1, t.nbytes).copy()
    blocks[:, MINS[name] : MINS[name] + 2] = 0
    codes = gguf_values(name, blocks.reshape(data.shape))
    return np.abs(codes) + np.abs(w - codes)


def bound(x: torch.Tensor, name: str, data: np.ndarray) -> torch.Tensor:
    """The module docstring's bound per output [M, N] (float64)."""
    g = Q.BLOCK_TYPES[base(name)].values
    w = torch.from_numpy(gguf_values(name, data)).double().abs()
    a = torch.from_numpy(code_magnitude(name, data)).double()
    m, k = x.shape
    amax = x.abs().view(m, k // g, g).amax(-1)
    step = (amax / 127).double().repeat_interleave(g, dim=1)  # d_b per value [M, K]
    xa = x.double().abs()
    quant = (step / 2 * (1 + 2.0**-20)) @ w.t() + xa @ w.t() * 2.0**-21
    sums = (k / g + 16) * 2.0**-23 * ((xa + step) @ a.t())
    return quant + sums + 1e-30


def reference(x: torch.Tensor, name: str, data: np.ndarray) -> torch.Tensor:
    return x.double() @ torch.from_numpy(gguf_values(name, data)).double().t()


def assert_within(got: torch.Tensor, x: torch.Tensor, name: str, data: np.ndarray) -> float:
    """The kernel's error within the bound; returns the largest error / bound."""
    err = (got.double() - reference(x, name, data)).abs()
    b = bound(x, name, data)
    ratio = float((err / b).max())
    assert ratio <= 1.0, (name, ratio)
    return ratio


# --- dequantizers ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("extreme", [False, True])
def test_dequantize_equals_gguf_bit_for_bit_on_random_blocks(name: str, extreme: bool) -> None:
    k = 512
    data = random_blocks(name, fit(name, 37), k, seed=KINDS.index(name), extreme=extreme)
    got = weight(name, data, k).dequantize().numpy()
    want = gguf_values(name, data)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


@pytest.mark.parametrize("name", KINDS)
def test_rows_dequantizes_only_the_rows_looked_up(name: str) -> None:
    k = 256
    n = fit(name, 50)
    data = random_blocks(name, n, k, seed=7)
    w = weight(name, data, k)
    ids = torch.tensor([[3, n - 1], [0, 3]])
    got = w.rows(ids)
    assert got.shape == (2, 2, k)
    assert torch.equal(got, w.dequantize()[ids])
    with pytest.raises(InvalidArgumentError):
        w.rows(torch.tensor([n]))


@pytest.mark.parametrize("name", Q.INTERLEAVED)
def test_interleaved_rows_hold_the_files_bytes(name: str) -> None:
    """Interleaving moves bytes only: the file's bytes come back, and a part whose rows do
    not fill groups of 8 (or of a type the kernels read as stored) stays as it was."""
    k = 256
    data = random_blocks(name, 40, k, seed=17)
    w = weight(name + "x8", data, k)
    assert np.array_equal(w.parts[0].gguf_bytes().numpy(), data)
    odd = weight(name, random_blocks(name, 43, k, seed=18), k)
    assert Q.interleave(odd).parts[0] == odd.parts[0]
    q6 = weight("Q6_K", random_blocks("Q6_K", 40, k, seed=19), k)
    assert not Q.interleave(q6).parts[0].interleaved
    with pytest.raises(InvalidArgumentError, match="groups of 8"):
        Q.QuantizedWeight((Q.WeightPart(q6.parts[0].kind, q6.parts[0].data, True),), k)
    for begin, end in ((0, 4), (3, 21), (36, 40)):  # a few rows back without the whole part
        assert np.array_equal(w.parts[0].gguf_bytes(begin, end).numpy(), data[begin:end])
    with pytest.raises(InvalidArgumentError, match="groups of 8"):
        Q.QuantizedWeight((Q.WeightPart(odd.parts[0].kind, odd.parts[0].data, True),), k)


@functools.cache
def _real_tensors() -> list[tuple[str, str, np.ndarray, int]]:
    """(file, tensor, the first and last 32 rows' blocks, K) of every quantized tensor of the
    two bundled GGUF files."""
    from kvcache.weights.bundled import gemma3_path
    from kvcache.weights.gguf import smollm2_path

    names = {t.ggml: t.name for t in Q.BLOCK_TYPES.values()}
    out = []
    for path in (smollm2_path(), gemma3_path()):
        for t in GGUFReader(path).tensors:
            if int(t.tensor_type) in names:
                rows = np.concatenate([t.data[:32], t.data[-32:]])
                out.append(
                    (names[int(t.tensor_type)], t.name, np.ascontiguousarray(rows), int(t.shape[0]))
                )
    return out


def test_dequantize_equals_gguf_on_the_bundled_files() -> None:
    """Every quantized tensor of SmolLM2 (Q4_1, Q8_0) and Gemma 3 (Q5_0, Q4_K, Q6_K, Q8_0)."""
    tensors = _real_tensors()
    assert {name for name, *_ in tensors} >= {"Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    for name, tensor, data, k in tensors:
        for layout in [name] + [name + "x8"] * (name in Q.INTERLEAVED):
            got = weight(layout, data, k).dequantize().numpy()
            want = gguf_values(name, data)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (layout, tensor)


# --- the decode-row kernel -------------------------------------------------------------------


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("k", [256, 768])
def test_kernel_equals_float64_within_the_int8_bound(name: str, k: int) -> None:
    n = fit(name, 67)
    data = random_blocks(name, n, k, seed=k + KINDS.index(name))
    w = weight(name, data, k)
    g = torch.Generator().manual_seed(k)
    worst = 0.0
    for m in (1, 2, 3, 5, 16, Q.MAX_ROWS):
        x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g)  # uneven blocks
        assert Q.served(x, w)
        got = Q.linear(x, w)
        assert got.shape == (m, n) and got.dtype == torch.float32
        worst = max(worst, assert_within(got, x, name, data))
    assert worst > 0.02, (name, worst)  # the bound is tight enough to catch a kernel bug


def quantized_rows(x: torch.Tensor, g: int) -> torch.Tensor:
    """x [M, K] after ggml's activation rule, per block of g: codes round(x * (127 / amax)),
    ties to even, clamped to +-127, times the scale amax / 127 (float32 steps)."""
    m, k = x.shape
    blocks = x.view(m, k // g, g)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q.double() * (amax / 127).double()).view(m, k)


@pytest.mark.parametrize("name", KINDS)
def test_kernel_equals_the_product_of_its_quantized_activations(name: str) -> None:
    """Against gguf's weights times the activations quantized by ggml's rule, in float64, the
    kernel is exact but for float32 sums across blocks: a wrong activation scale (1 %) or
    rounding rule fails here, where it hides inside the worst-case bound above."""
    k = 512
    data = random_blocks(name, 40, k, seed=31 + KINDS.index(name))
    w = weight(name, data, k)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(5))
    g = Q.BLOCK_TYPES[base(name)].values
    want = quantized_rows(x, g) @ torch.from_numpy(gguf_values(name, data)).double().t()
    scale = quantized_rows(x, g).abs() @ torch.from_numpy(code_magnitude(name, data)).double().t()
    err = (Q.linear(x, w).double() - want).abs()
    assert float((err / (scale + 1e-30)).max()) < 1e-5, name


@pytest.mark.parametrize("name", KINDS)
def test_kernel_within_the_bound_on_extreme_scales(name: str) -> None:
    k = 512
    data = random_blocks(name, 40, k, seed=11, extreme=True)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(3)) * 1e-3
    assert_within(Q.linear(x, weight(name, data, k)), x, name, data)


def test_kernel_on_the_bundled_files() -> None:
    """One tensor of each type of the real files, against its float64 product."""
    seen: set[str] = set()
    g = torch.Generator().manual_seed(5)
    for name, _tensor, data, k in _real_tensors():
        if name in seen:
            continue
        seen.add(name)
        x = torch.randn(3, k, generator=g)
        for layout in [name] + [name + "x8"] * (name in Q.INTERLEAVED):
            assert_within(Q.linear(x, weight(layout, data, k)), x, layout, data)


def test_rows_do_not_depend_on_their_batch() -> None:
    """A row's output is bit-identical alone and at any place in a batch of 16, on 1 or 2
    threads, for every layout (mixed in one weight)."""
    k = 512
    parts = tuple(
        p
        for i, n in enumerate(KINDS)
        for p in weight(n, random_blocks(n, fit(n, 29), k, seed=i), k).parts
    )
    w = Q.QuantizedWeight(parts, k)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([Q.linear(x[i : i + 1], w) for i in range(16)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(Q.linear(x, w), alone)
            assert torch.equal(Q.linear(x.flip(0), w), alone.flip(0))
    finally:
        torch.set_num_threads(threads)


def test_mixed_parts_equal_each_part_alone() -> None:
    """A Q4_K_M-style weight (Q6_K rows beside Q4_K and q8_0-family rows) in one call gives
    each part's rows the bits of that part alone."""
    k = 512
    names = ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q4_1x8"]
    datas = [random_blocks(n, fit(n, 13 + i), k, seed=20 + i) for i, n in enumerate(names)]
    parts = tuple(p for n, d in zip(names, datas, strict=True) for p in weight(n, d, k).parts)
    w = Q.QuantizedWeight(parts, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    got = Q.linear(x, w)
    assert got.shape == (3, w.shape[0])
    alone = torch.cat(
        [Q.linear(x, weight(n, d, k)) for n, d in zip(names, datas, strict=True)], dim=1
    )
    assert torch.equal(got, alone)
    assert torch.equal(
        w.dequantize(),
        torch.cat([weight(n, d, k).dequantize() for n, d in zip(names, datas, strict=True)]),
    )


# --- fused neighbours ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Q4_1", "Q4_1x8", "Q4_K"])
def test_fused_ops_equal_their_composition(name: str) -> None:
    """norm_linear = linear(rms_norm(x)), add_linear = residual + linear, and with glu
    linear(swiglu(x)): the same bits as the separate calls for decode rows."""
    k = 512
    data = random_blocks(name, 24, k, seed=9)
    w = weight(name, data, k)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, k, generator=g)
    nw = torch.rand(k, generator=g) + 0.5
    res = torch.randn(5, 24, generator=g)
    assert torch.equal(Q.norm_linear(x, nw, 1e-5, w), Q.linear(L.rms_norm(x, nw, 1e-5), w))
    assert torch.equal(Q.add_linear(res, x, w), res + Q.linear(x, w))
    gate_up = torch.randn(5, 2 * k, generator=g)
    fused = Q.add_linear(res, gate_up, w, glu=True)
    composed = res + Q.linear(L.swiglu(gate_up), w)
    assert torch.equal(fused, composed)


# --- prefill ---------------------------------------------------------------------------------


@pytest.mark.parametrize("gemm", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["Q4_1", "Q4_1x8", "Q6_K"])
def test_prefill_rows_use_the_dequantized_weight(
    name: str, gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More than MAX_ROWS rows: tiles of gguf's weights in torch's GEMM, float32 or bfloat16
    (x and the tiles rounded to bf16, the product rounded once more; float32 out)."""
    monkeypatch.setenv(Q.PREFILL_ENV, gemm)
    k = 256
    n = fit(name, 45)
    data = random_blocks(name, n, k, seed=13)
    w = weight(name, data, k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(8))
    assert not Q.served(x, w)
    values = torch.from_numpy(gguf_values(name, data))
    exact = x.double() @ values.double().t()
    if gemm == "bf16":
        want = x.bfloat16().double() @ values.bfloat16().double().t()
        # the product's rounding to bf16 (8 bits): half a step of the largest
        tol = 2**-8 * float(want.abs().max())
    else:
        want, tol = exact, 1e-5 * float(exact.abs().max())
    got = Q.linear(x, w)
    assert got.dtype == torch.float32
    # the bf16 GEMM ran: a float32 one lands within 1e-5 of the exact product
    far = float((got.double() - exact).abs().max()) > 1e-4 * float(exact.abs().max())
    assert far == (gemm == "bf16")
    assert float((got.double() - want).abs().max()) < tol
    res = torch.randn(40, n)
    got = Q.add_linear(res, x, w)
    assert got.dtype == torch.float32
    assert float((got.double() - (res.double() + want)).abs().max()) < tol


def test_prefill_gemm_choice() -> None:
    """bf16 where the CPU multiplies it natively, float32 elsewhere; the override is checked."""
    x = torch.zeros(40, 32)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert Q.prefill_dtype(x) == (torch.bfloat16 if native else torch.float32)
    assert Q.prefill_dtype(x.double()) == torch.float64
    with pytest.MonkeyPatch.context() as m:
        m.setenv(Q.PREFILL_ENV, "fp32")
        assert Q.prefill_dtype(x) == torch.float32
        m.setenv(Q.PREFILL_ENV, "bf16")
        assert Q.prefill_dtype(x) == torch.bfloat16
        m.setenv(Q.PREFILL_ENV, "fp16")
        with pytest.raises(InvalidArgumentError, match=Q.PREFILL_ENV):
            Q.prefill_dtype(x)


# --- typed errors ----------------------------------------------------------------------------


def test_bad_shapes_raise_typed_errors() -> None:
    t = Q.BLOCK_TYPES["Q4_K"]
    good = torch.zeros(4, t.nbytes * 2, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="multiple"):
        Q.QuantizedWeight((Q.WeightPart(t, good),), 500)  # K not a multiple of 256
    with pytest.raises(InvalidArgumentError, match="uint8"):
        Q.QuantizedWeight((Q.WeightPart(t, good[:, :-1]),), 512)
    with pytest.raises(InvalidArgumentError, match="uint8"):
        Q.QuantizedWeight((Q.WeightPart(t, good.float()),), 512)
    with pytest.raises(InvalidArgumentError):
        Q.QuantizedWeight((), 512)
    w = Q.QuantizedWeight((Q.WeightPart(t, good),), 512)
    with pytest.raises(DimensionMismatchError):
        Q.linear(torch.zeros(2, 256), w)
    with pytest.raises(DimensionMismatchError):
        Q.add_linear(torch.zeros(2, 5), torch.zeros(2, 512), w)


def test_kernels_linear_takes_a_quantized_weight() -> None:
    """kernels.linear's three entry points hand a QuantizedWeight to kernels.qlinear."""
    k = 256
    data = random_blocks("Q8_0", 10, k, seed=15)
    w = weight("Q8_0", data, k)
    g = torch.Generator().manual_seed(10)
    x, res, b = torch.randn(2, k, generator=g), torch.randn(2, 10, generator=g), torch.randn(10)
    nw = torch.rand(k, generator=g) + 0.5
    assert torch.equal(L.linear(x, w), Q.linear(x, w))
    assert torch.equal(L.linear(x, w, b), Q.linear(x, w) + b)
    assert torch.equal(L.norm_linear(x, nw, 1e-6, w), Q.norm_linear(x, nw, 1e-6, w))
    assert torch.equal(L.add_linear(res, x, w), Q.add_linear(res, x, w))


def test_no_rows_give_no_rows() -> None:
    """A prompt chunk that asks for no logits hands the LM head 0 rows (the engine's chunked
    prefill): [0, N] back, as F.linear gives, through every entry."""
    k = 256
    w = weight("Q4_1", random_blocks("Q4_1", 8, k, seed=3), k)
    x = torch.empty(0, k)
    assert Q.linear(x, w).shape == (0, 8)
    assert Q.norm_linear(x, torch.ones(k), 1e-6, w).shape == (0, 8)
    assert Q.add_linear(torch.empty(0, 8), x, w).shape == (0, 8)

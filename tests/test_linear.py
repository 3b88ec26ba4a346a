"""kernels.linear: decode-sized linear layers in the C++ kernel, against float64 references.

The kernel must equal ``x @ w.T + b`` computed in float64 (within float32 rounding of a K-long
sum), give every row the same bits whatever rows share its batch and however many threads run
it, and hand everything it does not serve to ``F.linear`` unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcache.kernels import linear as L


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 rounding of a K-long sum of products, per output: K * eps * sum |x_k w_k|."""
    k = x.shape[-1]
    return k * 2.0**-23 * (x.double().abs() @ w.double().abs().t()) + 1e-30


@pytest.mark.parametrize("k", [8, 64, 384, 576])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 9, 13, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_float64_reference(k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for m in (1, 2, 3, 4, 5, 7, 16, L.MAX_ROWS):
        x = torch.randn(m, k, generator=g)
        assert L.served(x, w)
        got = L.linear(x, w, b)
        assert got.shape == (m, n) and got.dtype == torch.float32
        err = (got.double() - _reference(x, w, b)).abs()
        assert (err <= _bound(x, w) + 1e-6).all(), (m, float(err.max()))


def test_rows_do_not_depend_on_their_batch() -> None:
    """A row's output is bit-identical alone, at any place in any batch, on 1 or 2 threads."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(517, 384, generator=g)
    b = torch.randn(517, generator=g)
    x = torch.randn(L.MAX_ROWS, 384, generator=g)
    alone = torch.cat([L.linear(x[i : i + 1], w, b) for i in range(len(x))])
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(L.linear(x, w, b), alone)
            for m in (2, 3, 5, 11):
                assert torch.equal(L.linear(x[:m], w, b), alone[:m])
                assert torch.equal(L.linear(x[-m:].flip(0), w, b), alone[-m:].flip(0))
    finally:
        torch.set_num_threads(previous)


def test_leading_dimensions_are_kept() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(2, 3, 64, generator=g)
    got = L.linear(x, w)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), L.linear(x.reshape(6, 64), w))


@pytest.mark.parametrize(
    "case",
    ["many rows", "float64", "k not multiple of 8", "strided weight", "no rows", "grad"],
)
def test_what_it_does_not_serve_goes_to_torch(case: str) -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 64, generator=g), torch.randn(24, 64, generator=g)
    if case == "many rows":
        x = torch.randn(L.MAX_ROWS + 1, 64, generator=g)
    elif case == "float64":
        x, w = x.double(), w.double()
    elif case == "k not multiple of 8":
        x, w = x[:, :60].contiguous(), w[:, :60].contiguous()
    elif case == "strided weight":
        w = torch.randn(64, 24, generator=g).t()
    elif case == "no rows":
        x = x[:0]
    else:
        w.requires_grad_(True)
    assert not L.served(x, w)
    got = L.linear(x, w)
    assert torch.equal(got, F.linear(x, w))
    if case == "grad":
        got.sum().backward()
        assert w.grad is not None


def test_add_linear_adds_the_residual() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 96, generator=g)
    for m in (1, 5, L.MAX_ROWS + 3):  # the kernel and the fused addmm
        x, r = torch.randn(m, 96, generator=g), torch.randn(m, 48, generator=g)
        err = (L.add_linear(r, x, w).double() - (r.double() + _reference(x, w, None))).abs()
        assert (err <= _bound(x, w) + 1e-5).all()


def test_bad_bias_is_refused_by_the_kernel() -> None:
    ext = L.extension()
    x, w = torch.randn(2, 16), torch.randn(5, 16)
    e = torch.empty(0)
    with pytest.raises(RuntimeError, match="bias"):
        ext.linear_rows(x, w, torch.randn(4), e, e, 0.0, False)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ext.linear_rows(x[:, :12].contiguous(), w[:, :12].contiguous(), e, e, e, 0.0, False)
    with pytest.raises(RuntimeError, match="residual"):
        ext.linear_rows(x, w, e, torch.randn(2, 4), e, 0.0, False)
    with pytest.raises(RuntimeError, match="norm"):
        ext.linear_rows(x, w, e, e, torch.randn(15), 1e-5, False)
    with pytest.raises(RuntimeError, match="glu"):
        ext.linear_rows(x, w, e, e, e, 0.0, True)  # glu takes [M, 2K]
    with pytest.raises(RuntimeError, match="not both"):
        ext.linear_rows(torch.randn(2, 32), w, e, e, torch.randn(16), 1e-5, True)


@pytest.mark.parametrize("k", [64, 576])
def test_norm_linear_is_the_two_calls_in_one(k: int) -> None:
    """``norm_linear`` gives the bits of ``linear(rms_norm(x))`` (the kernel's one formula),
    within float32 rounding of the float64 reference, fused or (prompt-sized) not."""
    g = torch.Generator().manual_seed(k + 11)
    w, nw = torch.randn(40, k, generator=g), torch.randn(k, generator=g)
    for m in (1, 3, L.MAX_ROWS, L.MAX_ROWS + 5):
        x = torch.randn(m, k, generator=g) * 3.0
        got = L.norm_linear(x, nw, 1e-5, w)
        normed = L.rms_norm(x, nw, 1e-5)
        assert torch.equal(got, L.linear(normed, w)), m
        ref = _rms_reference(x, nw, 1e-5) @ w.double().t()
        bound = _bound(normed, w) + (k + 8) * 2.0**-24 * (
            normed.double().abs() @ w.double().abs().t()
        )
        assert ((got.double() - ref).abs() <= bound + 1e-6).all(), m


def _glu_reference(x: torch.Tensor) -> torch.Tensor:
    a, b = x.double().chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


@pytest.mark.parametrize("k", [64, 1536])
def test_add_linear_glu_is_swiglu_then_the_product(k: int) -> None:
    """``add_linear(r, gate_up, w, glu=True)`` = r + (silu(gate) * up) @ w^T: against float64
    (the kernel's silu within a few float32 roundings of each hidden value) and against
    torch's F.silu chain, fused (decode rows) and not (prompt rows)."""
    g = torch.Generator().manual_seed(k + 12)
    w = torch.randn(48, k, generator=g)
    for m in (1, 4, L.MAX_ROWS, L.MAX_ROWS + 2):
        x, r = torch.randn(m, 2 * k, generator=g) * 2.0, torch.randn(m, 48, generator=g)
        got = L.add_linear(r, x, w, glu=True)
        hidden = _glu_reference(x)
        ref = r.double() + hidden @ w.double().t()
        abs_terms = hidden.abs() @ w.double().abs().t()
        bound = (k + 8) * 2.0**-23 * abs_terms + 2.0**-23 * r.double().abs()
        assert ((got.double() - ref).abs() <= bound + 1e-6).all(), m
        torch_chain = r + F.linear(F.silu(x[:, :k]) * x[:, k:], w)
        torch.testing.assert_close(got, torch_chain, rtol=1e-5, atol=1e-4)


def test_fused_rows_do_not_depend_on_their_batch() -> None:
    """norm_linear and the SwiGLU add_linear: a row alone and in a batch, the same bits."""
    g = torch.Generator().manual_seed(13)
    w, nw = torch.randn(77, 64, generator=g), torch.randn(64, generator=g)
    wd = torch.randn(77, 32, generator=g)
    x, r = torch.randn(9, 64, generator=g), torch.randn(9, 77, generator=g)
    normed = L.norm_linear(x, nw, 1e-6, w)
    assert torch.equal(
        normed, torch.cat([L.norm_linear(x[i : i + 1], nw, 1e-6, w) for i in range(9)])
    )
    glu = L.add_linear(r, x, wd, glu=True)
    assert torch.equal(
        glu, torch.cat([L.add_linear(r[i : i + 1], x[i : i + 1], wd, glu=True) for i in range(9)])
    )


def _rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("k", [8, 64, 576])
def test_rms_norm_equals_float64_reference(k: int) -> None:
    """The kernel's RMSNorm against float64, within float32 rounding of a K-long sum of
    squares (relative K * 2^-24 of each output, and a few roundings more), on 2-D and 3-D
    inputs, tiny and large rows, and as many rows as a prompt chunk."""
    g = torch.Generator().manual_seed(k)
    w = torch.randn(k, generator=g)
    bound = (k + 8) * 2.0**-24
    for shape in ((1, k), (3, k), (16, k), (2, 5, k), (300, k)):
        for scale in (1e-3, 1.0, 50.0):
            x = torch.randn(*shape, generator=g) * scale
            got = L.rms_norm(x, w, 1e-5)
            assert got.shape == x.shape and got.dtype == torch.float32
            ref = _rms_reference(x, w, 1e-5)
            err = (got.double() - ref).abs()
            assert (err <= bound * ref.abs() + 1e-30).all(), (shape, scale, float(err.max()))
            torch.testing.assert_close(
                got, F.rms_norm(x, (k,), w, 1e-5), rtol=2 * bound, atol=1e-30
            )


def test_rms_norm_hands_the_rest_to_torch() -> None:
    """float64, K not a multiple of 8, and autograd inputs get F.rms_norm itself."""
    g = torch.Generator().manual_seed(7)
    x, w = (
        torch.randn(4, 64, generator=g, dtype=torch.float64),
        torch.randn(64, dtype=torch.float64),
    )
    assert torch.equal(L.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))
    x, w = torch.randn(4, 60, generator=g), torch.randn(60, generator=g)
    assert torch.equal(L.rms_norm(x, w, 1e-6), F.rms_norm(x, (60,), w, 1e-6))
    x = torch.randn(2, 64, generator=g, requires_grad=True)
    w = torch.randn(64, generator=g)
    y = L.rms_norm(x, w, 1e-6)
    y.sum().backward()
    assert x.grad is not None

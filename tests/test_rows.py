"""kernels.rows: RoPE of rows and K/V rows stored into cells, one C++ call each.

Both must give the bits of the torch ops they replace (``x * cos`` then ``addcmul`` for RoPE,
``index_copy_`` of rows converted to the buffer's dtype for the stores), check every index
before writing anything, and leave what they do not serve to those ops.
"""

from __future__ import annotations

import pytest
import torch

from kvcache.kernels import rows as K
from kvcache.kernels.build import extension
from kvcache.kernels.linear import rms_norm
from kvcache.models.rope import Rope


def _rope_ops(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in rotate-half pairs by torch's ops (models/rope.py's formula)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


@pytest.mark.parametrize("t,h,d", [(1, 3, 64), (7, 12, 64), (300, 15, 64), (5, 2, 8), (3, 4, 128)])
def test_rope_equals_torch_ops_bitwise(t: int, h: int, d: int) -> None:
    g = torch.Generator().manual_seed(t * 100 + h)
    rope = Rope(d, 100000.0)
    # q and k as a Llama slices them out of its fused projection: rows strided, heads packed
    qkv = torch.randn(t, (h + 5) * d, generator=g) * 4
    x = qkv[:, : h * d].view(t, h, d)
    cos, sin = rope.tables(torch.randint(-9000, 9000, (t,), generator=g), torch.float32)
    got = K.rope(x, cos, sin)
    assert got is not None and got.is_contiguous() and got.shape == (t, h, d)
    assert torch.equal(got, _rope_ops(x, cos, sin))
    assert torch.equal(Rope.rotate(x, cos, sin), got)
    # position 0 (cos 1, sin 0): x itself
    back_cos, back_sin = rope.tables(torch.zeros(t), torch.float32)
    assert torch.equal(K.rope(x, back_cos, back_sin), x)


def test_rope_leaves_what_it_does_not_serve_to_torch() -> None:
    g = torch.Generator().manual_seed(0)
    rope = Rope(64, 10000.0)
    x = torch.randn(4, 3, 64, generator=g)
    cos, sin = rope.tables(torch.arange(4), torch.float32)
    c64, s64 = rope.tables(torch.arange(4), torch.float64)
    assert K.rope(x.double(), c64, s64) is None
    assert K.rope(x.transpose(0, 1), cos, sin) is None  # heads not contiguous
    assert K.rope(x, cos[:3], sin[:3]) is None  # tables of other rows
    leaf = x.clone().requires_grad_(True)
    assert K.rope(leaf, cos, sin) is None
    with torch.no_grad():
        assert K.rope(leaf, cos, sin) is not None
    # Rope.rotate serves them all, by the ops
    assert torch.equal(Rope.rotate(x.double(), c64, s64), _rope_ops(x.double(), c64, s64))
    y = Rope.rotate(leaf, cos, sin)
    y.sum().backward()
    assert leaf.grad is not None and torch.equal(y.detach(), _rope_ops(x, cos, sin))


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("rotate_keys", [True, False])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (6, 4, 1, 256), (33, 2, 2, 8)])
def test_split_heads_equals_slices_norms_and_rope_bitwise(
    t: int, hq: int, hkv: int, d: int, rotate_keys: bool, normed: bool
) -> None:
    g = torch.Generator().manual_seed(t * 10 + hq)
    rope = Rope(d, 10000.0)
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 16, generator=g)[:, 16:] * 3  # strided rows
    cos, sin = rope.tables(torch.randint(0, 5000, (t,), generator=g), torch.float32)
    norms = (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5)
    q = qkv[:, : hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].reshape(t, hkv, d)
    if normed:  # Gemma 3: each head RMS-normed before RoPE
        q, k = rms_norm(q, norms[0], 1e-6), rms_norm(k, norms[1], 1e-6)
    want = (_rope_ops(q, cos, sin), _rope_ops(k, cos, sin) if rotate_keys else k, v)
    got = K.split_heads(
        qkv, hq, hkv, cos, sin, rotate_keys=rotate_keys, norms=norms if normed else None, eps=1e-6
    )
    assert got is not None
    for a, b in zip(got, want, strict=True):
        assert a.is_contiguous() and a.shape == b.shape
        assert torch.equal(a, b)


def test_split_heads_leaves_what_it_does_not_serve_to_the_caller() -> None:
    rope = Rope(64, 10000.0)
    qkv = torch.randn(2, 5 * 64)
    cos, sin = rope.tables(torch.arange(2), torch.float32)
    assert K.split_heads(qkv, 3, 1, cos, sin) is not None
    assert K.split_heads(qkv.double(), 3, 1, cos.double(), sin.double()) is None
    assert K.split_heads(qkv, 2, 1, cos, sin) is None  # 4 heads' width is not 5 heads'
    assert K.split_heads(qkv, 3, 1, cos[:1], sin[:1]) is None  # tables of other rows
    assert K.split_heads(qkv.t().contiguous().t(), 3, 1, cos, sin) is None  # strided channels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mapped", [False, True])
def test_put_rows_equals_index_copy(dtype: torch.dtype, mapped: bool) -> None:
    g = torch.Generator().manual_seed(1)
    for t, n in ((1, 1), (9, 6), (300, 300)):
        dst = torch.randn(400, 3, 64, generator=g).to(dtype)
        want = dst.clone()
        src = torch.randn(t, 3, 64, generator=g) * 300  # fp16 rounding and overflow to inf
        slots = torch.randperm(400, generator=g)[:n]
        rows = torch.randperm(t, generator=g)[:n] if mapped else None
        picked = src[:n] if rows is None else src[rows]
        want.index_copy_(0, slots, picked.to(dtype))
        K.put_rows(dst, slots, src, rows)
        assert torch.equal(dst, want)


def test_put_rows_checks_every_index_before_writing() -> None:
    dst = torch.zeros(10, 2, 8, dtype=torch.float16)
    src = torch.ones(4, 2, 8)
    for slots, rows in (
        (torch.tensor([0, 10]), None),  # a slot past the buffer
        (torch.tensor([1, -1]), None),
        (torch.tensor([0, 1]), torch.tensor([0, 4])),  # a row past src
        (torch.tensor([0, 1, 2, 3, 4]), None),  # more slots than src rows
    ):
        with pytest.raises(RuntimeError, match="kvcache put_rows"):
            K.put_rows(dst, slots, src, rows)
        assert not dst.any()  # the valid first index was not written either


def test_put_rows_leaves_other_dtypes_to_index_copy() -> None:
    dst = torch.zeros(6, 2, 8, dtype=torch.float64)
    src = torch.randn(3, 2, 8)
    K.put_rows(dst, torch.tensor([5, 0]), src, torch.tensor([2, 1]))
    assert torch.equal(dst[5], src[2].double()) and torch.equal(dst[0], src[1].double())
    half = torch.zeros(6, 2, 8, dtype=torch.float16)
    K.put_rows(half, torch.tensor([3]), src.double())  # float64 rows: converted by torch
    assert torch.equal(half[3], src[0].half())


def test_put_rows_takes_strided_indices() -> None:
    dst = torch.zeros(8, 2, 8, dtype=torch.float16)
    src = torch.randn(6, 2, 8)
    slots, rows = torch.tensor([7, 0, 5, 1])[::2], torch.tensor([4, 9, 2, 9])[::2]  # [7, 5], [4, 2]
    K.put_rows(dst, slots, src, rows)
    assert torch.equal(dst[7], src[4].half()) and torch.equal(dst[5], src[2].half())
    assert int((dst != 0).any(dim=(1, 2)).sum()) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_put_rows_reads_k_and_v_as_slices_of_a_fused_projection(dtype: torch.dtype) -> None:
    """A Llama's k and v are slices of q|k|v rows: strided rows and heads, contiguous channels.
    The kernel itself takes them (the fallback's copies cost what the kernel saves)."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(16, (9 + 2 * 3) * 64, generator=g)
    qk = qkv[:, : 12 * 64].view(16, 12, 64)
    k, v = qk[:, 9:], qkv[:, 12 * 64 :].view(16, 3, 64)
    every_other_head = torch.randn(16, 6, 64, generator=g)[:, ::2]  # heads 128 floats apart
    assert not k.is_contiguous() and not v.is_contiguous()
    slots, rows = torch.randperm(40, generator=g)[:10], torch.randperm(16, generator=g)[:10]
    for src in (k, v, every_other_head):
        want = torch.zeros(40, 3, 64, dtype=dtype).index_copy_(0, slots, src[rows].to(dtype))
        got = torch.zeros(40, 3, 64, dtype=dtype)
        extension().put_rows(got, slots, src, rows)
        assert torch.equal(got, want)
        got.zero_()
        K.put_rows(got, slots, src, rows)
        assert torch.equal(got, want)

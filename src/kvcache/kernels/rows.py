"""Row operations of a decode step in one C++ call each (``csrc/rows.cpp``): RoPE of a few
rows, a fused projection split into normed and rotated heads, and K/V rows copied into their
cells.

Between two attention calls a decode step's Python runs with cold caches, where each small
torch op costs microseconds and a 4-bit cache's ``put`` was a chain of them (why and what it
bought: docs/design/kernels.md). Both functions give the bits torch's ops give and fall back
to those ops for what the kernels do not take (other dtypes or devices, autograd).
"""

from __future__ import annotations

import torch

from kvcache.kernels.build import cpu_float32, extension

_EMPTY = torch.empty(0, dtype=torch.int64)
_EMPTY_F = torch.empty(0)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
    """``Rope.rotate(x, cos, sin_signed)`` by the kernel for float32 CPU ``x`` [T, H, D] with
    contiguous heads and tables [T, 1, D]; None where the kernel does not serve it."""
    if x.dim() != 3 or x.numel() == 0 or not cpu_float32(x, cos, sin_signed):
        return None
    t, _, d = x.shape
    if (
        x.stride(2) != 1
        or x.stride(1) != d
        or cos.shape != (t, 1, d)
        or sin_signed.shape != (t, 1, d)
    ):
        return None
    return extension().rope_rows(x, cos.contiguous(), sin_signed.contiguous())


def split_heads(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    *,
    rotate_keys: bool = True,
    norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q [T, Hq, D], k and v [T, Hkv, D] of a fused projection ``qkv`` [T, (Hq + 2 Hkv) D]:
    q and k per-head RMS-normed by ``norms`` (q's, k's weight [D]) where given, then rotated
    by the tables of ``Rope.tables`` (k only with ``rotate_keys``), in one C++ call with the
    bits of ``rms_norm`` and :func:`rope`; None where the kernel does not serve it (the
    caller runs those ops)."""
    if qkv.dim() != 2 or qkv.stride(-1) != 1 or not cpu_float32(qkv, cos, sin_signed):
        return None
    t, d = qkv.shape[0], cos.shape[-1]
    if (
        cos.shape != sin_signed.shape
        or cos.numel() != t * d
        or (heads + 2 * kv_heads) * d != qkv.shape[1]
    ):
        return None
    qn, kn = (_EMPTY_F, _EMPTY_F) if norms is None else norms
    if norms is not None and not cpu_float32(qn, kn):
        return None
    q, k, v = extension().split_heads(
        qkv, heads, kv_heads, cos.contiguous(), sin_signed.contiguous(), rotate_keys,
        qn.contiguous(), kn.contiguous(), eps,
    )  # fmt: skip
    return q, k, v


def put_rows(
    dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """``dst.index_copy_(0, slots, src[rows].to(dst.dtype))`` (``rows`` None: ``src``'s first
    ``len(slots)`` rows): the kernel for float32 ``src`` [T, H, D] with contiguous channels
    (a model's k and v: slices of its fused projection) and a contiguous float32 or float16
    CPU ``dst`` [S, H, D], int64 indices."""
    n = slots.shape[0]
    if (
        dst.dtype in (torch.float32, torch.float16)
        and dst.device.type == "cpu"
        and cpu_float32(src)
        and dst.dim() == 3
        and src.dim() == 3
        and dst.is_contiguous()
        and src.stride(-1) == 1
        and slots.dtype == torch.int64
        and (rows is None or rows.dtype == torch.int64)
    ):
        extension().put_rows(
            dst, slots.contiguous(), src, _EMPTY if rows is None else rows.contiguous()
        )
        return
    picked = src[:n] if rows is None else src.index_select(0, rows)
    dst.index_copy_(0, slots, picked.to(dst.dtype))

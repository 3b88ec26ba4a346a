"""Linear layers over GGUF weights kept in their blocks (llama.cpp's quantized formats).

Layout: a weight [N, K] is one or more row ranges (parts), each ``uint8 [rows, K / values *
nbytes]``: every row is K / values blocks exactly as the file stores them (Q4_K_M files mix
types within one fused weight: attn_v in Q6_K beside attn_q in Q4_K).

Decode-sized inputs (at most ``MAX_ROWS`` rows) go to the C++ kernel of the ``weights`` unit
(``csrc/weights/qlinear.cpp``): the activations are quantized per block to int8 as ggml does
(q8_0: blocks of 32, q8_K: 256; scale amax / 127), once per format a call needs, and met by
each weight row's codes in int8 dot products, every weight row read once for all rows. A
row's output does not depend on the rows beside it. Larger inputs (prompts) dequantize the
weight a tile of rows at a time and use torch's GEMM, in bf16 where the CPU multiplies it
natively (``prefill_dtype``): no float copy of a whole weight outlives the call
(docs/design/weights.md).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from gguf import GGMLQuantizationType

from kvcache.errors import DimensionMismatchError, InvalidArgumentError
from kvcache.kernels.build import extension

MAX_ROWS = 32  # rows up to which the int8 kernel serves a call (kernels.linear's bound)
TILE = 4096  # weight rows dequantized at a time for prompt-sized inputs
_EMPTY = torch.empty(0)


@dataclass(frozen=True)
class BlockType:
    """One GGUF block format: ``values`` weights in ``nbytes`` bytes; the activations' int8
    format its dot product takes (ggml's q8_0 blocks of 32 or q8_K blocks of 256)."""

    name: str
    ggml: int
    values: int
    nbytes: int
    activations: str


BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        BlockType("Q4_0", int(GGMLQuantizationType.Q4_0), 32, 18, "q8_0"),
        BlockType("Q4_1", int(GGMLQuantizationType.Q4_1), 32, 20, "q8_0"),
        BlockType("Q5_0", int(GGMLQuantizationType.Q5_0), 32, 22, "q8_0"),
        BlockType("Q8_0", int(GGMLQuantizationType.Q8_0), 32, 34, "q8_0"),
        BlockType("Q4_K", int(GGMLQuantizationType.Q4_K), 256, 144, "q8_K"),
        BlockType("Q6_K", int(GGMLQuantizationType.Q6_K), 256, 210, "q8_K"),
    )
}


INTERLEAVED = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")  # types the kernels read faster interleaved by 8
_X8 = 256  # a kernel kind's offset for interleaved rows (csrc/weights/blocks.h)


@dataclass(frozen=True)
class WeightPart:
    """Rows of one block type: ``data`` uint8 [rows, K / kind.values * kind.nbytes]; with
    ``interleaved`` the same bytes with 8 rows' blocks interleaved (csrc/weights/interleaved.h:
    a 32-byte load holds four codes of each of 8 rows)."""

    kind: BlockType
    data: torch.Tensor
    interleaved: bool = False

    @property
    def kernel_kind(self) -> int:
        return self.kind.ggml + (_X8 if self.interleaved else 0)

    def gguf_bytes(self, begin: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``begin:end`` of ``data`` in the file's order (where interleaved, a copy of
        only the groups of 8 that hold them)."""
        stop = self.data.shape[0] if end is None else end
        if not self.interleaved:
            return self.data[begin:stop]
        lo, hi = begin // 8 * 8, -(-stop // 8) * 8
        return _deinterleave(self.kind, self.data[lo:hi])[begin - lo : stop - lo]


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] as stored: its parts' rows stacked in order."""

    parts: tuple[WeightPart, ...]
    in_features: int
    _kinds: list[int] = field(init=False, repr=False, compare=False)
    _data: list[torch.Tensor] = field(init=False, repr=False, compare=False)
    _rows: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check(self)
        # the kernel call's arguments, built once: a decode step makes ~120 calls
        object.__setattr__(self, "_kinds", [p.kernel_kind for p in self.parts])
        object.__setattr__(self, "_data", [p.data.contiguous() for p in self.parts])
        object.__setattr__(self, "_rows", sum(p.data.shape[0] for p in self.parts))

    @property
    def shape(self) -> tuple[int, int]:
        return (self._rows, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (gguf's values, bit for bit)."""
        return torch.cat([_dequantize(p, _EMPTY, self.in_features) for p in self.parts])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` dequantized to float32 [*ids.shape, K] (an embedding lookup): only the
        rows looked up are decoded."""
        flat = ids.reshape(-1).long()
        n = self.shape[0]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            bad = flat[(flat < 0) | (flat >= n)][0]
            raise InvalidArgumentError("ids", int(bad), f"row ids in [0, {n})")
        out = torch.empty(flat.numel(), self.in_features)
        begin = 0
        for p in self.parts:
            end = begin + p.data.shape[0]
            here = ((flat >= begin) & (flat < end)).nonzero().view(-1)
            if here.numel():
                out[here] = _dequantize(p, flat[here] - begin, self.in_features)
            begin = end
        return out.view(*ids.shape, self.in_features)


def check(weight: QuantizedWeight) -> None:
    """Raise a typed error unless every part is ``uint8 [rows, K / values * nbytes]``."""
    k = weight.in_features
    if not weight.parts:
        raise InvalidArgumentError("parts", weight.parts, "at least one WeightPart")
    for i, p in enumerate(weight.parts):
        if p.kind.name not in BLOCK_TYPES or BLOCK_TYPES[p.kind.name] != p.kind:
            raise InvalidArgumentError(f"parts[{i}].kind", p.kind, f"one of {list(BLOCK_TYPES)}")
        if k <= 0 or k % p.kind.values:
            raise InvalidArgumentError(
                "in_features", k, f"a positive multiple of {p.kind.name}'s {p.kind.values} values"
            )
        want = k // p.kind.values * p.kind.nbytes
        d = p.data
        if d.dtype != torch.uint8 or d.dim() != 2 or d.shape[1] != want or d.device.type != "cpu":
            raise InvalidArgumentError(
                f"parts[{i}].data",
                f"{d.dtype} {list(d.shape)} on {d.device}",
                f"uint8 [rows, {want}] on the CPU ({p.kind.name}, K = {k})",
            )
        if p.interleaved and (p.kind.name not in INTERLEAVED or d.shape[0] % 8):
            raise InvalidArgumentError(
                f"parts[{i}]",
                f"{p.kind.name} x {d.shape[0]} rows interleaved",
                f"rows of {' / '.join(INTERLEAVED)} in groups of 8",
            )


def interleave(weight: QuantizedWeight) -> QuantizedWeight:
    """The weight with every part the kernels read faster interleaved (``INTERLEAVED`` types,
    rows a multiple of 8) stored so; the same values (the decode-row kernels' layout)."""
    parts = tuple(
        WeightPart(p.kind, _interleave(p.kind, p.data), True)
        if p.kind.name in INTERLEAVED and not p.interleaved and p.data.shape[0] % 8 == 0
        else p
        for p in weight.parts
    )
    return QuantizedWeight(parts, weight.in_features)


def _split(kind: BlockType) -> list[tuple[int, int]]:
    """A block's byte fields as interleaved.h orders them: d, (m or qh), codes."""
    fields = {"Q4_1": [(0, 2), (2, 4), (4, 20)], "Q5_0": [(0, 2), (2, 6), (6, 22)]}
    return fields.get(kind.name, [(0, 2), (2, kind.nbytes)])


def _interleave(kind: BlockType, data: torch.Tensor) -> torch.Tensor:
    n, width = data.shape
    g, nb = n // 8, width // kind.nbytes
    x = data.view(g, 8, nb, kind.nbytes).transpose(1, 2)  # [G, nb, 8 rows, block bytes]
    fields = [x[..., a:b].reshape(g, nb, 8 * (b - a)) for a, b in _split(kind)[:-1]]
    a, b = _split(kind)[-1]
    runs = (b - a) // 4
    # codes [G, nb, 8 rows, runs, 4 B] -> [G, nb, runs, 8 rows, 4 B]
    codes = x[..., a:b].reshape(g, nb, 8, runs, 4).transpose(2, 3).reshape(g, nb, 32 * runs)
    return torch.cat([*fields, codes], dim=-1).reshape(n, width).contiguous()


def _deinterleave(kind: BlockType, data: torch.Tensor) -> torch.Tensor:
    n, width = data.shape
    g, nb = n // 8, width // kind.nbytes
    y = data.view(g, nb, 8 * kind.nbytes)
    fields = []
    for a, b in _split(kind)[:-1]:
        fields.append(y[..., 8 * a : 8 * b].reshape(g, nb, 8, b - a))
    a, b = _split(kind)[-1]
    runs = (b - a) // 4
    codes = y[..., 8 * a :].reshape(g, nb, runs, 8, 4).transpose(2, 3).reshape(g, nb, 8, b - a)
    x = torch.cat([*fields, codes], dim=-1)  # [G, nb, 8 rows, block bytes]
    return x.transpose(1, 2).reshape(n, width).contiguous()


def _dequantize(part: WeightPart, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``ids`` of a part (all where empty) as float32."""
    return extension("weights").dequantize_rows(part.kernel_kind, part.data.contiguous(), ids, k)


def _check_x(x: torch.Tensor, weight: QuantizedWeight, k: int) -> None:
    if x.shape[-1] != k:
        raise DimensionMismatchError(k, x.shape[-1], "x's last dim (the weight's K)")


def served(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether ``linear(x, weight)`` runs the int8 decode-row kernel (float32 CPU rows, at most
    MAX_ROWS of them, no autograd); anything else dequantizes into torch's GEMM."""
    return _fits(x, weight.in_features)


def _fits(x: torch.Tensor, width: int) -> bool:
    """Whether rows of ``width`` values in ``x`` are kernel-sized float32 CPU rows."""
    ok = x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] == width
    return ok and 0 < x.numel() // width <= MAX_ROWS and not _grad(x)


def _grad(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x @ W.T`` for x [..., K]."""
    _check_x(x, weight, weight.in_features)
    if served(x, weight):
        return _kernel(x, weight)
    rows = x.reshape(-1, weight.in_features)
    return _prefill(rows, weight, None).view(*x.shape[:-1], weight.shape[0])


def _kernel(
    x: torch.Tensor,
    weight: QuantizedWeight,
    *,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    glu: bool = False,
) -> torch.Tensor:
    """The C++ kernel on inputs ``served`` accepts (with ``glu``, x holds 2K per row)."""
    r = _EMPTY if residual is None else residual.contiguous()
    w, eps = (_EMPTY, 0.0) if norm is None else (norm[0].contiguous(), float(norm[1]))
    flat = x.dim() == 2
    rows = (x if flat else x.reshape(-1, x.shape[-1])).contiguous()
    y = _ext().qlinear_rows(rows, weight._kinds, weight._data, r, w, eps, glu)
    return y if flat else y.view(*x.shape[:-1], weight._rows)


@functools.cache
def _ext() -> Any:
    return extension("weights")


PREFILL_ENV = "KVCACHE_PREFILL_GEMM"  # "fp32" or "bf16": overrides prefill_dtype's choice


def prefill_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMM dtype of a prompt-sized ``x``: bfloat16 for float32 rows on a CPU with native
    bf16 dot products (AVX512-BF16 or AMX: several times float32's rate at a KL below
    llama.cpp's, docs/design/weights.md), else x's own dtype (emulated bf16 is slower)."""
    choice = os.environ.get(PREFILL_ENV, "")
    if choice not in ("", "fp32", "bf16"):
        raise InvalidArgumentError(PREFILL_ENV, choice, '"fp32", "bf16" or unset')
    if x.dtype != torch.float32 or choice == "fp32":
        return x.dtype
    return torch.bfloat16 if choice == "bf16" or _native_bf16() else x.dtype


@functools.cache
def _native_bf16() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _prefill(
    x: torch.Tensor, weight: QuantizedWeight, residual: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T (+ residual)`` for x [T, K] through tiles of W (TILE rows at a time) dequantized
    to ``prefill_dtype(x)``; the output (and the sum with ``residual``) in x's dtype."""
    n, k = weight.shape
    out = torch.empty(x.shape[0], n, dtype=x.dtype) if residual is None else residual.clone()
    if x.shape[0] == 0:  # a prompt chunk that asks for no logits: nothing to dequantize
        return out
    gemm = prefill_dtype(x)
    xg = x.to(gemm)
    begin = 0
    for p in weight.parts:
        rows = p.data.shape[0]
        for t in range(0, rows, TILE):
            ids = torch.arange(t, min(t + TILE, rows))
            w = _dequantize(p, ids, k).to(gemm)
            cols = out[:, begin + t : begin + t + len(ids)]
            if residual is not None:
                cols.add_(xg @ w.t())
            elif cols.is_contiguous() and gemm == x.dtype:
                torch.mm(xg, w.t(), out=cols)
            else:
                cols.copy_(xg @ w.t())
        begin += rows
    return out


def add_linear(
    residual: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, *, glu: bool = False
) -> torch.Tensor:
    """``residual + x @ W.T`` for ``residual`` [T, N], ``x`` [T, K] (with ``glu``, [T, 2K]:
    the product is of SwiGLU's ``silu(gate) * up``), one kernel call for decode-sized rows."""
    k = weight.in_features
    width = 2 * k if glu else k
    if x.shape[-1] != width:
        what = "x's last dim (2 K with glu: gate and up)" if glu else "x's last dim (the K)"
        raise DimensionMismatchError(width, x.shape[-1], what)
    if residual.shape != (x.shape[0], weight._rows):
        raise DimensionMismatchError(
            (x.shape[0], weight._rows), tuple(residual.shape), "residual shape"
        )
    if _fits(x, width) and _fits(residual, weight._rows):
        return _kernel(x, weight, residual=residual, glu=glu)
    from kvcache.kernels.linear import swiglu

    return _prefill(swiglu(x) if glu else x, weight, residual)


def norm_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: QuantizedWeight
) -> torch.Tensor:
    """``linear(rms_norm(x, norm_weight, eps), W)``: one kernel call for decode-sized rows,
    the bits of the two calls."""
    k = weight.in_features
    _check_x(x, weight, k)
    if _fits(x, k) and norm_weight.shape == (k,) and _fits(norm_weight, k):
        return _kernel(x, weight, norm=(norm_weight, eps))
    from kvcache.kernels.linear import rms_norm

    return linear(rms_norm(x, norm_weight, eps), weight)

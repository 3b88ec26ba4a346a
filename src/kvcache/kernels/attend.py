"""Attention of a forward's rows over their own sequences' cells, straight from the codes.

``attend`` runs an :class:`~kvcache.kernels.plan.AttentionPlan` for one layer: the C++
kernel computes partial softmax sums of the decode-sized segments from the stored codes
(dequantizing tile by tile, RoPE of keys stored before it applied from cos/sin tables); the
prompt-sized segments go through torch's fused CPU flash kernel over decoded tiles of at
most ``TILE_CELLS`` cells, whose log-sum-exp makes their partial sums; a last pass merges
every row's partial sums. Turbo values are summed in their rotated domain and rotated back
once per output row, in the merge. With 4-bit affine keys (int4) and int8 keys every row
scores with its query rounded to int16 steps (``int16_steps``): the kernel meets the key
codes in int16 products (csrc/tiles.h), and the prompt tiles use the same rounded query, so
that a row's attention is one softmax whichever path computed its parts. Turbo keys of 2-5
bits after RoPE do the same in the codes' rotated domain (``turbo_steps``): their codebook
levels lie on int16 steps (codecs/codebook.py) and the kernel looks them up as int16
(csrc/codecs/turbo.cpp, qk_turbo16_rows).

    q [T, Hq, D] (query head hq reads KV head hq // G)  ->  out [T, Hq, D] float32
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvcache.codecs.base import AFFINE_ROWS, INT8, TURBO, Layout
from kvcache.codecs.rotation import butterflies
from kvcache.kernels.build import extension
from kvcache.kernels.contract import layout_args
from kvcache.kernels.plan import AttentionPlan, Tile

TILE_CELLS = 2048  # cells decoded at a time by the tile path
_NEG_INF = float("-inf")
_EMPTY = torch.empty(0)


@functools.cache
def vector_kernels() -> bool:
    """Whether the kernels were built with their vector paths (AVX2 or AVX-512), the only
    ones that meet int8 and 4-bit affine keys in int16 products: plain loops (a CPU without
    AVX2, or not x86) score those keys decoded, with the query as given (turbo keys of 2-5
    bits meet a query in int16 steps on every path: csrc/codecs/turbo.cpp, turbo_query16)."""
    return extension().isa() != "none"


def int16_keys(kind: int, bits: int) -> bool:
    """Whether keys of this codec kind are scored against queries in int16 steps (4-bit
    affine codes and int8 codes: csrc/tiles.h, qk4_rows and qk8_rows)."""
    return (kind == INT8 or (kind == AFFINE_ROWS and bits == 4)) and vector_kernels()


def int16_steps(q: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` [T, Hq, D] float32 rounded so that each row of ``q * scale`` lies on steps of its
    max |q * scale| / 32767 (a channel moves by at most 1/65534 of the row's largest)."""
    qs = q * scale
    step = qs.abs().amax(dim=-1, keepdim=True) / 32767
    step = torch.where(step > 0, step, torch.ones_like(step))
    return torch.round(qs / step) * step / scale


def turbo16_keys(keys: Layout, pre_rope: bool, dim: int) -> bool:
    """Whether turbo keys are scored in int16 steps of the rotated query (``turbo_steps``;
    csrc/codecs/turbo.cpp, turbo_keys16): 2 to 5 bits after RoPE, head_dim a multiple of 64, no
    padding of the rotated rows."""
    return (
        keys.kind == TURBO
        and 2 <= keys.bits <= 5
        and not pre_rope
        and not keys.rotated
        and dim % 64 == 0
        and keys.data.shape[-1] * keys.data.element_size() * 8 == dim * keys.bits
    )


def turbo_steps(q: torch.Tensor, scale: float, signs: torch.Tensor) -> torch.Tensor:
    """``q`` [T, Hq, D] float32 as turbo keys score it: each row of ``q * scale`` rotated into
    its KV head's codes' domain (``signs`` [Hkv, D]: y = fwht(x * signs / sqrt(D))), rounded
    there to ``int16_steps`` and rotated back, in the kernel's float32 operations and order
    (csrc/codecs/turbo.cpp, turbo_query16: the same bits). The torch reference of
    :func:`turbo_steps_kernel`."""
    t, hq, d = q.shape
    hkv = signs.shape[0]
    norm = torch.tensor(1.0) / torch.sqrt(torch.tensor(float(d)))  # float32, as the kernel's
    x = q.reshape(t, hkv, hq // hkv, d) * scale
    y = butterflies(x * signs[:, None, :] * norm)
    step = y.abs().amax(dim=-1, keepdim=True) / 32767
    step = torch.where(step > 0, step, torch.ones_like(step))
    y = torch.round(y / step) * step
    return (butterflies(y) * (norm * signs[:, None, :])).reshape(t, hq, d) / scale


def turbo_steps_kernel(q: torch.Tensor, scale: float, signs: torch.Tensor) -> torch.Tensor:
    """:func:`turbo_steps` by the kernel's own rounding (``turbo_steps16``, one call per KV
    head): the same bits, faster for a prompt's rows (the torch butterflies are six
    passes of small ops over the whole prompt)."""
    t, hq, d = q.shape
    hkv = signs.shape[0]
    x = q.reshape(t, hkv, hq // hkv, d) * scale
    out = torch.empty_like(x)
    ext = extension()
    for h in range(hkv):
        rounded = ext.turbo_steps16(x[:, h].reshape(-1, d), signs[h])[0]
        out[:, h] = rounded.view(t, hq // hkv, d)
    return out.reshape(t, hq, d) / scale


def tile_paths(
    cells: torch.Tensor, keys: Layout, values: Layout, *, kv_heads: int, dim: int, pre_rope: bool
) -> tuple[str, str]:
    """The key path and the value path (csrc/paths.h) that read a tile of ``cells`` (int32,
    at most 64, their rows all in the fp16 window or all in the codes) of these layouts."""
    ext = extension()
    k_args, v_args = layout_args(keys, pre_rope), layout_args(values, False)
    key, value = ext.tile_paths(cells.to(torch.int32), *k_args, *v_args, kv_heads, dim)
    return key, value


def attend(
    q: torch.Tensor,
    plan: AttentionPlan,
    keys: Layout,
    values: Layout,
    *,
    kv_heads: int,
    scale: float,
    pre_rope: bool,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Attention output [T, Hq, D] float32 of queries ``q`` [T, Hq, D] (see module doc);
    ``rope``: cos, sin float32 [P, D/2] for positions < P (keys stored before RoPE)."""
    ext = extension()
    q32 = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()
    if int16_keys(keys.kind, keys.bits) and plan.tiles:
        # the prompt tiles score with the kernel's rounded query (a decode-only call leaves
        # the rounding to the kernel: the same steps, without ~10 torch ops a layer)
        q32 = int16_steps(q32, scale)
    elif plan.tiles and turbo16_keys(keys, pre_rope, q32.shape[-1]):
        q32 = turbo_steps_kernel(q32, scale, keys.signs)
    k_args = layout_args(keys, pre_rope)
    v_args = layout_args(values, False)
    cos, sin = rope if rope is not None else (_EMPTY, _EMPTY)
    common = (q32, plan.cells, plan.pos, plan.segs, plan.entries, *k_args, *v_args, kv_heads)
    # turbo values are summed in their rotated domain, sum_j w_j R^T c_j = R^T sum_j w_j c_j,
    # and rotated back by the merge, per KV head
    back = values.rotation if values.rotated else _EMPTY  # [Hkv, D, P]: x = y @ rotation[h].T
    if not plan.tiles:  # decode steps: one call computes and merges
        return ext.attend(*common, cos, sin, scale, plan.row_ptr, plan.row_entries, back)
    pm, pl, pacc, paccr = ext.partials(*common, cos, sin, scale)
    for tile in plan.tiles:
        m, acc = _tile(ext, q32, plan, tile, k_args, v_args, kv_heads, scale, cos, sin)
        pm[tile.entries], pl[tile.entries], pacc[tile.entries] = m, 1.0, acc
        if values.rotated:
            paccr[tile.entries] = 0.0  # the tile path sums plain rows
    return ext.merge(pm, pl, pacc, paccr, plan.row_ptr, plan.row_entries, back)


def _tile(
    ext: object,
    q: torch.Tensor,
    plan: AttentionPlan,
    tile: Tile,
    k_args: tuple[list[torch.Tensor], list[int]],
    v_args: tuple[list[torch.Tensor], list[int]],
    kv_heads: int,
    scale: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial sums (m [e, Hq], acc [e, Hq, D] with l = 1) of a prompt-sized segment: a prompt
    chunk over its causal history runs unmasked over the cells every row sees and causal
    over its own (the fused kernel skips the blocks above the diagonal: half the work);
    any other segment (windows, chunks, forks) with its mask."""
    ent = plan.entries[torch.from_numpy(tile.entries)]  # [e, 3]: row, lo, hi
    rows = ent[:, 0]
    e = len(rows)
    _, hq, d = q.shape
    run = _Run(e, hq, d)

    def gather(at: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cells = torch.from_numpy(tile.cells[at]).to(torch.int32)
        pos = torch.from_numpy(tile.pos[at]).to(torch.int32)
        k = ext.gather(cells, pos, *k_args, kv_heads, d, cos, sin)  # type: ignore[attr-defined]
        v = ext.gather(cells, pos, *v_args, kv_heads, d, cos, sin)  # type: ignore[attr-defined]
        return k, v, pos.to(torch.int64)

    seen = _causal_split(tile, ent)
    if seen is not None:
        qh = q[rows].transpose(0, 1)[None]  # [1, Hq, e, D]
        for start in range(0, seen, TILE_CELLS):
            k, v, _ = gather(slice(start, min(start + TILE_CELLS, seen)))
            run.add(*_flash_heads(qh, k, v, hq, scale, causal=False))
        k, v, _ = gather(slice(seen, None))
        run.add(*_flash_heads(qh, k, v, hq, scale, causal=True))
        return run.m, run.acc
    lo, hi = ent[:, 1], ent[:, 2]
    g = hq // kv_heads
    # qt: [1, Hkv, e*G, D], row (entry i, group head j) at i*G + j
    qt = q[rows].view(e, kv_heads, g, d).transpose(0, 1).reshape(1, kv_heads, e * g, d)
    for start in range(0, len(tile.cells), TILE_CELLS):
        k, v, p = gather(slice(start, start + TILE_CELLS))
        visible = (p[None, :] >= lo[:, None]) & (p[None, :] <= hi[:, None])  # [e, n]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, _NEG_INF)
        mask = mask.repeat_interleave(g, dim=0)  # [e*G, n]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, False,
            attn_mask=mask, scale=scale,
        )  # fmt: skip
        # out [1, Hkv, e*G, D] -> [e, Hq, D]; lse likewise; rows that saw nothing: -inf
        out = out[0].view(kv_heads, e, g, d).transpose(0, 1).reshape(e, hq, d)
        lse = lse[0].view(kv_heads, e, g).transpose(0, 1).reshape(e, hq)
        run.add(out, lse.masked_fill(~visible.any(dim=1)[:, None], _NEG_INF))
    return run.m, run.acc


def _causal_split(tile: Tile, ent: torch.Tensor) -> int | None:
    """Where a prompt chunk's own cells begin in ``tile`` when its rows are consecutive
    positions h0, h0+1, ..., its cells every position from the first up to the last row's,
    and every row sees the first (a causal history): cells before that index are visible to
    every row, the rest to row i up to its own (top-left causal). None for anything else."""
    pos, lo, hi = tile.pos, ent[:, 1].numpy(), ent[:, 2].numpy()
    e, n = len(hi), len(pos)
    if n < e or lo.max() > pos[0] or pos[-1] - pos[0] != n - 1:
        return None
    h0 = int(hi[0])
    if not np.array_equal(hi, np.arange(h0, h0 + e)) or pos[-1] != hi[-1]:
        return None
    if not np.array_equal(pos, np.arange(pos[0], pos[0] + n)):
        return None
    return n - e


def _flash_heads(
    qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hq: int, scale: float, *, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused kernel of queries ``qh`` [1, Hq, e, D] over ``k``, ``v`` [n, Hkv, D]
    (each KV head repeated for its query heads): out [e, Hq, D], lse [e, Hq]."""
    g = hq // k.shape[1]
    kh = k.transpose(0, 1).repeat_interleave(g, dim=0)[None]  # [1, Hq, n, D]
    vh = v.transpose(0, 1).repeat_interleave(g, dim=0)[None]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, kh, vh, 0.0, causal, scale=scale
    )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


class _Run:
    """A running softmax merge of partial attention results (out, lse) of the same rows."""

    def __init__(self, e: int, hq: int, d: int) -> None:
        self.m = torch.full((e, hq), _NEG_INF)
        self.acc = torch.zeros((e, hq, d))

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        m_new = torch.maximum(self.m, lse)
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        w_old, w_new = torch.exp(self.m - safe), torch.exp(lse - safe)
        total = w_old + w_new
        denom = torch.where(total > 0, total, torch.ones_like(total))
        self.acc = (self.acc * w_old[..., None] + out * w_new[..., None]) / denom[..., None]
        self.m = torch.where(total > 0, safe + torch.log(denom), m_new)

"""Error bounds of the cache's codecs, derived from each codec's documented step.

All inputs are float64 rows ``x [n, H, D]`` in the form the codec stores (for a key codec
that stores keys before RoPE: un-rotated); each function returns the largest error
``|decoded - x|`` it allows per element, ``[n, H, D]``.

* fp16 (a window row): round to nearest, relative error <= 2^-11.
* int8 (``codecs/ints.py``): symmetric codes per (row, head), step = absmax / 127 stored in
  fp16: half the stored step (a code clamped at 127 by a step rounded down is off by less).
* affine b-bit codes over a range [lo, hi] (int4 rows over 32 channels, KIVI values over 64,
  KIVI keys per channel over a group of rows): step = (hi - lo) / levels, with lo and the step
  stored in fp16: half a step, plus the fp16 rounding of lo and of the step times the top code
  (<= (|lo| + |hi|) 2^-11). The fp16 rounding every windowed row goes through before it is
  encoded (``codecs/window.py``) is the caller's to add: it is relative to the row, not to the
  centred values the codes cover.
"""

from __future__ import annotations

import torch

FP16 = 2.0**-11  # fp16 unit roundoff (half an ulp, relative)
TINY = 1e-6  # float32 arithmetic of encode/decode, and fp16 subnormals


def fp16_error(x: torch.Tensor) -> torch.Tensor:
    """A row kept in fp16."""
    return x.abs() * FP16 + TINY


def int8_error(x: torch.Tensor) -> torch.Tensor:
    """int8: one scale per (row, head)."""
    absmax = x.abs().amax(dim=-1, keepdim=True)  # [n, H, 1]
    return (absmax * (0.5 / 127) * (1 + 2 * FP16) + TINY).expand_as(x)


def half_step(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """Half the step of affine codes over [lo, hi] (+1 %: float32 arithmetic of the step)."""
    return 0.5 * (hi - lo) / levels * 1.01


def group_step(x: torch.Tensor, group: int, levels: int) -> torch.Tensor:
    """Half the step of affine codes of ``x`` per group of ``group`` channels: [n, H, D]."""
    xg = x.reshape(*x.shape[:-1], -1, group)
    step = half_step(xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True), levels)
    return step.expand_as(xg).reshape(x.shape)


def affine_error(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """Affine codes of ``x`` over [lo, hi] (broadcastable to x), ``levels`` = 2^bits - 1."""
    fp16_meta = (lo.abs() + hi.abs()) * FP16 * 2  # lo, step stored in fp16 (an ulp each way)
    return (half_step(lo, hi, levels) + fp16_meta + TINY).expand_as(x)


def grouped_error(x: torch.Tensor, group: int, levels: int) -> torch.Tensor:
    """Affine codes per row over groups of ``group`` consecutive channels (int4, KIVI values)."""
    n, h, d = x.shape
    group = min(group, d)  # a head narrower than a group is one group
    xg = x.reshape(n, h, d // group, group)
    lo, hi = xg.amin(dim=-1, keepdim=True), xg.amax(dim=-1, keepdim=True)
    return affine_error(xg, lo, hi, levels).reshape(n, h, d)


def rotated_error(bound: torch.Tensor) -> torch.Tensor:
    """A bound on stored (un-rotated) rows, carried through a rotate-half RoPE: channel i of
    the rotated error mixes channels i and i + D/2 (|cos|, |sin| <= 1)."""
    half = bound.shape[-1] // 2
    return bound + bound.roll(half, dims=-1)

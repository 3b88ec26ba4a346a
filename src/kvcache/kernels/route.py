"""Which path serves a layer's attention: the C++ kernels over the stored codes, or the
plain-torch reference over decoded rows. The one place that decides, with its reasons.

A forward is asked once (``forward_reason``: the environment and the cache's own settings,
kept out of the per-layer call because an environment lookup is slow), each layer's call then
only for its shapes and layouts (``layer_reason``). Inside the kernels, which tile path reads a
tile (int8 codes, 4-bit codes, fp16 rows, decoded rows...) is the table in csrc/paths.h.
"""

from __future__ import annotations

import os

import torch

from kvcache.codecs.base import Layout
from kvcache.kernels.contract import ALIGN, MAX_DIM, Kind

# "reference": attend through get()'s history range and mask in plain torch (debugging)
ATTENTION_ENV = "KVCACHE_ATTENTION"


def forward_reason(device: torch.device, dtype: torch.dtype, rotary: bool) -> str | None:
    """Why no layer of a forward may take the kernels; None when they may. ``rotary``: the
    cache stores keys after RoPE, or has the rotary tables to rotate keys stored before it."""
    if os.environ.get(ATTENTION_ENV, "") == "reference":
        return f"{ATTENTION_ENV}=reference"
    if device.type != "cpu":
        return f"the cache is on {device.type}: the kernels are CPU code"
    if dtype == torch.float64:
        return "a float64 cache: the reference attends in float64"
    if not rotary:
        return "keys stored before RoPE with a shift that is no RotaryShift: no tables to rotate by"
    return None


def layer_reason(q: torch.Tensor, v: torch.Tensor, keys: Layout, values: Layout) -> str | None:
    """Why this layer's queries ``q`` [T, Hq, D] and values ``v`` [T, H, Dv] over buffers of
    these layouts take the reference; None when the kernels take them."""
    d = int(q.shape[2])
    if q.dtype == torch.float64:
        return "float64 queries: the reference attends in float64"
    if int(v.shape[2]) != d:
        return f"value head_dim {int(v.shape[2])} differs from the key's {d}"
    if d % ALIGN or d > MAX_DIM:
        return f"head_dim {d}: the kernels take multiples of {ALIGN} up to {MAX_DIM}"
    if (keys.kind == Kind.TURBO or values.kind == Kind.TURBO) and d & (d - 1):
        return f"turbo codes of head_dim {d}: the kernels' transform takes powers of two"
    if values.rotated and values.rotation.numel() == 0:
        return "rotated values without their rotation matrix"
    return None

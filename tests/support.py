"""Test helpers (imported by the test modules): masks rendered as strings so a reader sees who attends to what."""

from __future__ import annotations

import torch

from kvcache.codecs.ints import AffineRowsCodec, Int8Codec
from kvcache.codecs.turbo_codec import TurboCodec
from kvcache.kernels.attend import int16_steps, turbo16_keys, turbo_steps, vector_kernels


def render(mask: torch.Tensor) -> list[str]:
    """Mask [T, L] as one string per row: '0' = may attend, 'x' = masked (Ollama's 0/-inf)."""
    return [" ".join("0" if m else "x" for m in row.tolist()) for row in mask]


def kv(keys: list[float], heads: int = 1, dim: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values [T, heads, dim] whose first component is the given number (values = -key)."""
    k = torch.zeros(len(keys), heads, dim, dtype=torch.float64)
    k[:, :, 0] = torch.tensor(keys, dtype=torch.float64)[:, None]
    return k, -k


def add_shift(layer: int, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Ollama's test shift: key + offset (shows which keys moved and by how much)."""
    return keys + offsets.to(keys.dtype)[:, None, None]


def stored_keys(cache, layer: int) -> torch.Tensor:
    """Every cell's stored key of a layer, decoded: [N, H, D]."""
    return cache.storage.read(layer, slice(0, cache.num_cells))[0]


def scoring_query(cache, q: torch.Tensor, scale: float) -> torch.Tensor:
    """The query ``cache.attention`` scores with: with 4-bit affine keys (int4) and int8 keys
    the vector kernels meet the codes in int16 products, every row rounded to int16 steps
    (``int16_steps``); with 2-5 bit turbo keys after RoPE every row is rounded so in the
    codes' rotated domain (``turbo_steps``); the query as given otherwise (and for int8 and
    int4 keys by a build of plain loops: ``vector_kernels``)."""
    codec = cache.key_codec
    if isinstance(codec, Int8Codec) or (isinstance(codec, AffineRowsCodec) and codec.bits == 4):
        return int16_steps(q.float(), scale) if vector_kernels() else q
    if isinstance(codec, TurboCodec):
        keys, _ = cache.storage.layouts(0)
        if turbo16_keys(keys, cache.key_rope == "pre", q.shape[-1]):
            return turbo_steps(q.float(), scale, keys.signs)
    return q

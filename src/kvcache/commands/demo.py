"""`kvcache demo`: the cell cache at work on random K/V, no model weights needed.

Two sequences share a prompt prefix through ``copy_prefix``, decode side by side in one
pool, and one of them drops a middle range with RoPE re-rotation of its later keys.
"""

from __future__ import annotations

import argparse

import torch


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", type=int, default=6, help="shared prompt tokens (default 6)")
    parser.add_argument("--steps", type=int, default=3, help="decode steps per sequence")


def _rope_shift(layer: int, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    d = keys.shape[-1] // 2
    inv = 10000.0 ** (-torch.arange(d, dtype=torch.float64) / d)
    ang = offsets.to(torch.float64)[:, None] * inv[None, :]  # [n, d]
    cos, sin = ang.cos()[:, None, :].to(keys.dtype), ang.sin()[:, None, :].to(keys.dtype)
    x1, x2 = keys[..., :d], keys[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def run(args: argparse.Namespace) -> int:
    from kvcache import Batch, CausalCache

    layers, heads, dim = 4, 2, 8
    cache = CausalCache(64, max_sequences=2, shift=_rope_shift)

    def forward(batch: Batch) -> torch.Tensor:
        cache.start_forward(batch)
        mask = torch.empty(0)
        for layer in range(layers):
            k = torch.randn(len(batch), heads, dim)  # k: [T, H, D]
            _, _, mask = cache.update(layer, k, torch.randn_like(k))
        return mask

    def show(title: str, mask: torch.Tensor) -> None:
        print(f"\n{title}  (rows = batch tokens, columns = cells; 0 = attends, x = masked)")
        for row in mask.tolist():
            print("   " + " ".join("0" if m else "x" for m in row))

    show(f"prefill seq 0, {args.prefix} tokens", forward(Batch.single(0, 0, args.prefix)))
    cache.copy_prefix(0, 1, args.prefix)
    print(f"\ncopy_prefix(0 -> 1): seq 1 shares {len(cache.positions(1))} cells, no copy")
    for i in range(args.steps):
        p = args.prefix + i
        show(f"decode step {i}: seq 0 and seq 1 at position {p}", forward(Batch([p, p], [0, 1])))
    cache.remove(1, 0)
    print(f"\nseq 1 finished: remove(1, 0) frees its own cells; used {cache.used_cells()}")
    cache.remove(0, 1, 3)
    print(f"\nremove(seq 0, 1, 3): seq 0 positions now {cache.positions(0)} (keys re-rotated)")
    print(
        f"cells used {cache.used_cells()}/{cache.num_cells}, "
        f"cache memory {cache.memory_usage_bytes()} bytes"
    )
    return 0

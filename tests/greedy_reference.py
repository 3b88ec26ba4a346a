"""Uncached references for generation tests: every token from a full no-cache forward.

``greedy`` is what any cached decoding must produce; ``greedy_with_shift`` applies the
context-shift policy (keep the first ``keep`` tokens, drop half of the rest when the next
token would not fit) to a plain token list, derived from llama.cpp's documented behaviour,
not from the engine's code.
"""

from __future__ import annotations

import torch

from kvcache.models.llama import Llama


def random_prompt(n: int, seed: int, vocab: int = 97) -> list[int]:
    """``n`` random token ids below ``vocab``, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def greedy(model: Llama, ids: list[int], n: int, window: int | None = None) -> list[int]:
    """n greedy tokens, each from a full no-cache forward over everything so far."""
    out = list(ids)
    for _ in range(n):
        out.append(int(model.forward_full(out, window=window)[-1].argmax()))
    return out[len(ids) :]


def greedy_with_shift(model: Llama, ids: list[int], n: int, capacity: int, keep: int) -> list[int]:
    """n greedy tokens under a context of ``capacity`` positions that shifts when full."""
    held, out = list(ids), []
    for _ in range(n):
        nxt = int(model.forward_full(held)[-1].argmax())
        out.append(nxt)
        if len(held) + 1 > capacity:  # feeding nxt would overflow: shift first
            discard = (len(held) - keep) // 2
            del held[keep : keep + discard]
        held.append(nxt)
    return out

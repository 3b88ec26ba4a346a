"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling.

Filters apply in llama.cpp's order: top-k, then temperature, then top-p (nucleus) on the
tempered distribution. Each sequence draws from its own ``torch.Generator``, so a seed makes
one sequence reproducible whatever else shares its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcache.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: ``temperature == 0`` is greedy (argmax); 0 top_k / 1.0 top_p = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and 0.0 <= self.temperature < math.inf):
            raise InvalidArgumentError("temperature", self.temperature, "a float >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError("top_k", self.top_k, "an int >= 0 (0 = off)")
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise InvalidArgumentError("top_p", self.top_p, "a float in (0, 1] (1 = off)")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise InvalidArgumentError("seed", self.seed, "an int or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, offset: int = 0) -> torch.Generator:
        """A fresh RNG: ``seed + offset`` (parallel samples differ), or entropy when unseeded."""
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed + offset)
        return g


def sample(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator | None = None) -> int:
    """One token id from ``logits: [V]``."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float()
    if params.top_k == 0 and params.top_p == 1.0:  # plain temperature: no sort needed
        probs = torch.softmax(scores / params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=rng))
    if 0 < params.top_k < scores.shape[-1]:
        top = torch.topk(scores, params.top_k)
        scores, index = top.values, top.indices  # scores: [k], sorted descending
    else:
        scores, index = torch.sort(scores, descending=True)  # scores: [V]
    probs = torch.softmax(scores / params.temperature, dim=-1)
    if params.top_p < 1.0:
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
        probs = probs.masked_fill(before >= params.top_p, 0.0)  # the best token always stays
    choice = torch.multinomial(probs, 1, generator=rng)
    return int(index[choice])

"""StreamingLLM (Xiao et al., 2024): the first ``sinks`` tokens (attention sinks) and the
most recent ones. As kvpress's ``StreamingLLMPress``: of n cells, the n - kept right after
the sinks score 0, every other cell 1."""

from __future__ import annotations

import torch

from kvcache.press.base import Press, Scoring

SINKS = 4


class StreamingLLM(Press):
    """Keeps the ``sinks`` first cells and the newest ones."""

    name = "streaming"

    def __init__(self, ratio: float, compact: bool = False, sinks: int = SINKS) -> None:
        super().__init__(ratio, compact)
        self.sinks = sinks

    def scores(self, ctx: Scoring) -> torch.Tensor:
        n = len(ctx.cells)
        s = torch.ones(n)
        s[self.sinks : self.sinks + n - ctx.keep] = 0
        return s[None, None, :]  # [1, 1, n]: the same for every layer and head

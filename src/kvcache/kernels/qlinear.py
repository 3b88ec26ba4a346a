"""Linear layers over GGUF weights kept in their blocks (llama.cpp's quantized formats).

Layout: a weight [N, K] is one or more row ranges (parts), each ``uint8 [rows, K / values *
nbytes]``: every row is K / values blocks exactly as the file stores them (Q4_K_M files mix
types within one fused weight: attn_v in Q6_K beside attn_q in Q4_K).

CONTRACT STUB: this reference implementation dequantizes through ``gguf.quants`` on every call
(correct, slow); the C++ kernels of the ``weights`` unit replace its bodies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize


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


@dataclass(frozen=True)
class WeightPart:
    """Rows of one block type: ``data`` uint8 [rows, K / kind.values * kind.nbytes]."""

    kind: BlockType
    data: torch.Tensor


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] as stored: its parts' rows stacked in order."""

    parts: tuple[WeightPart, ...]
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.data.shape[0] for p in self.parts), self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (gguf's values)."""
        return torch.cat([_dequantize(p) for p in self.parts])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` dequantized to float32 [len(ids), K] (an embedding lookup)."""
        return self.dequantize()[ids]


def _dequantize(part: WeightPart) -> torch.Tensor:
    values = dequantize(part.data.numpy(), GGMLQuantizationType(part.kind.ggml))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x @ W.T`` for x [..., K]."""
    return F.linear(x, weight.dequantize())

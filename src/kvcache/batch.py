"""The tokens of one forward pass: their positions, their sequences, their encoder inputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvcache.errors import InvalidArgumentError


def _ints(name: str, values: Sequence[int], minimum: int | None = None) -> tuple[int, ...]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise InvalidArgumentError(f"{name}[{i}]", v, "an int")
        if minimum is not None and v < minimum:
            raise InvalidArgumentError(f"{name}[{i}]", v, f"an int >= {minimum}")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True)
class Batch:
    """One forward's tokens: token i has ``positions[i]`` in sequence ``sequences[i]``.

    ``encoder_inputs`` are indices of batch tokens that carry encoder (audio/image) inputs;
    an :class:`~kvcache.EncoderCache` stores K/V only in forwards that have some.
    """

    positions: Sequence[int]
    sequences: Sequence[int]
    encoder_inputs: Sequence[int] = field(default=())

    def __post_init__(self) -> None:
        pos = _ints("positions", self.positions, minimum=0)
        seqs = _ints("sequences", self.sequences, minimum=0)
        if len(pos) != len(seqs):
            raise InvalidArgumentError(
                "sequences", f"<{len(seqs)} items>", f"{len(pos)} items, one per position"
            )
        if not pos:
            raise InvalidArgumentError("positions", self.positions, "at least one token")
        enc = _ints("encoder_inputs", self.encoder_inputs, minimum=0)
        for i, e in enumerate(enc):
            if e >= len(pos):
                raise InvalidArgumentError(f"encoder_inputs[{i}]", e, f"a batch index < {len(pos)}")
        object.__setattr__(self, "positions", pos)
        object.__setattr__(self, "sequences", seqs)
        object.__setattr__(self, "encoder_inputs", enc)

    def __len__(self) -> int:
        return len(self.positions)

    @classmethod
    def single(cls, seq: int, start: int, length: int) -> Batch:
        """Positions start..start+length-1 of one sequence (a prefill or one decode step)."""
        return cls(tuple(range(start, start + length)), (seq,) * length)

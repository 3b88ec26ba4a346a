"""Key-mean snapshots at fixed token counts: how the per-head compressed cache centres keys.

Centring is a function of the token index, never of how tokens were pushed::

    token          0           1 .. 2      3 .. 6      7 .. 14     ...   2^j - 1 .. 2^(j+1) - 2
    centred by     mean[0,1)   mean[0,2)   mean[0,4)   mean[0,8)   ...   mean[0, 2^j)

Snapshot j (bf16 [D]) is the mean of the first ``2^j`` keys, taken when the last of them
arrives (J = log2 T + 1); that key and the later ones up to the next snapshot subtract it where
that shrinks the key (the quantizer's per-key flag). Key 0 is centred by itself: the first
snapshot holds it in bf16 (in real models the attention sink, which takes much of the
attention). The running sum is exact: keys are rounded to multiples of 2^-20, clamped to
+-2^20 and summed as int64 (``total [D]``) until the last snapshot at 2^22 keys, and integer
addition does not depend on the order or grouping of its terms.

Snapshots at powers of 2 rather than 4: a little better for 2D bytes each (why and what it
bought: docs/design/turbo.md).

A push plans first (:meth:`KeyMeans.plan`: the snapshots it reaches and the offset of each
of its keys, piece by piece of the schedule) and commits once its codes are stored, so a
failed push changes nothing.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass

import torch

from kvcache.codecs.encoded import SCALE_DTYPE

_SNAPSHOT_GROWTH = 2  # snapshot j at key count 2^j (4^j: see the module doc)
_LAST_SNAPSHOT = 2**22  # the last one (4M keys); the running sum stops there
_FIXED_ONE = 2**20  # fixed-point unit of the running key sum: 2^-20
_FIXED_MAX = 2.0**20  # keys clamped to +-2^20 for the sum: 2^22 * 2^40 < 2^63


def _snapshot_counts() -> list[int]:
    """Key counts at which a mean snapshot is taken: 1, 2, 4, ..., the last one."""
    counts, at = [], 1
    while at <= _LAST_SNAPSHOT:
        counts.append(at)
        at *= _SNAPSHOT_GROWTH
    return counts


_COUNTS = _snapshot_counts()  # snapshot j = mean of the first _COUNTS[j] keys
_EDGES = [c - 1 for c in _COUNTS]  # segment j = tokens [_EDGES[j], _EDGES[j+1]): snapshot j


def _pieces(start: int, stop: int) -> list[tuple[int, int, int]]:
    """Tokens [start, stop) split by segment: (first, end, segment) with end exclusive."""
    out = []
    j = bisect.bisect_right(_EDGES, start) - 1  # the segment of token `start`
    while start < stop:
        end = min(stop, _EDGES[j + 1]) if j + 1 < len(_EDGES) else stop
        out.append((start, end, j))
        start, j = end, j + 1
    return out


def to_fixed(keys: torch.Tensor) -> torch.Tensor:
    """Keys (any shape) as int64 multiples of 2^-20, clamped to +-2^20: exact to sum."""
    return torch.round(keys.clamp(-_FIXED_MAX, _FIXED_MAX) * _FIXED_ONE).long()


Piece = tuple[int, int, torch.Tensor | None]  # tokens [first, end) and their key offset


@dataclass(frozen=True)
class MeansPlan:
    """What a push does to the centring state; applied by ``commit`` once encoding succeeded."""

    means: tuple[torch.Tensor, ...]  # every snapshot after the push, each [D] bf16
    total: torch.Tensor  # running fixed-point key sum after the push, int64 [D]
    count: int  # keys including the push


class KeyMeans:
    """Snapshots of the key mean at fixed token counts (see the module doc)."""

    def __init__(self, dim: int, device: torch.device) -> None:
        self.dim, self.device = dim, device
        self.total = torch.zeros(dim, dtype=torch.int64, device=device)  # units of 2^-20
        self.count = 0
        self.means: list[torch.Tensor] = []  # snapshot j: mean of keys [0, 2^j), bf16 [D]

    def plan(self, fixed: torch.Tensor) -> MeansPlan:
        """The snapshots a push of keys takes (those at counts it reaches); ``fixed``: the
        keys [N, D] in fixed point (:func:`to_fixed`)."""
        start, stop = self.count, self.count + fixed.shape[0]
        fixed = fixed[: max(0, _LAST_SNAPSHOT - start)]  # keys the running sum still takes
        means = list(self.means)
        reached = _COUNTS[bisect.bisect_right(_COUNTS, start) : bisect.bisect_right(_COUNTS, stop)]
        for count in reached:  # the first `count` keys are all in: snapshot their mean
            total = self.total + fixed[: count - start].sum(0)
            means.append((total.double() / (_FIXED_ONE * count)).to(SCALE_DTYPE))
        return MeansPlan(tuple(means), self.total + fixed.sum(0), stop)

    def offsets(self, plan: MeansPlan, start: int, stop: int) -> list[Piece]:
        """(first, end, offset [D]) for the keys [start, stop) of a planned push."""
        return [(lo, hi, plan.means[j].float()) for lo, hi, j in _pieces(start, stop)]

    def commit(self, plan: MeansPlan) -> None:
        self.means, self.total, self.count = list(plan.means), plan.total, plan.count

    def per_key(self, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(snapshots [J, D] float32, the snapshot of each of the keys [0, length) [length]
        int64): the offsets to decode and score them with."""
        if not self.means:
            return None, None
        edges = torch.tensor(_EDGES, device=self.device)
        index = torch.bucketize(torch.arange(length, device=self.device), edges, right=True)
        return torch.stack(self.means).float(), index - 1

    def nbytes(self) -> int:
        """Snapshots (bf16) and the running sum (int64); 0 before the first key."""
        if not self.count:
            return 0
        means = sum(m.numel() * m.element_size() for m in self.means)
        return means + self.total.numel() * self.total.element_size()

    def clone(self) -> KeyMeans:
        out = copy.copy(self)
        out.means = list(self.means)  # snapshots and sums are never modified in place
        return out


class NoKeyMeans(KeyMeans):
    """Null object: keys are encoded as they are (one segment, no offset, nothing stored)."""

    def plan(self, fixed: torch.Tensor) -> MeansPlan:
        return MeansPlan((), self.total, self.count + fixed.shape[0])

    def offsets(self, plan: MeansPlan, start: int, stop: int) -> list[Piece]:
        return [(start, stop, None)]

    def per_key(self, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return None, None

    def nbytes(self) -> int:
        return 0

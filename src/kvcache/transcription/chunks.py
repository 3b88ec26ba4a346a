"""A file's speech regions (from VAD) merged into chunks of at most 30 s of speech, and the way
back from a chunk's timestamps to the file's (faster-whisper's ``collect_chunks`` and
``restore_speech_timestamps``). Bookkeeping only: sample indices, no audio is decoded here.

A chunk is its regions' samples back to back, the silence between them cut out::

    file   |--r0--|....|---r1---|.........|--r2--|       regions (start, end) in samples
    chunk  |--r0--|---r1---|--r2--|                      chunk time t -> file time:
           0      L1       L2     L3                     t + r_j.start - L_j for the region j
                                                         holding t (an end at L_j: region j-1)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from kvcache.errors import InvalidArgumentError

SAMPLE_RATE = 16000


@dataclass(frozen=True)
class Chunk:
    """Consecutive speech regions of a file, decoded as one piece of audio."""

    regions: tuple[tuple[int, int], ...]

    @property
    def samples(self) -> int:
        return sum(b - a for a, b in self.regions)

    def audio(self, audio: np.ndarray) -> np.ndarray:
        """The chunk's samples: its regions of ``audio`` back to back."""
        return np.concatenate([audio[a:b] for a, b in self.regions])

    def file_time(self, t: float, is_end: bool = False) -> float:
        """The file's time (s) of chunk time ``t``; an end on a region's last sample stays in
        that region (not at the next one's start)."""
        ends = np.cumsum([b - a for a, b in self.regions]).tolist()  # chunk samples
        sample = int(t * SAMPLE_RATE)
        if is_end and sample in ends:
            j = ends.index(sample)
        else:
            j = min(bisect.bisect(ends, sample), len(ends) - 1)
        before = ends[j - 1] if j else 0  # chunk samples before region j
        return round(t + (self.regions[j][0] - before) / SAMPLE_RATE, 3)


def merge_regions(regions: list[tuple[int, int]], max_samples: int) -> list[Chunk]:
    """Regions in order -> chunks, each as many next regions as fit in ``max_samples``."""
    chunks: list[Chunk] = []
    current: list[tuple[int, int]] = []
    size = 0
    last_end = 0
    for a, b in regions:
        if not last_end <= a < b:
            raise InvalidArgumentError(
                "regions", (a, b), f"ordered (start, end), start >= {last_end}"
            )
        if b - a > max_samples:
            raise InvalidArgumentError(
                "regions", (a, b), f"regions of at most {max_samples} samples"
            )
        if current and size + b - a > max_samples:
            chunks.append(Chunk(tuple(current)))
            current, size = [], 0
        current.append((a, b))
        size += b - a
        last_end = b
    if current:
        chunks.append(Chunk(tuple(current)))
    return chunks

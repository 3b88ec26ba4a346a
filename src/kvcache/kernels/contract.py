"""The contract between a codec's :class:`~kvcache.codecs.base.Layout` and the C++ readers.

One place says what the kernels read: the kind numbers of the readers' switch, the order in
which a Layout's tensors and ints are handed over, how keys stand to RoPE, and the largest
head_dim. ``csrc/contract.h`` mirrors it line for line (``tests/test_kernel_sources.py``
checks that the two agree), so a new codec or field changes this file and that header.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvcache.codecs.base import Layout


class Kind(IntEnum):
    """How a buffer's rows are stored: the readers decode (and the paths read) by kind."""

    F32 = 0
    F16 = 1
    BF16 = 2
    INT8 = 3  # one scale a row
    AFFINE_ROWS = 4  # b-bit codes, scale and minimum per group of channels of a row
    AFFINE_CHANNELS = 5  # KIVI: b-bit codes, scale and minimum per channel of a group of rows
    TURBO = 6  # rotated rows, codebook levels times a norm


class RopeMode(IntEnum):
    """How stored keys stand to RoPE (the ``rope_mode`` int)."""

    AFTER_ROPE = 0  # stored after it: scored as they are
    BEFORE_ROPE = 1  # stored before it: rotated by their cell's position as they are read
    CENTRE_ROPE = 2  # after it, minus a centre (meta_a) rotated to each cell's position


# a Layout's tensors in the order the readers take them (csrc/contract.h, Slot)
SLOTS = (
    "data", "scale", "low", "meta_of", "meta_a", "meta_b", "window", "residual", "centroids",
    "signs",
)  # fmt: skip
# then its ints (csrc/contract.h, IntSlot)
INT_SLOTS = ("kind", "bits", "group", "log_scale", "rope_mode", "rotated")
MAX_DIM = 256  # the largest head_dim the kernels take (their stack rows are this long)
ALIGN = 16  # head_dim must be a multiple of it (the vector paths' widest row step)


def layout_args(layout: Layout, pre_rope: bool) -> tuple[list[torch.Tensor], list[int]]:
    """A Layout as the readers take it: its tensors in SLOTS order, its ints in INT_SLOTS'
    (written out, not looked up by name: this runs twice a layer in every decode step;
    tests/test_contract.py checks the order). ``pre_rope``: the cache stores keys before RoPE."""
    if layout.centre_rope:
        mode = RopeMode.CENTRE_ROPE
    else:
        mode = RopeMode.BEFORE_ROPE if pre_rope else RopeMode.AFTER_ROPE
    tensors = [
        layout.data, layout.scale, layout.low, layout.meta_of, layout.meta_a, layout.meta_b,
        layout.window, layout.residual, layout.centroids, layout.signs,
    ]  # fmt: skip
    ints = [
        int(layout.kind), layout.bits, layout.group, int(layout.log_scale), int(mode),
        int(layout.rotated),
    ]  # fmt: skip
    return tensors, ints

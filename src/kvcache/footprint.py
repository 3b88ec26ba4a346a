"""Bytes held by a set of cells: what a press frees and what "total compression" divides by.

``memory_usage_bytes`` counts what is allocated (buffers grow and are reused); this counts
what the given cells hold, per layer and per K / V buffer::

    open row (fp16 recent window)   heads * dim * 2
    sealed row                      the codec's bytes_per_row (codes + per-row scales), less
                                    the share of a group record it amortises (KIVI keys)
    records used by sealed rows     once each: a key centre fp16 [H, D] ("sequence"),
                                    a KIVI group's scale + min fp16 [H, D] x 2 ("group")
    float codec                     heads * dim * element size, every row

The slot and record maps (int32 per cell of the pool) are the pool's, not any cell's.
"""

from __future__ import annotations

import numpy as np

from kvcache.codecs import Codec
from kvcache.recent import Windows
from kvcache.storage import Storage

FP16 = 2
# metadata kind -> fp16 [H, D] tensors per record (kvcache.recent.META_KINDS)
RECORD_TENSORS = {"none": 0, "sequence": 1, "group": 2}


def held_bytes(storage: Storage, cells: np.ndarray) -> int:
    """Bytes ``cells`` (distinct cell ids) hold in every layer's K and V buffers."""
    total = 0.0
    for st in storage.layers.values():
        for codec, (heads, dim), windows in zip(
            storage.codecs, (st.key_shape, st.value_shape), storage.roles, strict=True
        ):
            total += _buffer_bytes(codec, windows, heads, dim, cells)
    return int(round(total))


def _buffer_bytes(
    codec: Codec, windows: Windows | None, heads: int, dim: int, cells: np.ndarray
) -> float:
    if windows is None:
        return len(cells) * codec.bytes_per_row(heads, dim)
    spec = windows.spec
    record = RECORD_TENSORS[spec.meta] * heads * dim * FP16
    row = codec.bytes_per_row(heads, dim) - (record / spec.group if spec.meta == "group" else 0)
    open_ = windows.open[cells]
    sealed = cells[~open_]
    metas = np.unique(windows.meta_of[sealed])
    n_records = int(np.count_nonzero(metas >= 0))
    return (
        int(np.count_nonzero(open_)) * heads * dim * FP16 + len(sealed) * row + n_records * record
    )

"""What a codec is: how one layer's K (or V) rows are stored in the cells.

A :class:`Codec` makes :class:`Buffer` s; a buffer holds N cells of ``[heads, dim]`` rows in
its own format. It hands back decoded float rows (a view when the format is the compute dtype
itself) and describes its tensors as a :class:`Layout`, from which ``kvcache.kernels``
attends straight from the codes. The cache does not know or care which format it holds.

Quantizing codecs keep each sequence's newest rows in fp16 and encode older ones as the
cache's :class:`~kvcache.recent.SealPlan` says (see ``kvcache.recent`` and ``window.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcache.errors import NotSupportedError
from kvcache.kernels.contract import Kind
from kvcache.protocol import RotaryShift
from kvcache.recent import SealPlan, Windows, WindowSpec

Locs = torch.Tensor | slice  # cell indices (LongTensor) or a contiguous slice of cells
RowFormat = tuple[torch.dtype, tuple[int, ...]]  # a snapshot tensor's dtype and shape

NONE = torch.empty(0)  # an unused Layout field (never written: shared by every Layout)
F32, F16, BF16, INT8, AFFINE_ROWS, AFFINE_CHANNELS, TURBO = Kind  # the kernels' kinds
FLOAT_KINDS = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}


@dataclass
class Layout:
    """A buffer's tensors as the attention kernel reads them (unused ones stay empty).

    data      [N', H, W]   rows or codes (N' <= N: codes are allocated up to the highest
                           encoded cell)
    scale/low [N', H, g]   per-row metadata (fp16; turbo: bf16 or uint8 norms)
    meta_of   [N]  int32   metadata record of each encoded row (-1: none)
    meta_a/b  [M, H, D]    per-record values: a key centre (a), channel scale (a) / min (b)
    window    [N]  int32   fp16 slot of each row kept in the recent window (-1: codes)
    residual  [R, H, D]    fp16 rows of the window
    centroids [2^bits]     turbo levels at unit scale; signs [H, P] its rotations' sign flips
    rotation  [H, D, P]    turbo: row x rotates to x @ rotation[h]; y @ rotation[h].T back
    """

    kind: int
    data: torch.Tensor
    scale: torch.Tensor = NONE
    low: torch.Tensor = NONE
    meta_of: torch.Tensor = NONE
    meta_a: torch.Tensor = NONE
    meta_b: torch.Tensor = NONE
    window: torch.Tensor = NONE
    residual: torch.Tensor = NONE
    centroids: torch.Tensor = NONE
    signs: torch.Tensor = NONE
    rotation: torch.Tensor = NONE
    bits: int = 0
    group: int = 0
    log_scale: bool = False
    rotated: bool = False  # values summed in the codec's rotated domain (turbo)
    centre_rope: bool = False  # keys after RoPE, centred by a centre rotated to each position


@dataclass
class RotaryFrame:
    """Where a key buffer's rows sit in RoPE's frame: each cell's live position (the cache's
    ``Cells.pos``, [N]) and the cache's rotary shift. A buffer with a frame stores keys after
    RoPE minus their sequence's centre (a mean of un-rotated keys) rotated to the row's
    position: the centre of un-rotated keys holds at every position, and the codes are of
    rows after RoPE, which the attention kernel scores against the query as it is."""

    positions: np.ndarray
    shift: RotaryShift
    # the tables of the last positions rotated by, keyed by their values (a seal rotates the
    # same rows' centres in every layer: one table for all of them; docs/design/turbo.md)
    _last: (
        tuple[tuple[bytes, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] | None
    ) = field(default=None, repr=False, compare=False)

    def rotate(self, x: torch.Tensor, cells: np.ndarray, sign: int = 1) -> torch.Tensor:
        """Rows ``x`` [n, H, D] rotated by ``sign`` times the positions of ``cells`` [n]."""
        pos = np.ascontiguousarray(self.positions[cells] * sign, dtype=np.int64)
        key = (pos.tobytes(), x.dtype, x.device)
        if self._last is None or self._last[0] != key:
            cos, sin = self.shift.tables(torch.from_numpy(pos).to(x.device), x.dtype)
            self._last = (key, (cos.to(x.device), sin.to(x.device)))
        return self.shift.rotate(x, *self._last[1])


class Buffer(ABC):
    """N cells of [heads, dim] rows in one storage format."""

    spec: WindowSpec | None = None  # None: every row is encoded as it is written

    @abstractmethod
    def store(self, locs: torch.Tensor, x: torch.Tensor, plan: SealPlan | None) -> None:
        """Rows ``x`` [T, H, D] of a forward's new cells ``locs`` [T]; ``plan`` (for a
        windowed buffer) says which stay in fp16 and which rows to encode now."""

    @abstractmethod
    def rewrite(self, cells: torch.Tensor, x: torch.Tensor) -> None:
        """New contents for stored cells (re-rotated keys), each kept in its current form."""

    @abstractmethod
    def decode(self, cells: Locs, dtype: torch.dtype) -> torch.Tensor:
        """Rows of ``cells`` as ``dtype`` [n, H, D] (a view where no decoding is needed)."""

    def release(self, cells: np.ndarray) -> None:  # noqa: B027 - optional hook
        """``cells`` became free (their fp16 window rows, if any, go)."""

    @abstractmethod
    def layout(self) -> Layout:
        """The tensors the attention kernel reads."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of every tensor the buffer holds (codes, metadata, windows)."""

    # ---- snapshots (kvcache.snapshot): the stored bytes of some cells, by name ---------------
    @abstractmethod
    def export_rows(self, cells: np.ndarray, records: np.ndarray) -> dict[str, torch.Tensor]:
        """Copies of what ``cells`` (a sequence's, by position) and metadata ``records`` hold
        (codes, scales, fp16 window rows, record values), as stored."""

    @abstractmethod
    def row_formats(self, sealed: int, open_: int, records: int) -> dict[str, RowFormat]:
        """dtype and shape of each tensor ``export_rows`` gives for ``sealed`` encoded cells,
        ``open_`` window rows and ``records`` metadata records."""

    @abstractmethod
    def import_rows(
        self, cells: np.ndarray, records: np.ndarray, rows: dict[str, torch.Tensor]
    ) -> None:
        """Write ``export_rows``'s tensors back into ``cells`` and ``records`` (their window
        slots and records already assigned by the bookkeeping)."""


class Codec(ABC):
    """A storage format for K or V rows; ``name`` is its registry key.

    ``pre_rope``: as a key codec, this format quantizes keys better before RoPE (a cell
    cache with a shift function then stores them un-rotated, see ``storage.py``).
    ``rotary_centre``: as a key codec, this format can instead store keys after RoPE minus
    their centre rotated to each row's position (a :class:`RotaryFrame`), which a cache whose
    shift is a rotary embedding prefers to ``pre_rope``.
    ``spec``: its recent window (None: rows are encoded as written).
    """

    name: str
    pre_rope: bool = False
    rotary_centre: bool = False
    spec: WindowSpec | None = None

    @abstractmethod
    def allocate(
        self, n: int, heads: int, dim: int, device: torch.device, windows: Windows | None
    ) -> Buffer:
        """A buffer of ``n`` cells; ``windows``: the cache's bookkeeping of this codec's
        recent windows (see ``kvcache.recent``), None for a codec without a window."""

    def allocate_keys(
        self,
        n: int,
        heads: int,
        dim: int,
        device: torch.device,
        windows: Windows | None,
        frame: RotaryFrame | None,
    ) -> Buffer:
        """A buffer for keys; ``frame`` (only for a ``rotary_centre`` codec): see RotaryFrame."""
        del frame
        return self.allocate(n, heads, dim, device, windows)

    def bytes_per_row(self, heads: int, dim: int) -> float:
        """Stored bytes of one encoded cell's [heads, dim] row, per-row metadata included."""
        return self.allocate(1, heads, dim, torch.device("cpu"), None).nbytes()

    def check_device(self, device: torch.device) -> None:
        """Raise NotSupportedError for a device this codec cannot store on."""
        if device.type != "cpu" and not self.any_device:
            raise NotSupportedError(
                f"codec {self.name!r} stores on the CPU only (kvcache.kernels reads it there); "
                f"got device {device}"
            )

    any_device: bool = False  # float codecs work on any torch device

    def identity(self) -> dict[str, str]:
        """What tells this codec's stored bytes apart from another's (snapshots compare it)."""
        return {"class": type(self).__name__, **{k: repr(v) for k, v in sorted(vars(self).items())}}


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with at least ``rows`` rows (zeros appended; the same tensor if it has them)."""
    if t.shape[0] >= rows:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def capacity(need: int, have: int, limit: int, step: int = 64) -> int:
    """Rows to allocate for ``need``: 1.25x growth in steps of ``step``, at most ``limit``."""
    want = max(need, have + have // 4)
    return min(limit, -(-want // step) * step) if need <= limit else need

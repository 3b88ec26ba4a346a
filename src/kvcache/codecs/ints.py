"""Integer codecs: int8 with a per-(token, head) scale; affine b-bit codes per row.

int8 layout: codes int8 [N', H, D], scale fp16 [N', H, 1]; x ~= codes * scale, symmetric
(absmax / 127). No recent window beyond the batching of ``kvcache.recent`` (rows wait in fp16
until 32 of a sequence are encoded at once): 8 bits lose nothing a window would save.

Affine rows (``int4``, ``int4g64``, and KIVI's per-token values): codes packed 8/bits per
byte uint8 [N', H, D*bits/8] (little end first: the low nibble is the even channel), and per
group of ``group`` channels an fp16 scale and minimum [N', H, D/group]; x ~= q * scale + min
with q in 0..2^bits-1. With 4 bits in groups of 32 that is 5 bits per value. As a key codec
int4 first subtracts its sequence's key centre (``centre``: fp16 [M, H, D], one record per
sequence, the mean of its rows when it first seals one; why and what it bought:
docs/design/int4.md).

A group's range starts as its minimum and maximum (levels on both extremes, steps of
(max - min) / (2^bits - 1)); with ``refits`` > 0 the grid is then refitted by least squares
(:func:`affine_ranges`): given the codes, the step and lowest level that minimise the group's
squared error, projected onto the grids that keep every value within half a step of a level
(a step no larger than min/max's, the extremes within half a step of the end levels); the
codes again; ``refits`` times, keeping the grid of least error (min/max's on ties). So the
error bound of min/max holds and the bulk of the group gets finer steps. Keys gain and values
lose (the extreme values are the ones attention weighs most), so int4's keys refit
(``KEY_REFITS``) and everything else keeps min/max; ``"int4:refits=0"`` turns it off. Why and
what it bought: docs/design/int4.md.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.codecs.base import AFFINE_ROWS, INT8, Buffer, Codec, Layout, grown
from kvcache.codecs.pack import pack, unpack, unpack4
from kvcache.codecs.quantizer import fixed_sum
from kvcache.codecs.window import CentredBuffer, WindowedBuffer
from kvcache.errors import DimensionMismatchError, InvalidConfigError
from kvcache.kernels import encode
from kvcache.recent import SEAL_BATCH, Windows, WindowSpec

META = torch.float16  # scales and minimums: counted in nbytes like the codes
KEY_REFITS = 4  # least-squares refits of a key group's range (module docstring); values: 0
MAX_REFITS = 16


class Int8Buffer(WindowedBuffer):
    """int8 codes with a per-(row, head) fp16 scale."""

    def __init__(self, n: int, heads: int, dim: int, windows: Windows, device: torch.device):
        super().__init__(n, heads, dim, windows, device)
        self.codes = torch.zeros((0, heads, dim), dtype=torch.int8, device=device)  # [N', H, D]
        self.scale = torch.zeros((0, heads, 1), dtype=META, device=device)  # [N', H, 1]

    def _allocate(self, rows: int) -> None:
        self.codes, self.scale = grown(self.codes, rows), grown(self.scale, rows)

    def _encode(self, cells: torch.Tensor, x: torch.Tensor, metas: np.ndarray) -> None:
        if encode.served(x, self.codes, self.scale):
            encode.int8(x, cells, self.codes, self.scale)
        else:
            self.encode_reference(cells, x)

    def encode_reference(self, cells: torch.Tensor, x: torch.Tensor) -> None:
        """The torch expression of the codes (what the kernel equals)."""
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).to(META)  # [n, H, 1]
        safe = scale.float().clamp_min(torch.finfo(META).tiny)
        self.codes.index_copy_(0, cells, torch.round(x / safe).clamp_(-127, 127).to(torch.int8))
        self.scale.index_copy_(0, cells, scale)

    def _decode(self, cells: np.ndarray) -> torch.Tensor:
        at = self.index(cells)
        codes, scale = self.codes[at], self.scale[at]
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        out.copy_(codes)  # one conversion, no float temporary
        return out.mul_(scale.float())

    def layout(self) -> Layout:
        return self.window_layout(Layout(INT8, self.codes, scale=self.scale))

    def _code_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scale)


class Int8Codec(Codec):
    """8-bit symmetric codes with one fp16 scale per token and head; rows wait in fp16 until
    ``batch`` of a sequence can be encoded together (no window beyond that)."""

    any_device = True

    def __init__(self, batch: int = SEAL_BATCH) -> None:
        self.name = "int8"
        self.spec = WindowSpec(0, 1, "none", _batch(batch))

    def allocate(
        self, n: int, heads: int, dim: int, device: torch.device, windows: Windows | None
    ) -> Buffer:
        assert windows is not None and windows.spec == self.spec, "int8 needs its windows"
        return Int8Buffer(n, heads, dim, windows, device)

    def bytes_per_row(self, heads: int, dim: int) -> float:
        return heads * (dim + 2)


class AffineRowsBuffer(CentredBuffer):
    """b-bit asymmetric codes with an fp16 scale and minimum per group of channels."""

    CELL_FIELDS = ("codes", "scale", "low")

    def __init__(
        self,
        n: int,
        heads: int,
        dim: int,
        codec: AffineRowsCodec,
        windows: Windows,
        device: torch.device,
    ) -> None:
        group = min(codec.group, dim)  # a head narrower than a group is one group
        if dim % group or (dim * codec.bits) % 8:
            raise DimensionMismatchError(f"a multiple of {group}", dim, f"{codec.name} head_dim")
        super().__init__(n, heads, dim, windows, device, codec.centre)
        self.bits, self.group, self.refits = codec.bits, group, codec.refits
        g = dim // group
        self.codes = torch.zeros((0, heads, dim * self.bits // 8), dtype=torch.uint8, device=device)
        self.scale = torch.zeros((0, heads, g), dtype=META, device=device)  # [N', H, D/G]
        self.low = torch.zeros((0, heads, g), dtype=META, device=device)  # [N', H, D/G]

    def _allocate(self, rows: int) -> None:
        self.codes, self.scale, self.low = (
            grown(t, rows) for t in (self.codes, self.scale, self.low)
        )

    def _encode(self, cells: torch.Tensor, x: torch.Tensor, metas: np.ndarray) -> None:
        x = self.centred(x, metas, cells)
        whole_bytes = self.group * self.bits % 8 == 0  # the kernel packs a group at a time
        if whole_bytes and encode.served(x, self.codes, self.scale, self.low):
            encode.affine(
                x, cells, self.bits, self.group, self.codes, self.scale, self.low, self.refits
            )
        else:
            self.encode_reference(cells, x)

    def encode_reference(self, cells: torch.Tensor, x: torch.Tensor) -> None:
        """The torch expression of the codes of centred rows ``x`` (what the kernel equals)."""
        t, h, _ = x.shape
        levels = (1 << self.bits) - 1
        xg = x.reshape(t, h, -1, self.group)  # [T, H, D/G, G]
        low, scale = affine_ranges(xg, levels, self.refits)
        safe = scale.float().clamp_min(torch.finfo(META).tiny)
        q = torch.round((xg - low.float()[..., None]) / safe[..., None]).clamp_(0, levels)
        self.codes.index_copy_(0, cells, pack(q.reshape(t, h, self.dim).to(torch.uint8), self.bits))
        self.scale.index_copy_(0, cells, scale)
        self.low.index_copy_(0, cells, low)

    def _decode(self, cells: np.ndarray) -> torch.Tensor:
        """q * scale + low (+ centre), float32 [n, H, D]: one uint8 -> float conversion, then
        a multiply and an add each with one broadcast operand (fast; see git history)."""
        at = self.index(cells)
        codes = self.codes[at]
        n, h, _ = codes.shape
        g = self.dim // self.group
        x = torch.empty((n, h, self.dim), dtype=torch.float32, device=self.device)
        q = unpack4(codes) if self.bits == 4 else unpack(codes, self.bits)
        x.copy_(q.view(n, h, self.dim))
        xg = x.view(n, h, g, self.group)
        xg.mul_(self.scale[at].float().view(n, h, g, 1))
        xg.add_(self.low[at].float().view(n, h, g, 1))
        return self.uncentred(x, cells)

    def layout(self) -> Layout:
        layout = Layout(
            AFFINE_ROWS,
            self.codes,
            scale=self.scale,
            low=self.low,
            bits=self.bits,
            group=self.group,
        )
        return self.centred_layout(layout)

    def _code_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scale, self.low, *self.centre_tensors())


def affine_ranges(xg: torch.Tensor, levels: int, refits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 lowest level and step [...] of each group xg [..., G] (float32) for codes
    0..levels: min and (max - min) / levels, then ``refits`` least-squares refits within the
    grids that keep every value within half a step of a level (module docstring), the grid of
    least squared error kept. Sums in a fixed order (``fixed_sum``), so that csrc/encode.cpp's
    ``encode_affine`` gives the same bits."""
    lo, hi = torch.aminmax(xg, dim=-1)
    low = lo.to(META)
    scale = ((hi - low.float()) / levels).to(META)
    if refits == 0:
        return low, scale
    group = xg.shape[-1]
    width, n = 1 << (group - 1).bit_length(), float(group)
    finest, widest = (hi - lo) / (levels + 1), (hi - lo) / levels

    def codes(low: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's codes against (low, scale) and their squared error as decoded."""
        safe = scale.float().clamp_min(torch.finfo(META).tiny)[..., None]
        q = torch.round((xg - low.float()[..., None]) / safe).clamp_(0, levels)
        err = q * scale.float()[..., None] + low.float()[..., None] - xg
        return q, fixed_sum(err * err, width)[..., 0]

    q, best = codes(low, scale)
    best_low, best_scale = low, scale
    sx = fixed_sum(xg, width)[..., 0]
    for _ in range(refits):
        sq, sqq = fixed_sum(q, width)[..., 0], fixed_sum(q * q, width)[..., 0]
        sqx = fixed_sum(q * xg, width)[..., 0]
        det = n * sqq - sq * sq  # exact for groups up to 256 (the kernel's): below 2^24
        fits = det > 0  # codes not all equal (else the last grid stays)
        step = torch.minimum(torch.maximum((n * sqx - sq * sx) / det, finest), widest)
        base = (sx - step * sq) / n
        base = torch.minimum(torch.maximum(base, hi - (levels + 0.5) * step), lo + 0.5 * step)
        scale = torch.where(fits, step.to(META), scale)
        low = torch.where(fits, base.to(META), low)
        q, err = codes(low, scale)
        better = err < best  # NaN never is
        best = torch.where(better, err, best)
        best_low = torch.where(better, low, best_low)
        best_scale = torch.where(better, scale, best_scale)
    return best_low, best_scale


class AffineRowsCodec(Codec):
    """``bits``-bit codes per row in groups of ``group`` channels, the newest ``window``
    rows of each sequence in fp16; ``centre``: subtract the sequence's key centre first;
    ``refits``: least-squares refits of each group's range (module docstring)."""

    any_device = True

    def __init__(
        self,
        bits: int,
        group: int,
        centre: bool,
        window: int,
        name: str,
        pre_rope: bool = False,
        batch: int = SEAL_BATCH,
        refits: int = 0,
    ) -> None:
        if bits not in (2, 4):
            raise InvalidConfigError("bits", bits, "2 or 4")
        if group < 2 or group % 2:
            raise InvalidConfigError("group", group, "an even int >= 2")
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise InvalidConfigError("recent", window, "an int >= 0")
        if not isinstance(refits, int) or isinstance(refits, bool) or not 0 <= refits <= MAX_REFITS:
            raise InvalidConfigError("refits", refits, f"an int in 0..{MAX_REFITS}")
        self.bits, self.group, self.centre, self.name = bits, group, centre, name
        self.refits = refits
        self.pre_rope = pre_rope
        self.spec = WindowSpec(window, 1, "sequence" if centre else "none", _batch(batch))

    def allocate(
        self, n: int, heads: int, dim: int, device: torch.device, windows: Windows | None
    ) -> Buffer:
        assert windows is not None and windows.spec == self.spec, (
            "a windowed codec needs its windows"
        )
        return AffineRowsBuffer(n, heads, dim, self, windows, device)

    def bytes_per_row(self, heads: int, dim: int) -> float:
        return heads * (dim * self.bits / 8 + 2 * 2 * dim / self.group)


def int4(
    group: int = 32,
    centre: bool = False,
    window: int = 128,
    batch: int = SEAL_BATCH,
    refits: int | None = None,
) -> AffineRowsCodec:
    """4-bit affine codes (``int4``: groups of 32 channels; ``int4g64``: 64); ``refits``
    defaults to ``KEY_REFITS`` for keys (``centre``) and 0 for values."""
    name = "int4" if group == 32 else f"int4g{group}"
    if refits is None:
        refits = KEY_REFITS if centre else 0
    return AffineRowsCodec(4, group, centre, window, name, batch=batch, refits=refits)


def _batch(batch: int) -> int:
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InvalidConfigError("batch", batch, "an int >= 1 (rows of a sequence sealed together)")
    return batch


__all__ = ["AffineRowsCodec", "Int8Codec", "int4"]

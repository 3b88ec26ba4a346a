"""KIVI in cells: keys quantized per channel, values per token, the newest rows in fp16.

KIVI (Liu et al., 2024) quantizes keys per *channel* (outlier channels get their own
range) over groups of tokens and values per *token*, and keeps the newest R tokens in full
precision until a whole group can be quantized at once. In a cell cache tokens live in
cells, so a group is a block of G consecutive cells::

    cells   [ block 0: 0..G-1 ][ block 1: G..2G-1 ][ block 2 ] ...
    state      sealed             sealed              open (rows in the fp16 residual)
    keys    codes [rows, H, D*bits/8] + per block: scale, min [H, D]      (per channel)
    values  codes [rows, H, D*bits/8] + per row:   scale, min [H, D/g]    (per token)

At most ``residual // G`` blocks are open (rows in fp16); opening another seals the oldest
(quantizes its G rows together). Writing into a sealed block (a freed cell reused) decodes
it into a residual slot first. Reads decode only the blocks of the requested range.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from kvcache.codecs.base import Buffer, Codec, Locs, tensor_bytes
from kvcache.codecs.pack import pack, unpack, unpack4
from kvcache.errors import DimensionMismatchError, InvalidConfigError

META = torch.float16
RESIDUAL = torch.float16


class KiviBuffer(Buffer):
    def __init__(
        self, n: int, heads: int, dim: int, codec: KiviCodec, device: torch.device
    ) -> None:
        self.bits, self.g, self.per_channel = codec.bits, codec.group, codec.per_channel
        self.vg = min(dim, codec.value_group)
        if dim % self.vg or (dim * self.bits) % 8:
            raise DimensionMismatchError(f"a multiple of {self.vg}", dim, "kivi head_dim")
        self.dim = dim
        self.blocks = -(-n // self.g)
        rows = self.blocks * self.g
        self.codes = torch.zeros(
            (rows, heads, dim * self.bits // 8), dtype=torch.uint8, device=device
        )
        meta = (self.blocks, heads, dim) if self.per_channel else (rows, heads, dim // self.vg)
        self.scale = torch.zeros(meta, dtype=META, device=device)
        self.low = torch.zeros(meta, dtype=META, device=device)
        slots = max(1, codec.residual // self.g)
        self.residual = torch.zeros((slots * self.g, heads, dim), dtype=RESIDUAL, device=device)
        self.open: OrderedDict[int, int] = OrderedDict()  # block -> slot, oldest first
        self.free_slots = list(range(slots - 1, -1, -1))

    # ---- writing ---------------------------------------------------------------------
    def write(self, locs: Locs, x: torch.Tensor) -> None:
        cells = _cells(locs)
        blocks = np.unique(cells // self.g)
        per = len(self.free_slots) + len(self.open)  # blocks that can be open at once
        for i in range(0, len(blocks), per):
            chunk = blocks[i : i + per]
            for b in chunk:
                self._open(int(b))
            sel = np.isin(cells // self.g, chunk)
            rows = self._residual_rows(cells[sel])
            self.residual.index_copy_(0, rows, x[torch.from_numpy(sel)].to(RESIDUAL))

    def _residual_rows(self, cells: np.ndarray) -> torch.Tensor:
        slots = np.array([self.open[int(b)] for b in cells // self.g], dtype=np.int64)
        return torch.from_numpy(slots * self.g + cells % self.g)

    def _open(self, b: int) -> None:
        if b in self.open:
            self.open.move_to_end(b)
            return
        if not self.free_slots:
            self._seal(next(iter(self.open)))
        slot = self.free_slots.pop()
        r = slice(b * self.g, (b + 1) * self.g)
        self.residual[slot * self.g : (slot + 1) * self.g] = self._decode_rows(
            r, b, b + 1, RESIDUAL
        )
        self.open[b] = slot

    def _seal(self, b: int) -> None:
        slot = self.open.pop(b)
        x = self.residual[slot * self.g : (slot + 1) * self.g].float()  # [G, H, D]
        r = slice(b * self.g, (b + 1) * self.g)
        levels = (1 << self.bits) - 1
        if self.per_channel:
            low, high = x.amin(dim=0), x.amax(dim=0)  # [H, D] per channel over the block
            scale = ((high - low) / levels).to(META)
            safe = scale.float().clamp_min(torch.finfo(META).tiny)
            q = torch.round((x - low.to(META).float()) / safe).clamp_(0, levels)
            self.scale[b], self.low[b] = scale, low.to(META)
        else:
            xg = x.reshape(self.g, x.shape[1], -1, self.vg)  # [G, H, D/g, g] per token
            low = xg.amin(dim=-1).to(META)
            scale = ((xg.amax(dim=-1) - low.float()) / levels).to(META)
            safe = scale.float().clamp_min(torch.finfo(META).tiny)
            q = torch.round((xg - low.float()[..., None]) / safe[..., None]).clamp_(0, levels)
            q = q.reshape(x.shape)
            self.scale[r], self.low[r] = scale, low
        self.codes[r] = pack(q.to(torch.uint8), self.bits)
        self.free_slots.append(slot)

    # ---- reading ---------------------------------------------------------------------
    def _decode_rows(self, r: slice, b0: int, b1: int, dtype: torch.dtype) -> torch.Tensor:
        """Decode the sealed codes of block-aligned rows r = blocks [b0, b1)."""
        codes = self.codes[r]
        q = unpack4(codes) if self.bits == 4 else unpack(codes, self.bits)
        x = torch.empty((codes.shape[0], codes.shape[1], self.dim), dtype=torch.float32)
        x.copy_(q.view(x.shape))  # [R, H, D], one conversion; computed in float32
        # multiply, then add, in place: each op has one broadcast operand (fast; see ints.py)
        if self.per_channel:
            xb = x.view(b1 - b0, self.g, *x.shape[1:])  # [B, G, H, D]
            xb.mul_(self.scale[b0:b1, None].float()).add_(self.low[b0:b1, None].float())
            return x.to(dtype)
        xg = x.view(*x.shape[:2], -1, self.vg)  # [R, H, D/g, g]
        xg.mul_(self.scale[r][..., None].float()).add_(self.low[r][..., None].float())
        return x.to(dtype)

    def read(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        b0, b1 = lo // self.g, -(-hi // self.g)
        out = self._decode_rows(slice(b0 * self.g, b1 * self.g), b0, b1, dtype)
        for b, slot in self.open.items():
            if b0 <= b < b1:
                out[(b - b0) * self.g : (b - b0 + 1) * self.g] = self.residual[
                    slot * self.g : (slot + 1) * self.g
                ]
        return out[lo - b0 * self.g : hi - b0 * self.g]

    def gather(self, cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.stack([self.read(int(c), int(c) + 1, dtype)[0] for c in cells])

    def nbytes(self) -> int:
        return tensor_bytes(self.codes, self.scale, self.low, self.residual)


def _cells(locs: Locs) -> np.ndarray:
    if isinstance(locs, slice):
        return np.arange(locs.start, locs.stop, dtype=np.int64)
    return locs.cpu().numpy().astype(np.int64)


class KiviCodec(Codec):
    """KIVI with ``bits`` per value; ``per_channel`` for keys, per token for values."""

    def __init__(
        self,
        bits: int,
        per_channel: bool,
        group: int = 64,
        residual: int = 128,
        value_group: int = 64,
    ) -> None:
        if bits not in (2, 4):
            raise InvalidConfigError("bits", bits, "2 or 4")
        if group < 1 or residual < group:
            raise InvalidConfigError("residual", residual, f"an int >= group ({group})")
        self.bits, self.per_channel, self.group = bits, per_channel, group
        self.residual, self.value_group = residual, value_group
        self.name = f"kivi{bits}"
        self.pre_rope = per_channel  # keys: per-channel ranges are stable before RoPE

    def allocate(self, n: int, heads: int, dim: int, device: torch.device) -> Buffer:
        return KiviBuffer(n, heads, dim, self, device)

"""The multi-sequence causal cell cache (Ollama's ``kvcache.Causal`` design, atomic failures).

Many sequences share one pool of N cells; every layer uses the same cell for a token. A
forward places its tokens in the lowest free cells, writes K/V there layer by layer and reads
back a contiguous *history range* of cells plus a mask saying which cells each batch row may
attend to::

    cells      0    1    2    3    4    5    6    7
    seq/pos   a0   a1   b0   a2   --   b1   b2   --      (-- = free, masked)
    history        [--------------------------)          lo=1, hi=7 (covers the batch's seqs)
    mask row (a, pos 3):  a1 . a2 -- . . ->  x . x . . .   (row attends to a1, a2 and itself)

Storage is preallocated per layer ([N, kv_heads, head_dim], token-major) in a codec's format
(float, int8, int4, ...; K and V may differ); ``get`` returns views of cells [lo, hi) for a
float codec in the compute ``dtype`` (decoded copies of just that range otherwise), never a
concatenation, so a decode step writes only the new rows. Keys are stored after RoPE by
default, and a middle ``remove`` decodes the moved keys, re-rotates them and encodes them
again. With ``key_rope="pre"`` (the default for codecs that quantize keys per channel:
kivi, turbo) the storage un-rotates keys before encoding and rotates them back on reads, so
a ``remove`` only changes positions.
Bookkeeping (``cells.py``) and the attention policy (``policy.py``) hold no tensors.

Every mutating call validates before it mutates: a call that raises leaves the cache as it
was (``start_forward`` evicts nothing and places nothing; ``remove`` drops and shifts
nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.batch import Batch
from kvcache.cells import Cells
from kvcache.codecs import Codec, FloatCodec, make_codec
from kvcache.errors import (
    CacheFullError,
    CallOrderError,
    InvalidArgumentError,
    InvalidConfigError,
    NotSupportedError,
)
from kvcache.policy import Policy
from kvcache.protocol import ShiftFn
from kvcache.storage import Storage, check_kv
from kvcache.validate import config_int, int_arg, optional_config_int

DEFAULT_MAX_BATCH = 512


@dataclass
class _Forward:
    """State of the forward between ``start_forward`` and the next one."""

    positions: np.ndarray  # [T] int64
    seqs: np.ndarray  # [T] int64
    locs: torch.Tensor | slice  # cells of the batch tokens (slice when contiguous)
    lo: int  # history range [lo, hi) of cells
    hi: int
    causal_rows: np.ndarray  # [T] bool, False = exempt from causality (set_causal)
    mask: torch.Tensor  # [T, hi - lo] bool
    reserve: bool
    pos_t: torch.Tensor | None = None  # [T] positions (keys stored before RoPE only)
    hist_pos: torch.Tensor | None = None  # [hi - lo] cell positions (idem)


def _as_locs(locs: np.ndarray, device: torch.device) -> torch.Tensor | slice:
    first = int(locs[0])
    if int(locs[-1]) - first == len(locs) - 1:
        return slice(first, first + len(locs))
    return torch.from_numpy(locs).to(device)


class CausalCache:
    """A cell cache with full causal, sliding-window, window+memory or chunked attention."""

    def __init__(
        self,
        capacity: int,
        *,
        max_sequences: int = 1,
        max_batch: int | None = None,
        window: int | None = None,
        memory: int | None = None,
        chunk: int | None = None,
        shift: ShiftFn | None = None,
        padding: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        codec: str | Codec | None = None,
        key_codec: str | Codec | None = None,
        value_codec: str | Codec | None = None,
        key_rope: str | None = None,
    ) -> None:
        """``key_rope``: "post" stores keys as given (rotated), "pre" un-rotates them by
        their positions through ``shift`` before the key codec encodes them; None picks
        "pre" when there is a ``shift`` and the key codec prefers it (``Codec.pre_rope``)."""
        self.capacity = config_int("capacity", capacity, 1)
        self.max_sequences = config_int("max_sequences", max_sequences, 1)
        mb = optional_config_int("max_batch", max_batch, 1)
        self.max_batch = min(self.capacity, DEFAULT_MAX_BATCH) if mb is None else mb
        self.window = optional_config_int("window", window, 0)
        memory = optional_config_int("memory", memory, 0)
        self.chunk = optional_config_int("chunk", chunk, 1)
        self.padding = config_int("padding", padding, 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidConfigError("dtype", dtype, "a floating torch.dtype")
        self.memory = self._normalise_memory(memory)
        self.shift = shift
        self.dtype = dtype
        self.device = torch.device(device)
        self.policy = Policy(window=self.window, chunk=self.chunk, memory=self.memory)
        if self.memory is None:
            n = self.max_sequences * self.capacity
        else:
            n = self.max_sequences * self.memory + self.max_batch
        self.num_cells = -(-n // self.padding) * self.padding
        self.cells = Cells(self.num_cells)
        native = FloatCodec(dtype)
        self.key_codec = make_codec(key_codec or codec or native, "key")
        self.value_codec = make_codec(value_codec or codec or native, "value")
        if key_rope not in (None, "pre", "post"):
            raise InvalidConfigError("key_rope", key_rope, '"pre", "post" or None')
        if key_rope == "pre" and shift is None:
            raise InvalidConfigError("key_rope", key_rope, '"post" without a shift function')
        if key_rope is None:
            key_rope = "pre" if shift is not None and self.key_codec.pre_rope else "post"
        self.key_rope = key_rope
        self.storage = Storage(
            self.num_cells,
            dtype,
            self.device,
            self.key_codec,
            self.value_codec,
            rope=shift if key_rope == "pre" else None,
        )
        self._fwd: _Forward | None = None
        self._closed = False

    def _normalise_memory(self, memory: int | None) -> int | None:
        """Ollama's rules: memory defaults to window, >= window + 1 with several sequences,
        and memory >= capacity means no eviction (None)."""
        if memory is not None and self.window is None:
            raise InvalidConfigError("memory", memory, "None when window is None (no window)")
        if memory is not None and self.window is not None and memory < self.window:
            raise InvalidConfigError("memory", memory, f"an int >= window ({self.window})")
        if self.window is None:
            return None
        m = self.window if memory is None else memory
        if self.max_sequences > 1:
            m = max(m, self.window + 1)
        return None if m >= self.capacity else m

    # ---- forward ---------------------------------------------------------------------
    def start_forward(self, batch: Batch, reserve: bool = False) -> None:
        """Place the batch's tokens in free cells and build the mask all layers share.

        Raises CacheFullError (nothing evicted, nothing placed) when too few cells are free,
        and InvalidArgumentError when a token's (sequence, position) is already stored or
        repeated in the batch. ``reserve=True`` sizes a worst-case forward: no bookkeeping
        changes, cells 0..T-1, the whole cache as history, and ``put`` writes nothing.
        """
        self._check_open()
        if not isinstance(batch, Batch):
            raise InvalidArgumentError("batch", type(batch).__name__, "a kvcache.Batch")
        positions = np.asarray(batch.positions, dtype=np.int64)  # [T]
        seqs = np.asarray(batch.sequences, dtype=np.int64)  # [T]
        t = len(positions)
        self._fwd = None
        if reserve:
            if t > self.num_cells:
                raise CacheFullError(t, self.cells.free_count(), self.num_cells)
            locs = np.arange(t, dtype=np.int64)
            self._fwd = self._make_forward(positions, seqs, locs, 0, self.num_cells, True)
            return
        evictions = self._plan_eviction(positions, seqs)
        refs = self.cells.refs
        if evictions:
            refs = refs.copy()
            for cells in evictions.values():
                np.subtract.at(refs, cells, 1)
        free = self.cells.find_free(t, refs)
        if len(free) < t:
            raise CacheFullError(t, int(np.count_nonzero(refs == 0)), self.num_cells)
        self._check_new_tokens(positions, seqs, evictions)
        batch_seqs = set(seqs.tolist())
        for seq, cells in evictions.items():
            self.cells.release(seq, cells)
            if seq not in batch_seqs and len(self.cells.cells_of(seq)) == 0:
                self.cells.forget(seq)
        self.cells.occupy(free, positions, seqs)
        lo, hi = self._history(positions, seqs, free)
        self._fwd = self._make_forward(positions, seqs, free, lo, hi, False)

    def _plan_eviction(self, positions: np.ndarray, seqs: np.ndarray) -> dict[int, np.ndarray]:
        """Cells each sequence drops before placement (limited memory only)."""
        if self.memory is None:
            return {}
        out: dict[int, np.ndarray] = {}
        for seq in list(self.cells.ranges):
            cells = self.cells.cells_of(seq)
            if len(cells) == 0:
                continue
            cell_pos = self.cells.pos[cells]
            in_batch = seqs == seq
            lowest = int(positions[in_batch].min()) if in_batch.any() else int(cell_pos.max()) + 1
            bound = self.policy.evict_below(lowest)
            assert bound is not None
            drop = cells[cell_pos < bound]
            if len(drop):
                out[seq] = drop
        return out

    def _check_new_tokens(
        self, positions: np.ndarray, seqs: np.ndarray, evictions: dict[int, np.ndarray]
    ) -> None:
        """Each (sequence, position) may be stored once: reject repeats (remove them first)."""
        for seq in np.unique(seqs):
            s = int(seq)
            new = positions[seqs == seq]
            if len(np.unique(new)) != len(new):
                raise InvalidArgumentError(
                    "batch.positions",
                    new.tolist(),
                    f"distinct positions per sequence (sequence {s})",
                )
            if int(new.min()) > self.cells.max_pos.get(s, -1):
                continue  # appending after everything stored: the common decode case
            held = self.cells.cells_of(s)
            if s in evictions:
                held = np.setdiff1d(held, evictions[s])
            clash = np.intersect1d(new, self.cells.pos[held])
            if len(clash):
                raise InvalidArgumentError(
                    "batch.positions",
                    clash.tolist(),
                    f"positions not yet stored for sequence {s} (remove({s}, ...) them first)",
                )

    def _history(
        self, positions: np.ndarray, seqs: np.ndarray, locs: np.ndarray
    ) -> tuple[int, int]:
        """The padded cell range [lo, hi) the batch reads."""
        lo, hi = int(locs.min()), int(locs.max())
        for seq in np.unique(seqs):
            s = int(seq)
            if self.memory is None:
                r_lo, r_hi = self.cells.ranges[s]
            else:
                cells = self.cells.cells_of(s)
                floor = self.policy.history_floor(int(positions[seqs == seq].min()))
                if floor is not None:
                    cells = cells[self.cells.pos[cells] >= floor]
                if len(cells) == 0:
                    continue
                r_lo, r_hi = int(cells[0]), int(cells[-1])
            lo, hi = min(lo, r_lo), max(hi, r_hi)
        p = self.padding
        return lo // p * p, -(-(hi + 1) // p) * p

    def _make_forward(
        self,
        positions: np.ndarray,
        seqs: np.ndarray,
        locs: np.ndarray,
        lo: int,
        hi: int,
        reserve: bool,
    ) -> _Forward:
        causal_rows = np.ones(len(positions), dtype=bool)
        fwd = _Forward(
            positions,
            seqs,
            _as_locs(locs, self.device),
            lo,
            hi,
            causal_rows,
            torch.empty(0),
            reserve,
        )
        fwd.mask = self._mask(fwd)
        if self.storage.rope is not None:
            fwd.pos_t = torch.from_numpy(positions).to(self.device)
            fwd.hist_pos = torch.from_numpy(self.cells.pos[lo:hi].copy()).to(self.device)
        return fwd

    def _mask(self, fwd: _Forward) -> torch.Tensor:
        cols = np.array([self.cells.cols.get(int(s), -1) for s in fwd.seqs], dtype=np.int64)
        member = self.cells.member[fwd.lo : fwd.hi]  # [L, S]
        rows = np.where(cols[None, :] >= 0, member[:, np.maximum(cols, 0)], False).T  # [T, L]
        mask = self.policy.mask(
            rows, fwd.positions, self.cells.pos[fwd.lo : fwd.hi], fwd.causal_rows
        )
        return torch.from_numpy(np.ascontiguousarray(mask)).to(self.device)

    def set_causal(self, except_rows: Sequence[int]) -> None:
        """Exempt these batch rows from causality (e.g. image tokens attend both ways)."""
        fwd = self._forward()
        t = len(fwd.positions)
        rows = np.ones(t, dtype=bool)
        for i, r in enumerate(except_rows):
            r = int_arg(f"except_rows[{i}]", r)
            if r >= t:
                raise InvalidArgumentError(f"except_rows[{i}]", r, f"a batch row < {t}")
            rows[r] = False
        if not np.array_equal(rows, fwd.causal_rows):
            fwd.causal_rows = rows
            fwd.mask = self._mask(fwd)

    def put(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the batch's K/V ([T, kv_heads, head_dim] each) of one layer in its cells."""
        fwd = self._forward()
        layer = int_arg("layer", layer)
        check_kv(key, value, len(fwd.positions))
        if fwd.reserve:
            self.storage.layer(layer, key, value)  # allocate only: reserve computes nothing
        else:
            self.storage.write(layer, fwd.locs, key, value, fwd.pos_t)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the history range: keys [L, H, Dk], values [L, H, Dv], mask [T, L]."""
        fwd = self._forward()
        layer = int_arg("layer", layer)
        if layer not in self.storage.layers:
            raise CallOrderError(f"layer {layer} has no storage yet: put(layer, ...) first")
        k, v = self.storage.view(layer, fwd.lo, fwd.hi, fwd.hist_pos)
        return k, v, fwd.mask

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """put then get: the one call an attention layer makes."""
        self.put(layer, key, value)
        return self.get(layer)

    def _forward(self) -> _Forward:
        self._check_open()
        if self._fwd is None:
            raise CallOrderError("no forward in progress: call start_forward(batch) first")
        return self._fwd

    # ---- sequence operations ---------------------------------------------------------
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make ``dst`` share ``src``'s cells with position < length (no K/V copied).

        ``dst`` first drops all its cells; ``copy_prefix(s, s, n)`` keeps s's positions < n.
        """
        self._check_open()
        src, dst = int_arg("src", src), int_arg("dst", dst)
        length = int_arg("length", length)
        if src == dst:
            self.remove(src, length)
            return
        self.remove(dst, 0)
        cells = self.cells.cells_of(src)
        self.cells.share(dst, cells[self.cells.pos[cells] < length])
        self._fwd = None

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        """Drop ``seq``'s positions [begin, end); later positions move down by end - begin.

        Moved keys are re-rotated through ``shift`` (per layer, in chunks of at most
        ``max_batch`` cells), or, stored before RoPE, keep their codes. Raises
        NotSupportedError, changing nothing, when tokens must move and there is no
        ``shift`` or a moving cell is shared with another sequence.
        ``end=None`` (to the end) never fails.
        """
        self._check_open()
        seq, begin = int_arg("seq", seq), int_arg("begin", begin)
        if end is not None:
            end = int_arg("end", end, minimum=begin)
        cells = self.cells.cells_of(seq)
        pos = self.cells.pos[cells]
        gone = cells[(pos >= begin) & (pos < end if end is not None else True)]
        moved = cells[pos >= end] if end is not None and end > begin else cells[:0]
        new_keys = self._shifted_keys(seq, moved, begin - (end or begin))
        self.cells.release(seq, gone)
        self.cells.move(seq, moved, begin - (end or begin))
        moved_t = torch.from_numpy(moved).to(self.device)
        for layer, keys in new_keys.items():
            self.storage.layers[layer].keys.write(moved_t, keys)
        if len(self.cells.cells_of(seq)) == 0:
            self.cells.forget(seq)
        self._fwd = None

    def _shifted_keys(self, seq: int, moved: np.ndarray, offset: int) -> dict[int, torch.Tensor]:
        """Re-rotated keys of the moved cells for every layer, computed before any mutation."""
        if len(moved) == 0:
            return {}
        shared = moved[self.cells.refs[moved] > 1]
        if len(shared):
            raise NotSupportedError(
                f"cannot shift cells shared by several sequences (seq {seq}, cells "
                f"{shared.tolist()[:8]}): copy_prefix sharing blocks a middle remove"
            )
        if self.shift is None:
            raise NotSupportedError(
                f"removing a middle range of seq {seq} moves {len(moved)} tokens, which needs "
                "a shift function (RoPE re-rotation); pass shift= to CausalCache"
            )
        out: dict[int, torch.Tensor] = {}
        if self.storage.rope is not None:
            return out  # stored un-rotated: the new positions are all that changes
        for layer, st in self.storage.layers.items():
            parts = []
            for i in range(0, len(moved), self.max_batch):
                idx = torch.from_numpy(moved[i : i + self.max_batch]).to(self.device)
                offsets = torch.full((len(idx),), offset, dtype=torch.int64, device=self.device)
                keys = st.keys.gather(idx, self.dtype)  # [n, H, D], decoded
                parts.append(self.shift(layer, keys, offsets).to(self.dtype))
            out[layer] = torch.cat(parts)
        return out

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether a token at ``pos`` can be processed from what is still stored."""
        self._check_open()
        seq, pos = int_arg("seq", seq), int_arg("pos", pos)
        if self.memory is None:
            return True
        stored = self.cells.pos[self.cells.cells_of(seq)]
        if len(stored) == 0:
            return False
        window = self.window or 0
        return max(0, pos - window) >= int(stored.min()) and pos <= int(stored.max()) + 1

    # ---- introspection ---------------------------------------------------------------
    def read_cells(self, layer: int, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded copies of the K/V in ``cells`` (LongTensor) of ``layer``, keys rotated for
        the cells' positions as the model wrote them: [n, H, Dk], [n, H, Dv] in ``dtype``."""
        self._check_open()
        layer = int_arg("layer", layer)
        if layer not in self.storage.layers:
            raise InvalidArgumentError("layer", layer, f"one of {sorted(self.storage.layers)}")
        cells = cells.to(torch.int64)
        if len(cells) and (int(cells.min()) < 0 or int(cells.max()) >= self.num_cells):
            raise InvalidArgumentError("cells", cells.tolist()[:8], f"cell ids < {self.num_cells}")
        pos = None
        if self.storage.rope is not None:
            pos = torch.from_numpy(self.cells.pos[cells.cpu().numpy()]).to(self.device)
        return self.storage.gather(layer, cells.to(self.device), pos)

    def positions(self, seq: int) -> list[int]:
        """Sorted positions stored for ``seq``."""
        return self.cells.positions(int_arg("seq", seq))

    def sequences(self) -> list[int]:
        """Sequence ids that hold cells or an (empty) range."""
        return sorted(self.cells.ranges)

    def used_cells(self) -> int:
        return self.num_cells - self.cells.free_count()

    def memory_usage_bytes(self) -> int:
        """Bytes of K/V storage allocated (all cells of every layer that has been put)."""
        return self.storage.nbytes()

    def close(self) -> None:
        """Free the storage; the cache cannot be used afterwards."""
        self.storage.layers.clear()
        self._fwd = None
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise CallOrderError("cache is closed: create a new one")

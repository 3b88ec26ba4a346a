"""The multi-sequence causal cell cache (Ollama's ``kvcache.Causal`` design, atomic failures).

Many sequences share one pool of N cells; every layer uses the same cell for a token. A
forward places its tokens in the lowest free cells (Ollama's placement) and writes K/V there
layer by layer. Attention is a cache operation: ``attention(layer, q, k, v)`` stores k/v and
attends each batch row to exactly its own sequence's visible cells, read in position order
straight from the stored codes (``kvcache.kernels``), a prefix shared by several rows of the
batch read once for all of them::

    cells      0    1    2    3    4    5    6    7
    seq/pos   a0   a1   b0   a2   --   b1   b2   --      (-- = free)
    row (a, pos 3) reads cells 0, 1, 3 (a's cells by position); row (b, 2) reads 2, 5, 6

For callers that attend themselves (the transformers adapter, the seed APIs, scenario tests)
``get``/``update`` hand back a contiguous *history range* of cells plus a mask saying which
cells each batch row may attend to::

    history        [--------------------------)          lo=1, hi=7 (covers the batch's seqs)
    mask row (a, pos 3):  a1 . a2 -- . . ->  x . x . . .   (row attends to a1, a2 and itself)

Storage is preallocated per layer ([N, kv_heads, head_dim], token-major) in a codec's format
(float, int8, int4, kivi, turbo; K and V may differ); quantizing codecs keep each sequence's
newest rows in fp16 (``kvcache.recent``). Keys are stored after RoPE by default, and a middle
``remove`` decodes the moved keys, re-rotates them and encodes them again. With
``key_rope="pre"`` (the default for kivi, whose keys are quantized per channel) keys are
stored un-rotated, rotated back by position when read (in the kernels, from cos/sin tables),
and a ``remove`` only changes positions. Turbo keys are centred by their sequence's centre
before RoPE either way: stored after RoPE when the shift is a rotary embedding (the centre
rotated to each row's position, ``codecs.base.RotaryFrame``: the kernel scores the codes
against the query rotated once), else before RoPE.
Bookkeeping (``cells.py``, ``recent.py``) and the attention policy (``policy.py``) hold no
tensors.

Every mutating call validates before it mutates: a call that raises leaves the cache as it
was (``start_forward`` evicts nothing and places nothing; ``remove`` drops and shifts
nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvcache.batch import Batch
from kvcache.cells import Cells
from kvcache.codecs import Codec, FloatCodec, make_codec
from kvcache.codecs.base import Locs, RotaryFrame
from kvcache.errors import (
    CacheFullError,
    CallOrderError,
    DimensionMismatchError,
    InvalidArgumentError,
    InvalidConfigError,
    NotSupportedError,
)
from kvcache.footprint import held_bytes
from kvcache.forward import ForwardPlan
from kvcache.kernels import build
from kvcache.kernels.attend import attend
from kvcache.kernels.reference import grouped_attention
from kvcache.kernels.route import forward_reason, layer_reason
from kvcache.policy import Policy
from kvcache.protocol import RotaryShift, ShiftFn
from kvcache.snapshot import ModelId, Snapshot
from kvcache.snapshot import restore as restore_snapshot
from kvcache.snapshot import take as take_snapshot
from kvcache.storage import Storage, check_kv
from kvcache.validate import config_int, int_arg, optional_config_int

DEFAULT_MAX_BATCH = 512
# (layer, q [T, Hq, D], the forward's plan): what cache.attention shows an observer (a press)
AttentionObserver = Callable[[int, torch.Tensor, ForwardPlan], None]


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
        "pre" when there is a ``shift`` and the key codec prefers it (``Codec.pre_rope``),
        unless the shift is a rotary embedding and the codec can centre keys in its frame
        (``Codec.rotary_centre``: "post", see ``codecs.base.RotaryFrame``).
        A ``shift`` that is a :class:`~kvcache.protocol.RotaryShift` (``Rope``, or its bound
        ``shift`` / ``__call__``) is applied from cos/sin tables inside the attention kernels;
        any other callable makes keys stored before RoPE attend on the plain-torch path."""
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
        self.shift = _rotary_owner(shift)
        # the shift when it is a rotary embedding (its tables serve the kernels), else None;
        # checked once: a runtime Protocol check is too slow for every layer call
        self.rotary: RotaryShift | None = (
            self.shift if isinstance(self.shift, RotaryShift) else None
        )
        self.model_id: ModelId = ""  # which model's K/V this holds (snapshots check it)
        self.dtype = dtype
        self.device = torch.device(device)
        if self.device.type == "cpu" and dtype != torch.float64:
            # the kernels serve this cache's puts and attention: built (once per machine and
            # sources) or loaded now, not inside the first forward, which callers time
            build.extension()
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
        framed = self.rotary is not None and self.key_codec.rotary_centre
        if key_rope is None:
            pre = shift is not None and self.key_codec.pre_rope and not framed
            key_rope = "pre" if pre else "post"
        self.key_rope = key_rope
        frame = None
        if self.rotary is not None and framed and key_rope == "post":
            frame = RotaryFrame(self.cells.pos, self.rotary)
        self.storage = Storage(
            self.num_cells, dtype, self.device, self.key_codec, self.value_codec, frame
        )
        self._fwd: ForwardPlan | None = None
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [P, D/2]
        self._observers: list[AttentionObserver] = []  # presses watching the queries
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
        """Place the batch's tokens in free cells; the forward's plan serves every layer.

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
            self._fwd = ForwardPlan(self, positions, seqs, locs, True, (None, None))
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
            self._release(seq, cells)
            if seq not in batch_seqs and len(self.cells.cells_of(seq)) == 0:
                self._forget(seq)
        self.cells.occupy(free, positions, seqs)
        seals = self.storage.plan(self.cells, free, seqs)
        self._fwd = ForwardPlan(self, positions, seqs, free, False, seals)

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

    @property
    def plan(self) -> ForwardPlan:
        """The forward in progress (placement, visibility, masks), shared by every layer."""
        return self._forward()

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
        fwd.set_causal_rows(rows)

    def put(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, *, keys_rotated: bool = True
    ) -> None:
        """Store the batch's K/V ([T, kv_heads, head_dim] each) of one layer in its cells.
        ``keys_rotated=False``: ``key`` is given before RoPE (a model that asks
        ``key_rope == "pre"`` then skips rotating keys that the cache would only rotate
        back); a cache that stores keys after RoPE rotates them by their positions through
        its ``shift``."""
        fwd = self._forward()
        layer = int_arg("layer", layer)
        check_kv(key, value, len(fwd.positions))
        if not isinstance(keys_rotated, bool):
            raise InvalidArgumentError("keys_rotated", keys_rotated, "a bool")
        if not keys_rotated and self.shift is None:
            raise InvalidArgumentError(
                "keys_rotated", keys_rotated, "True: this cache has no shift to rotate keys with"
            )
        if fwd.reserve:
            self.storage.layer(layer, key, value)  # allocate only: reserve computes nothing
            return
        if self.key_rope == "pre" and keys_rotated:
            key = self._rotate(layer, key, fwd.negated_positions(), fwd.unrotation())
        elif self.key_rope == "post" and not keys_rotated:
            key = self._rotate(layer, key, fwd.positions_tensor(), fwd.rotation())
        self.storage.write(layer, fwd.cells_tensor(), key, value, fwd.seals)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The history range: keys [L, H, Dk], values [L, H, Dv], mask [T, L] (True = may
        attend); views of the cells for a float codec of the cache's dtype."""
        fwd = self._forward()
        layer = int_arg("layer", layer)
        if layer not in self.storage.layers:
            raise CallOrderError(f"layer {layer} has no storage yet: put(layer, ...) first")
        lo, hi = fwd.history()
        k, v = self.read(layer, slice(lo, hi))
        return k, v, fwd.mask()

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """put then get: the one call an attention layer that attends itself makes."""
        self.put(layer, key, value)
        return self.get(layer)

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        keys_rotated: bool = True,
    ) -> torch.Tensor:
        """Store this layer's ``k``, ``v`` [T, Hkv, D] and attend: out [T, Hq, Dv] in q's
        dtype, each row of ``q`` [T, Hq, D] over its own sequence's visible cells (query head
        hq reads KV head hq // (Hq / Hkv)); ``scale`` defaults to 1/sqrt(D). A row that sees
        nothing (a reserve forward) gives zeros. ``keys_rotated``: as in :meth:`put` (``q``
        is always given after RoPE)."""
        fwd = self._forward()
        _check_query(q, k, len(fwd.positions))
        self.put(layer, k, v, keys_rotated=keys_rotated)
        if fwd.reserve:
            return q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
        for observer in self._observers:
            observer(layer, q, fwd)
        s = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
        layouts = None if fwd.kernel_reason is not None else self.storage.layouts(layer)
        if layouts is None or layer_reason(q, v, *layouts) is not None:
            keys, values, mask = self.get(layer)
            return grouped_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, s)
        keys_l, values_l = layouts
        plan = fwd.attention_plan(int(k.shape[1]), torch.get_num_threads())
        pre = self.key_rope == "pre"
        tables = pre or keys_l.centre_rope
        out = attend(
            q,
            plan,
            keys_l,
            values_l,
            kv_heads=int(k.shape[1]),
            scale=s,
            pre_rope=pre,
            rope=self._kernel_rope(plan.max_pos, int(q.shape[2])) if tables else None,
        )
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def kernel_reason(self) -> str | None:
        """Why this cache's attention takes the plain-torch reference, not the kernels, for
        any layer (None: the kernels may serve it; kvcache.kernels.route decides)."""
        rotary = self.key_rope == "post" or self.rotary is not None
        return forward_reason(self.device, self.dtype, rotary)

    def _kernel_rope(self, max_pos: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 [P, D/2] for positions < P (P > max_pos), grown by doubling."""
        have = self._rope_tables
        if have is None or have[0].shape[0] <= max_pos:
            count = max(1024, 1 << (max_pos + 1).bit_length())
            assert self.rotary is not None
            cos, sin = self.rotary.tables(torch.arange(count), torch.float32)  # [P, 1, D]
            half = dim // 2
            have = (cos[:, 0, :half].contiguous(), sin[:, 0, half:].contiguous())
            self._rope_tables = have
        return have

    def _rotate(
        self,
        layer: int,
        keys: torch.Tensor,
        positions: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Keys [n, H, D] rotated by ``positions`` (from ``tables`` of a rotary shift)."""
        if self.rotary is not None and tables is not None:
            cos, sin = tables
            return self.rotary.rotate(keys, cos.to(keys.dtype), sin.to(keys.dtype))
        assert self.shift is not None, "keys stored before RoPE need a shift"
        return self.shift(layer, keys, positions).to(keys.dtype)

    def _forward(self) -> ForwardPlan:
        self._check_open()
        if self._fwd is None:
            raise CallOrderError("no forward in progress: call start_forward(batch) first")
        return self._fwd

    def add_observer(self, observer: AttentionObserver) -> None:
        """Show ``observer`` each layer's queries in ``attention`` (a press keeping what it
        scores with, e.g. SnapKV's last 64 query rows per sequence)."""
        self._check_open()
        if observer not in self._observers:
            self._observers.append(observer)

    def remove_observer(self, observer: AttentionObserver) -> None:
        """Stop showing ``observer`` the queries (no error if it was not added)."""
        if observer in self._observers:
            self._observers.remove(observer)

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
        self.storage.share(src, dst)
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
        self._drop_and_move(seq, gone, moved, begin - (end or begin), new_keys)

    def evict(
        self, seq: int, positions: Sequence[int] | np.ndarray, *, compact: bool = False
    ) -> int:
        """Drop ``seq``'s tokens at ``positions`` (a press's choice); returns the cells freed.

        Mask only (the default): the other tokens keep their positions, so the sequence
        goes on at ``next_position(seq)`` and attention simply no longer sees the dropped
        ones. Cells shared with other sequences (``copy_prefix``) stay alive for them; the
        fp16 recent windows and codec records follow (``kvcache.recent``). ``compact=True``
        then renumbers the survivors 0, 1, ... (keys re-rotated through ``shift``, or only
        renumbered when stored before RoPE), as a ``remove`` of every gap would.
        Raises InvalidArgumentError for a position ``seq`` does not hold or a repeat, and
        NotSupportedError (compact) without a shift or when a shared cell would move; a
        call that raises changes nothing.
        """
        self._check_open()
        seq = int_arg("seq", seq)
        gone = self._cells_at(seq, positions)
        cells = self.cells.ordered(seq)
        moved, offsets = cells[:0], np.zeros(0, dtype=np.int64)
        if compact:
            keep = cells[~np.isin(cells, gone)]  # by position
            offsets = np.arange(len(keep)) - self.cells.pos[keep]  # [k] new - old position
            moved, offsets = keep[offsets != 0], offsets[offsets != 0]
        new_keys = self._shifted_keys(seq, moved, offsets)
        free_before = self.cells.free_count()
        self._drop_and_move(seq, gone, moved, offsets, new_keys)
        return self.cells.free_count() - free_before

    def _drop_and_move(
        self,
        seq: int,
        gone: np.ndarray,
        moved: np.ndarray,
        offset: int | np.ndarray,
        new_keys: dict[int, torch.Tensor],
    ) -> None:
        """The mutation of remove / evict (validated before): ``seq`` drops ``gone``, then
        ``moved`` go ``offset`` positions further with their re-rotated keys."""
        self._release(seq, gone)
        self.cells.move(seq, moved, offset)
        moved_t = torch.from_numpy(moved).to(self.device)
        for layer, keys in new_keys.items():
            self.storage.rewrite_keys(layer, moved_t, keys)
        if len(self.cells.cells_of(seq)) == 0:
            self._forget(seq)
        self._fwd = None

    def _cells_at(self, seq: int, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """The cells holding ``seq``'s ``positions`` (each held, none repeated), or raise."""
        try:
            pos = np.asarray(positions)
        except (TypeError, ValueError):
            pos = np.zeros(1, dtype=object)
        if pos.ndim != 1 or (len(pos) and pos.dtype.kind not in "iu"):
            raise InvalidArgumentError("positions", positions, "a 1-D sequence of ints")
        pos = pos.astype(np.int64)
        if len(np.unique(pos)) != len(pos):
            raise InvalidArgumentError("positions", pos.tolist()[:8], "distinct positions")
        cells = self.cells.ordered(seq)
        stored = self.cells.pos[cells]  # ascending
        at = np.minimum(np.searchsorted(stored, pos), max(len(stored) - 1, 0))
        found = (stored[at] == pos) if len(stored) else np.zeros(len(pos), dtype=bool)
        if not found.all():
            raise InvalidArgumentError(
                "positions", pos[~found].tolist()[:8], f"positions stored for sequence {seq}"
            )
        return np.sort(cells[at])

    def _release(self, seq: int, cells: np.ndarray) -> None:
        """``seq`` stops using ``cells``; those nobody uses any more are freed in storage."""
        self.cells.release(seq, cells)
        self.storage.release(cells[self.cells.refs[cells] == 0])

    def _forget(self, seq: int) -> None:
        self.cells.forget(seq)
        self.storage.forget(seq)

    def _shifted_keys(
        self, seq: int, moved: np.ndarray, offset: int | np.ndarray
    ) -> dict[int, torch.Tensor]:
        """Re-rotated keys of the moved cells for every layer (by ``offset``, one for all or
        one per cell), computed before any mutation."""
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
        shifts = np.broadcast_to(np.asarray(offset, dtype=np.int64), moved.shape).copy()  # [n]
        if self.key_rope == "pre":
            return out  # stored un-rotated: the new positions are all that changes
        for layer, st in self.storage.layers.items():
            parts = []
            for i in range(0, len(moved), self.max_batch):
                idx = torch.from_numpy(moved[i : i + self.max_batch]).to(self.device)
                offsets = torch.from_numpy(shifts[i : i + self.max_batch]).to(self.device)
                keys = st.keys.decode(idx, self.dtype)  # [n, H, D], decoded
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

    # ---- snapshots (kvcache.snapshot) --------------------------------------------------
    def snapshot(
        self, seq: int, *, model_id: ModelId | None = None, tokens: Sequence[int] | None = None
    ) -> Snapshot:
        """``seq``'s cells exactly as stored (codes, fp16 window rows, positions), to restore
        later or elsewhere; ``model_id`` names the model (default: the cache's ``model_id``,
        which ``Llama.new_cache`` sets), ``tokens`` optionally each cell's token id. Changes
        nothing."""
        self._check_open()
        mid = self.model_id if model_id is None else model_id
        return take_snapshot(self, int_arg("seq", seq), mid, tokens)

    def restore(self, snapshot: Snapshot, seq: int, *, model_id: ModelId | None = None) -> None:
        """Write ``snapshot``'s cells, as they were stored, into free cells as ``seq`` (which
        must hold none). Raises SnapshotMismatchError (another model id, codec, key_rope,
        dtype, policy or layer shape), SnapshotCorruptError, CacheFullError; each changes
        nothing."""
        self._check_open()
        mid = self.model_id if model_id is None else model_id
        restore_snapshot(self, snapshot, int_arg("seq", seq), mid)
        self._fwd = None

    # ---- introspection ---------------------------------------------------------------
    def read(self, layer: int, cells: Locs) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K/V of ``cells`` (a LongTensor or a slice) of ``layer``, keys rotated for
        the cells' positions as the model wrote them: [n, H, Dk], [n, H, Dv] in ``dtype``
        (views of the storage for a float codec of that dtype and a slice)."""
        layer, cells, idx = self._read_args(layer, cells)
        return self._keys_read(layer, cells, idx), self.storage.read_values(layer, cells)

    def read_keys(self, layer: int, cells: Locs) -> torch.Tensor:
        """``read``'s keys alone, without decoding the values (what a press scoring keys
        reads): [n, H, Dk]."""
        return self._keys_read(*self._read_args(layer, cells))

    def read_values(self, layer: int, cells: Locs) -> torch.Tensor:
        """``read``'s values alone: [n, H, Dv]."""
        layer, cells, _ = self._read_args(layer, cells)
        return self.storage.read_values(layer, cells)

    def _keys_read(self, layer: int, cells: Locs, idx: np.ndarray) -> torch.Tensor:
        """Checked cells' keys, rotated for their positions when stored before RoPE."""
        keys = self.storage.read_keys(layer, cells)
        if self.key_rope == "pre":
            pos = torch.from_numpy(self.cells.pos[idx]).to(self.device)
            keys = self._rotate(layer, keys, pos, None)
        return keys

    def _read_args(self, layer: int, cells: Locs) -> tuple[int, Locs, np.ndarray]:
        """``read``'s checked layer, cells (int64 when a tensor) and cell ids."""
        self._check_open()
        layer = int_arg("layer", layer)
        if layer not in self.storage.layers:
            raise InvalidArgumentError("layer", layer, f"one of {sorted(self.storage.layers)}")
        if isinstance(cells, slice):
            lo, hi = cells.start or 0, cells.stop
            if not 0 <= lo <= hi <= self.num_cells:
                raise InvalidArgumentError("cells", cells, f"a slice of [0, {self.num_cells}]")
            return layer, cells, np.arange(lo, hi)
        cells = cells.to(torch.int64)
        idx = cells.cpu().numpy()
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.num_cells):
            raise InvalidArgumentError("cells", idx.tolist()[:8], f"cell ids < {self.num_cells}")
        return layer, cells, idx

    def layers(self) -> list[int]:
        """Layers that have storage (a put happened)."""
        return sorted(self.storage.layers)

    def layer_shapes(self, layer: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(kv_heads, head_dim) of ``layer``'s keys and of its values."""
        st = self.storage.layers.get(int_arg("layer", layer))
        if st is None:
            raise InvalidArgumentError("layer", layer, f"one of {sorted(self.storage.layers)}")
        return st.key_shape, st.value_shape

    def cells_of(self, seq: int) -> np.ndarray:
        """Cells held by ``seq``, in position order (a copy)."""
        return self.cells.ordered(int_arg("seq", seq)).copy()

    def next_position(self, seq: int) -> int:
        """One past the highest position stored for ``seq`` (0 when it holds nothing)."""
        return self.cells.max_pos.get(int_arg("seq", seq), -1) + 1

    def free_cells(self) -> int:
        """Cells no sequence uses."""
        return self.cells.free_count()

    def positions(self, seq: int) -> list[int]:
        """Sorted positions stored for ``seq``."""
        return self.cells.positions(int_arg("seq", seq))

    def sequences(self) -> list[int]:
        """Sequence ids that hold cells or an (empty) range."""
        return sorted(self.cells.ranges)

    def used_cells(self) -> int:
        return self.num_cells - self.cells.free_count()

    def memory_usage_bytes(self) -> int:
        """Bytes of K/V storage allocated: every buffer of every layer that has been put
        (codes, metadata, fp16 windows) and the windows' maps."""
        return self.storage.nbytes()

    def held_bytes(self, seq: int | None = None) -> int:
        """Bytes the cells in use hold (``seq``'s, or every sequence's): codes, per-row
        scales, fp16 window rows, and the codec records (key centres, KIVI group ranges)
        those cells use; what a press frees (``memory_usage_bytes`` is what is allocated)."""
        self._check_open()
        if seq is None:
            cells = np.flatnonzero(self.cells.refs > 0)
        else:
            cells = self.cells.cells_of(int_arg("seq", seq))
        return held_bytes(self.storage, cells)

    def close(self) -> None:
        """Free the storage; the cache cannot be used afterwards."""
        self.storage.layers.clear()
        self._fwd = None
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise CallOrderError("cache is closed: create a new one")


def _check_query(q: object, k: torch.Tensor, tokens: int) -> None:
    if not isinstance(q, torch.Tensor) or not q.is_floating_point() or q.dim() != 3:
        raise InvalidArgumentError("q", type(q).__name__, "a float tensor [T, Hq, D]")
    if q.shape[0] != tokens:
        raise DimensionMismatchError(tokens, q.shape[0], "q tokens (batch length)")
    if isinstance(k, torch.Tensor) and k.dim() == 3:
        if q.shape[1] % k.shape[1]:
            raise DimensionMismatchError(
                f"a multiple of kv_heads={k.shape[1]}", q.shape[1], "q heads"
            )
        if q.shape[2] != k.shape[2]:
            raise DimensionMismatchError(k.shape[2], q.shape[2], "q head_dim (= key's)")


def _rotary_owner(shift: ShiftFn | None) -> ShiftFn | None:
    """The RotaryShift itself when ``shift`` is its bound ``__call__`` (``rope.shift``), so
    the kernels see its tables; any other shift as given."""
    owner = getattr(shift, "__self__", None)
    func = getattr(shift, "__func__", None)
    if isinstance(owner, RotaryShift) and func is type(owner).__call__:
        return owner
    return shift

"""Hypothesis state machines: random forwards (reserve ones too) over several layers, remove,
copy_prefix and can_resume on a CausalCache, against the reference model of Ollama's rules
(``tests/reference/ollama_causal.py``) and, for quantized codecs, of their fp16 windows
(``tests/reference/recent_rows.py``).

After every forward: each batch row attends to exactly the reference's tokens (the mask),
every visible row of every layer is the reference's K/V within the codec's bound
(``tests/reference/codec_bounds.py``), and ``attention()`` equals a float64 softmax over the
reference's visible tokens within 1e-5 relative; a batch that does not fit raises
CacheFullError naming the reference's sizes. After every step: positions, used cells, cell
sharing, ``can_resume`` at every position, every stored row of every layer, which rows are in
fp16, ``memory_usage_bytes`` against what is stored, and the bookkeeping invariants
(``cells.check``, every window's ``check``). A failed call must leave all of that unchanged.

One machine per storage, each with a shift that is none, ``add_shift`` or RoPE: float (fp32 /
fp64, exact rows, the attention kernels for fp32), int8 sealing every row at once, int4 with
a 3-row window sealed 2 rows at a time, and KIVI-4 with a 64-row window (so short histories
go beyond the windows and rows really are encoded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcache import Batch, CausalCache
from kvcache.errors import CacheFullError, InvalidConfigError, NotSupportedError
from kvcache.models.rope import Rope
from reference.attention import softmax_attention
from reference.codec_bounds import (
    FP16,
    affine_error,
    fp16_error,
    grouped_error,
    int8_error,
    rotated_error,
)
from reference.ollama_causal import FULL, NOT_SUPPORTED, OllamaCausal, Token
from reference.recent_rows import RecentRows
from support import add_shift, scoring_query

SEQS = st.integers(0, 3)
ROLES = ("key", "value")
REL = 1e-5  # attention: max error / max |reference| (float32 kernels)
SHIFTS = ("none", "add", "rope")  # no shift, Ollama's test shift (key + offset), RoPE
ROTATION_ULPS = 32  # a float RoPE shift (cos/sin tables, rotate-half) is exact to this many ulps


@dataclass(frozen=True)
class Config:
    """What one machine draws from: its storage and the sizes that make it interesting."""

    codec: str | None  # CausalCache(codec=...); None: the float dtype itself
    kinds: tuple[str, str]  # how keys, values are stored: float, int8, int4, kivi4
    # role -> (rows, batch, group) of its fp16 windows (tests/reference/recent_rows.py)
    recent: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    shifts: tuple[str, ...] = ("none", "add")
    layers: int = 3
    heads: tuple[int, int, int] = (2, 2, 16)  # kv heads, query heads per kv head, head dim
    capacity: tuple[int, int] = (2, 10)
    window: tuple[int, int] = (0, 4)
    extra_memory: tuple[int, int] = (0, 3)
    chunk: tuple[int, int] = (1, 4)
    max_batch: tuple[int, int] = (1, 4)
    tokens: int = 3  # new tokens per sequence per forward, at most
    prefill: tuple[int, int] = (0, 6)  # setup's prompts for sequences 0 and 1, tokens
    removal: int = 4  # positions one remove drops, at most
    span: int = 12  # positions drawn by can_resume / reserve, lengths by copy_prefix


@dataclass
class Held:
    """The cache's held cells, ascending, paired with the reference's tokens."""

    cells: list[int]
    tokens: list[Token]  # the token in each cell
    positions: list[int]  # its position
    by_seq: dict[int, dict[int, int]]  # seq -> {cell: index into cells}
    index: dict[int, int]  # uid -> index into cells


class CausalMachine(RuleBasedStateMachine):
    """Drives one cache and the reference model side by side (see the module docstring)."""

    config: Config

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        # one torch thread: these tensors are tiny, and on shared cores every 2-thread parallel
        # region (an aminmax, an einsum) waits ~15 ms for the other thread (teardown restores)
        self.threads = torch.get_num_threads()
        self.steps = 0
        self.allocated = False  # a layer has been put (storage allocated)
        torch.set_num_threads(1)
        c = self.config
        sizes = self._draw_sizes(data)
        self.kv_heads, self.groups, self.dim = c.heads
        shift = data.draw(st.sampled_from(c.shifts), label="shift")
        self.shift = {"none": None, "add": add_shift, "rope": Rope(self.dim, 10000.0)}[shift]
        self.dtype = data.draw(st.sampled_from(c.dtypes), label="dtype")
        self.ref = OllamaCausal(**sizes, has_shift=self.shift is not None)
        self.cache = CausalCache(**sizes, shift=self.shift, dtype=self.dtype, codec=c.codec)
        assert self.cache.num_cells == self.ref.cells
        assert self.cache.memory == self.ref.memory
        self.recent = {
            role: RecentRows(*c.recent[role], records=(role, c.kinds[0]) == ("key", "int4"))
            for role in c.recent
        }
        seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
        self.gen = torch.Generator().manual_seed(seed)
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # uid -> K, V [L, H, D]
        self.slack: dict[int, torch.Tensor] = {}  # uid -> [L, H, D]: key re-encoding errors
        self.group_range: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # KIVI keys
        self.centre: dict[int, torch.Tensor] = {}  # int4 key record -> centre [L, H, D]
        self.centre_drift: dict[int, torch.Tensor] = {}  # record -> its error [L, H, D]
        self._changed()
        for seq in range(2):  # histories (beyond the codecs' windows) from the start
            n = data.draw(st.integers(*c.prefill), label="prefill")
            if n:
                self._forward(data, [(seq, p) for p in range(n)])

    def _draw_sizes(self, data: st.DataObject) -> dict:
        """capacity, max_sequences, max_batch, window, memory, chunk, padding; a memory below
        the window is drawn too, and must be refused."""
        c = self.config
        draw = data.draw
        sizes = {
            "capacity": draw(st.integers(*c.capacity), label="capacity"),
            "max_sequences": draw(st.integers(1, 3), label="max_sequences"),
            "max_batch": draw(st.integers(*c.max_batch), label="max_batch"),
            "window": draw(st.none() | st.integers(*c.window), label="window"),
            "chunk": draw(st.none() | st.integers(*c.chunk), label="chunk"),
            "padding": draw(st.integers(1, 3), label="padding"),
        }
        lowest, highest = c.extra_memory
        extra = draw(st.none() | st.integers(lowest - 2, highest), label="extra_memory")
        window = sizes["window"]
        if window is not None and extra is not None and extra < 0:
            # spec §3.2 step 6 "If M < W -> panic"; contract: a typed error naming memory
            with pytest.raises(InvalidConfigError, match="memory"):
                CausalCache(sizes["capacity"], window=window, memory=window + extra)
            extra = lowest
        sizes["memory"] = None if window is None or extra is None else window + extra
        return sizes

    # ---- rules -------------------------------------------------------------------------
    @rule(data=st.data(), seqs=st.lists(SEQS, min_size=1, max_size=3, unique=True))
    def forward(self, data: st.DataObject, seqs: list[int]) -> None:
        """Prompt chunks of several sequences, in any order, maybe after a gap."""
        batch: list[tuple[int, int]] = []
        for s in seqs:
            start = max(self.ref.positions(s), default=-1) + 1
            start += data.draw(st.integers(0, 2), label="gap")
            n = data.draw(st.integers(1, self.config.tokens), label="tokens")
            batch += [(s, p) for p in range(start, start + n)]
        self._forward(data, data.draw(st.permutations(batch), label="order"))

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """One next token for each of some sequences that hold tokens."""
        seqs = data.draw(st.lists(self._held_seq(), min_size=1, max_size=3, unique=True))
        self._forward(data, [(s, max(self.ref.positions(s), default=-1) + 1) for s in seqs])

    def _forward(self, data: st.DataObject, order: list[tuple[int, int]]) -> None:
        b = Batch([p for _, p in order], [s for s, _ in order])
        held = {s: len(toks) for s, toks in self.ref.seqs.items() if toks}
        new = self.ref.start_forward(order)
        if new == FULL:
            event("forward: cache full")
            with pytest.raises(CacheFullError) as full:
                self.cache.start_forward(b)
            # spec §2: "wrapped with the cache size and the batch size"
            got = (full.value.needed, full.value.free, full.value.capacity)
            assert got == (len(order), self.ref.free, self.ref.cells), got
            return
        assert not isinstance(new, str)
        self.cache.start_forward(b)
        self._changed()
        for s, n in held.items():
            if len(self.ref.seqs.get(s, {})) < n + sum(x == s for x, _ in order):
                event("forward: evicted")
            if not self.ref.seqs.get(s) and s not in b.sequences:  # evicted to nothing
                self._emptied(s)
        k, v, q = self._draw_kv(len(order))
        for i, token in enumerate(new):
            self.written[token.uid] = (k[:, i].double(), v[:, i].double())
            self.slack[token.uid] = torch.zeros(k.shape[0], self.kv_heads, self.dim).double()
        self._seal([s for s, _ in order])
        self._run_layers(data, order, k, v, q)

    @rule(data=st.data())
    def reserve(self, data: st.DataObject) -> None:
        """spec §3.4 "Reserve" (contract: no bookkeeping change, cells 0..T-1 for sizing only,
        put writes nothing): the machine's reference ignores it, so every later check also
        says the next real forward behaves as if it never happened."""
        most = min(self.ref.cells, 3 * self.config.tokens)  # a worst-case batch
        n = data.draw(st.integers(1, most), label="reserve tokens")
        token = st.tuples(SEQS, st.integers(0, self.config.span))
        order = data.draw(st.lists(token, min_size=n, max_size=n), label="reserve batch")
        self.cache.start_forward(Batch([p for _, p in order], [s for s, _ in order]), True)
        assert self.cache.plan.cells.tolist() == list(range(n))  # "Locations are 0..n-1"
        k, v, q = self._draw_kv(n)
        self._run_layers(data, order, k, v, q, reserve=True)

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        seq = data.draw(self._held_seq(), label="seq")
        stored = self.ref.positions(seq) or [0]
        first, last = stored[0], stored[-1]
        begin = data.draw(st.integers(max(0, first - 1), last + 1), label="begin")
        end = data.draw(
            st.sampled_from([None, min(last, begin + 1)])  # to the end; a middle that moves
            | st.integers(begin, begin + self.config.removal),
            label="end",
        )
        self._remove(seq, begin, None if end is None else max(end, begin))

    @rule(data=st.data())
    def close_gap(self, data: st.DataObject) -> None:
        """A middle range whose later tokens move down (their keys re-rotated)."""
        seq = data.draw(self._held_seq(), label="seq")
        stored = self.ref.positions(seq)
        if len(stored) < 2:
            return
        begin = data.draw(st.sampled_from(stored[:-1]), label="begin")
        end = data.draw(st.integers(begin + 1, stored[-1]), label="end")
        self._remove(seq, begin, end)

    def _remove(self, seq: int, begin: int, end: int | None) -> None:
        before = self._key_bounds_now() if self._rewrites_moved_keys() else {}
        moved = self.ref.remove(seq, begin, end)
        if moved == NOT_SUPPORTED:
            event("remove: not supported")
            with pytest.raises(NotSupportedError):
                self.cache.remove(seq, begin, end)
            return
        self.cache.remove(seq, begin, end)
        self._changed()
        if not self.ref.seqs.get(seq):
            self._emptied(seq)
        if moved:
            event("remove: keys moved")
        for token in moved:  # decoded, re-rotated in the cache's dtype and stored again
            if token.uid in before:  # the decoding error, carried through the shift
                self.slack[token.uid] = self._carried(token, before[token.uid])

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """A press's eviction: any subset of a sequence's positions, survivors unmoved."""
        seq = data.draw(self._held_seq(), label="seq")
        stored = self.ref.positions(seq)
        if not stored:
            return
        drop = data.draw(st.lists(st.sampled_from(stored), unique=True), label="evict")
        freed = self.cache.evict(seq, drop)
        assert freed == self.ref.evict(seq, drop), (freed, drop)
        self._changed()
        if not self.ref.seqs.get(seq):
            self._emptied(seq)

    @rule(dst=SEQS, data=st.data())
    def copy_prefix(self, dst: int, data: st.DataObject) -> None:
        src = data.draw(self._held_seq() | SEQS, label="src")
        length = data.draw(st.integers(0, self.config.span), label="length")
        self.cache.copy_prefix(src, dst, length)
        self.ref.copy_prefix(src, dst, length)
        self._changed()
        if src == dst and not self.ref.seqs.get(dst):  # copy_prefix(s, s, n) removes s's rest
            self._emptied(dst)
        elif src != dst:
            for window in self.recent.values():
                window.copy_prefix(src, dst)

    def _emptied(self, seq: int) -> None:
        """A remove or an eviction left ``seq`` with no token."""
        for window in self.recent.values():
            window.emptied(seq)

    def _held_seq(self) -> st.SearchStrategy[int]:
        """A sequence that holds tokens (any when none does)."""
        held = sorted(s for s, toks in self.ref.seqs.items() if toks)
        return st.sampled_from(held) if held else SEQS

    def teardown(self) -> None:
        event(f"steps: {getattr(self, 'steps', 0) // 5 * 5}+")
        if hasattr(self, "threads"):
            torch.set_num_threads(self.threads)

    # ---- invariants --------------------------------------------------------------------
    @invariant()
    def bookkeeping_matches(self) -> None:
        self.steps += 1
        self.cache.cells.check()
        for w in self.cache.storage.windows.values():
            w.check(self.cache.cells)
        for s in range(4):
            assert self.cache.positions(s) == self.ref.positions(s), s
        assert self.cache.used_cells() == self.ref.used_cells()

    @invariant()
    def memory_accounting(self) -> None:
        """``memory_usage_bytes`` counts what is stored (``kvcache.storage``): nothing before
        a layer's first put; a float codec's N rows per layer, preallocated; a quantizing
        codec at least its bytes per row for every encoded token and an fp16 row for every
        window token, and at most that for every cell (plus its records and the windows'
        maps): windows and codes never outgrow the pool."""
        got = self.cache.memory_usage_bytes()
        if not self.allocated:
            assert got == 0, f"{got} bytes before any put"
            return
        n, h, d = self.ref.cells, self.kv_heads, self.dim
        held = self._held().tokens
        low = high = 0
        for role in ROLES:
            codec = self.cache.key_codec if role == "key" else self.cache.value_codec
            if role not in self.recent:  # float rows, preallocated
                low += n * h * d * torch.finfo(self.dtype).bits // 8
                high += n * h * d * torch.finfo(self.dtype).bits // 8
                continue
            row, fp16_row = codec.bytes_per_row(h, d), h * d * 2
            sealed = sum(not self.recent[role].is_open(t) for t in held)
            low += sealed * row + (len(held) - sealed) * fp16_row
            high += n * (row + fp16_row) + (n + 16) * h * d * 2 * 2  # + centres / ranges
        layers = self.config.layers
        maps = 8 * n * len(self.cache.storage.windows)  # slot and record id per cell, int32
        assert layers * low <= got <= layers * high + maps, (
            f"memory_usage_bytes {got} outside [{layers * low}, {layers * high + maps}]"
        )

    @invariant()
    def can_resume_matches(self) -> None:
        """can_resume of every sequence at every position up to two past its end."""
        for s in range(4):
            end = max(self.ref.positions(s), default=0) + 3
            wrong = [
                p for p in range(end) if self.cache.can_resume(s, p) != self.ref.can_resume(s, p)
            ]
            assert not wrong, f"seq {s} {self.ref.positions(s)}: can_resume wrong at {wrong}"

    @invariant()
    def stored_rows_match(self) -> None:
        """Every stored row of every layer, and which rows are in fp16 per codec window."""
        held = self._held()
        cells = held.cells
        if not cells:
            return
        for role in self.recent:
            codec = self.cache.key_codec if role == "key" else self.cache.value_codec
            windows = self.cache.storage.windows_of(codec)
            assert windows is not None
            got = windows.open[cells].tolist()
            want = [self.recent[role].is_open(t) for t in held.tokens]
            assert got == want, f"{role} rows in fp16: cells {cells} got {got}, want {want}"
        at = torch.tensor(cells)
        for layer in range(self.config.layers):
            want = self._expected(layer, held)
            got = self.cache.read(layer, at)
            for i, role in enumerate(ROLES):
                _check_close(got[i], want[2 * i], want[2 * i + 1], f"layer {layer} {role}s")

    # ---- one forward's layers ----------------------------------------------------------
    def _draw_kv(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [L, T, H, D] (multiples of 1/16: exact in fp32 and under add_shift; keys with
        an offset channel, as real keys have) and queries [L, T, Hq, D]."""
        layers, h, d = self.config.layers, self.kv_heads, self.dim
        k = torch.randint(-64, 65, (layers, t, h, d), generator=self.gen) / 16.0
        k[..., 3] += 8.0
        v = torch.randint(-64, 65, (layers, t, h, d), generator=self.gen) / 16.0
        q = torch.randn(layers, t, h * self.groups, d, generator=self.gen) * 0.5
        return k.to(self.dtype), v.to(self.dtype), q.to(self.dtype)

    def _run_layers(
        self,
        data: st.DataObject,
        order: list[tuple[int, int]],
        k: torch.Tensor,
        v: torch.Tensor,
        q: torch.Tensor,
        reserve: bool = False,
    ) -> None:
        """Every layer, in a random order, through attention() or put(); then the mask, the
        visible rows (get) and the attention outputs against the reference."""
        exempt = data.draw(st.lists(st.integers(0, len(order) - 1), unique=True, max_size=2))
        if exempt:
            self.cache.set_causal(exempt)
        rows = [(s, p, i not in exempt) for i, (s, p) in enumerate(order)]
        outputs = {}
        self.allocated = True  # every layer is put below
        for layer in data.draw(st.permutations(range(self.config.layers)), label="layers"):
            if data.draw(st.booleans(), label="attention"):
                out = self.cache.attention(layer, q[layer], k[layer], v[layer])
                assert out.shape == q[layer].shape and out.dtype == self.dtype
                outputs[layer] = out
            else:
                self.cache.put(layer, k[layer], v[layer])
        lo, hi = self.cache.plan.history()
        if reserve:  # spec §3.4: "The history range is the whole cache"
            assert (lo, hi) == (0, self.cache.num_cells)
        held = self._held()
        visible = self._visibility(rows, held)
        mask = self.cache.get(0)[2]
        assert mask.shape == (len(order), hi - lo)
        self._check_mask(mask.numpy(), lo, rows, held, visible)
        seen = np.flatnonzero(visible.any(axis=0))  # tokens some row attends to
        at = torch.tensor([held.cells[i] - lo for i in seen], dtype=torch.int64)
        for layer in range(self.config.layers):
            keys, values, mask_l = self.cache.get(layer)
            assert torch.equal(mask_l, mask) and keys.shape[0] == hi - lo
            if not len(seen):
                continue
            want = [x[torch.from_numpy(seen)] for x in self._expected(layer, held)]
            _check_close(keys[at], want[0], want[1], f"visible keys, layer {layer}")
            _check_close(values[at], want[2], want[3], f"visible values, layer {layer}")
        for layer, out in outputs.items():
            if reserve:  # reserve graphs are only sized, never computed: zeros
                assert not out.any()
            else:
                self._check_attention(layer, q[layer], out, held, visible)

    def _visibility(self, rows: list, held: Held) -> np.ndarray:
        """[T, n] bool: row i attends to held token j, by the reference (spec §3.5)."""
        out = np.zeros((len(rows), len(held.cells)), dtype=bool)
        for i, (s, p, causal) in enumerate(rows):
            out[i, [held.index[t.uid] for t in self.ref.visible(s, p, causal)]] = True
        return out

    def _check_mask(
        self, mask: np.ndarray, lo: int, rows: list, held: Held, visible: np.ndarray
    ) -> None:
        """Row i of get()'s mask allows exactly the cells of its sequence's visible tokens."""
        for i, (s, p, causal) in enumerate(rows):
            mine = held.by_seq.get(s, {})
            cells = (lo + np.flatnonzero(mask[i])).tolist()
            other = [c for c in cells if c not in mine]
            assert not other, f"row {i} (seq {s} pos {p}) sees cells {other}, not seq {s}'s"
            got = np.zeros(len(held.cells), dtype=bool)
            got[[mine[c] for c in cells]] = True
            assert (got == visible[i]).all(), (
                f"row {i} (seq {s} pos {p} causal {causal}) sees positions "
                f"{[held.positions[j] for j in np.flatnonzero(got)]}, want "
                f"{[held.positions[j] for j in np.flatnonzero(visible[i])]}"
            )

    def _check_attention(
        self, layer: int, q: torch.Tensor, out: torch.Tensor, held: Held, visible: np.ndarray
    ) -> None:
        """attention() == a float64 softmax over each row's reference tokens, with the
        reference's own K/V (float storage), or, for codes, the rows decoded (checked against
        the reference within the codec's bound by ``stored_rows_match``); with 4-bit affine
        keys, of the query rounded to int16 steps, as the kernels score key codes."""
        if self.config.kinds == ("float", "float"):
            keys, _, values, _ = self._expected(layer, held)
        else:
            keys, values = (x.double() for x in self.cache.read(layer, torch.tensor(held.cells)))
        q = scoring_query(self.cache, q, q.shape[-1] ** -0.5)
        want = softmax_attention(q.double(), keys, values, torch.from_numpy(visible), self.groups)
        err = (out.double() - want).abs().max().item()
        assert err <= REL * want.abs().max().item() + 1e-12, f"layer {layer}: attention off {err}"

    # ---- the reference's rows ----------------------------------------------------------
    def _held(self) -> Held:
        """The cache's held cells paired with the reference's tokens by position: one token
        is one cell in every sequence that shares it, one cell holds one token."""
        token_at: dict[int, tuple[Token, int]] = {}  # cell -> token, position
        cell_of: dict[int, int] = {}  # uid -> cell
        for s, toks in self.ref.seqs.items():
            positions = self.cache.positions(s)
            assert positions == sorted(toks), (s, positions, sorted(toks))
            for c, p in zip(self.cache.cells_of(s).tolist(), positions, strict=True):
                assert cell_of.setdefault(toks[p].uid, c) == c, f"token {toks[p].uid} in 2 cells"
                assert token_at.setdefault(c, (toks[p], p))[0] is toks[p], f"cell {c}: 2 tokens"
        cells = sorted(token_at)
        index = {c: i for i, c in enumerate(cells)}
        by_seq = {
            s: {cell_of[t.uid]: index[cell_of[t.uid]] for t in toks.values()}
            for s, toks in self.ref.seqs.items()
        }
        tokens = [token_at[c][0] for c in cells]
        return Held(
            cells,
            tokens,
            [token_at[c][1] for c in cells],
            by_seq,
            {t.uid: i for i, t in enumerate(tokens)},
        )

    def _expected(self, layer: int, held: Held) -> tuple[torch.Tensor, ...]:
        """The held cells' K, K bound, V, V bound [n, H, D] (float64) for ``layer``
        (computed once per state of the reference: ``changed`` forgets them)."""
        key = (layer, tuple(held.cells))
        if key not in self.memo:
            self.memo[key] = self._expect(layer, held)
        return self.memo[key]

    def _changed(self) -> None:
        """The reference changed (a forward, remove or copy_prefix succeeded)."""
        self.memo: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def _expect(self, layer: int, held: Held) -> tuple[torch.Tensor, ...]:
        """See _expected: the written rows, keys moved by ``remove`` through the shift, the
        codec's errors allowed."""
        tokens = held.tokens
        key = torch.stack([self.written[t.uid][0][layer] for t in tokens])
        value = torch.stack([self.written[t.uid][1][layer] for t in tokens])
        if self.shift is not None:
            key = self.shift(layer, key, torch.tensor([t.moved for t in tokens]))
        pre = self.cache.key_rope == "pre"
        stored = self.shift(layer, key, -torch.tensor(held.positions)) if pre else key
        key_bound = self._stored_bound("key", layer, held, stored)
        if pre:  # read back rotated by position (float32 tables)
            key_bound = rotated_error(key_bound) + 1e-5
        slack = torch.stack([self.slack[t.uid][layer] for t in tokens])
        key_bound = key_bound + slack + slack.amax(dim=-1, keepdim=True) * 0.2
        value_bound = self._stored_bound("value", layer, held, value)
        return key, key_bound, value, value_bound

    def _stored_bound(self, role: str, layer: int, held: Held, x: torch.Tensor) -> torch.Tensor:
        """Error allowed on the held rows ``x`` [n, H, D] as the ``role`` codec stores them."""
        tokens = held.tokens
        kind = self.config.kinds[ROLES.index(role)]
        if kind == "float":
            return torch.zeros_like(x)
        window = self.recent[role]
        if kind == "int8":
            coded = int8_error(x)
        elif kind == "int4" and role == "key":  # centred by the sealing sequence's key centre
            centre, drift = self._centres(layer, tokens)
            coded = grouped_error(x - centre, 32, 15) + drift
        elif kind == "int4":
            coded = grouped_error(x, 32, 15)
        elif role == "key":  # kivi4: per channel over the group's rows
            none = (x[:1].expand(self.config.layers, -1, -1),) * 2  # open rows: no group
            ranges = [self.group_range.get(t.uid, none) for t in tokens]
            lo = torch.stack([r[0][layer] for r in ranges])
            hi = torch.stack([r[1][layer] for r in ranges])
            coded = affine_error(x, lo, hi, 15)
        else:  # kivi4 values: per row over 64 channels
            coded = grouped_error(x, 64, 15)
        is_open = torch.tensor([window.is_open(t) for t in tokens])[:, None, None]
        return fp16_error(x) + torch.where(is_open, 0.0, coded)

    def _centres(self, layer: int, tokens: list[Token]) -> tuple[torch.Tensor, torch.Tensor]:
        """The key centre each sealed token was encoded with [n, H, D] (zeros for open
        rows), and how far a centre computed from the cache's rows may be from it: the rows
        it averaged carry the fp16 rounding and a remove's re-rotation (half a step of a
        drift d each way)."""
        zero = torch.zeros(self.config.layers, self.kv_heads, self.dim, dtype=torch.float64)
        records = [self.recent["key"].record_of.get(t.uid) for t in tokens]
        centres = [zero if r is None else self.centre[r] for r in records]
        centre = torch.stack([c[layer] for c in centres])  # [n, H, D]
        spread = [zero if r is None else self.centre_drift[r] for r in records]
        drift = torch.stack([d[layer] for d in spread]).amax(dim=-1, keepdim=True)
        return centre, drift.expand_as(centre) / 15

    def _seal(self, batch_seqs: list[int]) -> None:
        """The reference windows after a forward; KIVI key groups remember their range,
        int4 key records their centre (``kvcache.codecs.ints``: "the mean of its rows when
        it first seals one", fp16)."""
        for role, window in self.recent.items():
            for seal in window.forward(self.ref.seqs, batch_seqs):
                event(f"{role} rows sealed")
                if role == "key" and seal.basis and seal.record is not None:
                    rows = torch.stack([self._stored_key(t) for t in seal.basis]).half().double()
                    self.centre[seal.record] = rows.mean(dim=0).half().double()  # [L, H, D]
                    slack = torch.stack([self.slack[t.uid] for t in seal.basis])
                    self.centre_drift[seal.record] = slack.amax(dim=0) + 4 * FP16 * (
                        rows.abs().amax(dim=0) + 1e-3
                    )
                if role == "key" and self.config.kinds[0] == "kivi4":
                    rows = torch.stack([self._stored_key(t) for t in seal.tokens]).half().double()
                    lo, hi = rows.amin(dim=0), rows.amax(dim=0)  # [L, H, D], fp16 first
                    for t in seal.tokens:
                        self.group_range[t.uid] = (lo, hi)

    def _stored_key(self, token: Token) -> torch.Tensor:
        """A token's key in every layer as the key codec stores it now [L, H, D]: as
        written, moved by ``remove`` through the shift, and un-rotated by its position
        when keys are stored before RoPE (then: the written key un-rotated by the position
        it was written at)."""
        key = self.written[token.uid][0]
        if self.shift is None:
            return key
        offset = token.moved
        if self.cache.key_rope == "pre":
            offset -= next(
                p for toks in self.ref.seqs.values() for p, t in toks.items() if t is token
            )
        return self.shift(0, key, torch.full((key.shape[0],), offset))

    def _rewrites_moved_keys(self) -> bool:
        """Keys stored after RoPE are decoded, re-rotated and stored again by a remove."""
        return self.cache.key_rope == "post" and self.shift is not None

    def _carried(self, token: Token, bound: torch.Tensor) -> torch.Tensor:
        """A moved key's error bound [L, H, D] after ``shift`` rotated its decoded row: a
        rotation mixes channel pairs, and computing it in the cache's dtype rounds (add_shift
        on multiples of 1/16 is exact)."""
        if not isinstance(self.shift, Rope):
            return bound
        row = self.written[token.uid][0].abs().amax(dim=-1, keepdim=True)  # [L, H, 1]
        rounding = 2 * row * ROTATION_ULPS * torch.finfo(self.dtype).eps
        return rotated_error(bound) + rounding

    def _key_bounds_now(self) -> dict[int, torch.Tensor]:
        """uid -> its key's error bound [L, H, D] before a remove re-encodes it."""
        held = self._held()
        if not held.cells:
            return {}
        layers = range(self.config.layers)
        bounds = torch.stack([self._expected(layer, held)[1] for layer in layers])
        return {t.uid: bounds[:, i] for i, t in enumerate(held.tokens)}


def _check_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs()
    bad = err > bound
    if bad.any():
        i = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements off, first {i}: got {got[i].item()}, "
            f"want {want[i].item()} +- {bound[i].item()}"
        )


def test_the_reference_gives_the_documented_examples():
    """The reference reproduces the worked examples of the spec (Ollama's tests), so the
    machines below compare the cache with Ollama's rules, not with a second guess."""

    def causal(capacity: int, window: int | None, memory: int | None, **kw: int) -> OllamaCausal:
        sizes = {"max_sequences": 1, "max_batch": 4, "chunk": None, "padding": 1} | kw
        return OllamaCausal(capacity, window=window, memory=memory, has_shift=True, **sizes)

    # spec §3.2: W = 1, 2 sequences, capacity 16, max batch 2 -> M = 2, N = 2*2 + 2 = 6
    swa = causal(16, 1, None, max_sequences=2, max_batch=2)
    assert (swa.memory, swa.cells) == (2, 6)
    assert causal(16, 4, 20).memory is None  # M >= capacity: unlimited
    # spec §3.10 TestCanResume (W = 4): 0..4 stored; a batch at 5 evicts 0
    ref = causal(16, 4, None)
    ref.start_forward([(0, p) for p in range(5)])
    assert [ref.can_resume(0, p) for p in range(7)] == [True] * 6 + [False]
    ref.start_forward([(0, 5)])
    assert ref.positions(0) == [1, 2, 3, 4, 5]
    assert [ref.can_resume(0, p) for p in range(8)] == [False] * 5 + [True, True, False]
    assert not ref.can_resume(1, 0)  # limited memory: an unknown sequence cannot resume
    # spec §3.10 TestCanResumeSWAMem (W = 4, M = 5): 0..6, then a batch at 7 evicts < 2
    ref = causal(16, 4, 5)
    ref.start_forward([(0, p) for p in range(7)])
    ref.start_forward([(0, 7)])
    assert [ref.can_resume(0, p) for p in range(8)] == [False] * 6 + [True, True]
    # spec §3.5: a window of W sees p - W .. p; a chunk of C sees its own chunk
    assert [p for p in range(6) if swa.may_attend(4, p)] == [3, 4]
    chunked = causal(16, None, None, chunk=3)
    assert [p for p in range(9) if chunked.may_attend(7, p)] == [6, 7]
    assert [p for p in range(9) if chunked.may_attend(7, p, causal=False)] == [6, 7, 8]
    # spec §3.11 TestRemove: Remove(0, 0, 1) moves seq 0's position 1 to 0 (offset -1)
    ref = causal(16, None, None, max_sequences=2)
    ref.start_forward([(0, 0), (0, 1), (1, 0), (1, 1)])
    assert ref.remove(0, 1, None) == []
    ref.start_forward([(0, 1), (1, 2)])
    moved = ref.remove(0, 0, 1)
    assert not isinstance(moved, str) and [t.moved for t in moved] == [-1]
    assert ref.positions(0) == [0] and ref.used_cells() == 4
    # spec §3.9 / §3.11: cells shared by copy_prefix cannot move
    ref.copy_prefix(1, 2, 3)
    assert ref.remove(1, 0, 1) == NOT_SUPPORTED and ref.positions(1) == [0, 1, 2]


def machine(name: str, config: Config, examples: int, steps: int) -> type:
    """A TestCase running ``CausalMachine`` on ``config``."""
    cls = type(name, (CausalMachine,), {"config": config})
    case = cls.TestCase
    case.settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    return case


def coded(codec: str, kind: str, windows: tuple[int, int, int, int], **sizes) -> Config:
    """A quantizing ``codec`` (``kind`` for keys and values) whose fp16 windows keep
    ``windows`` = (key rows, key batch, value rows, value batch); KIVI keys seal whole groups
    of 64 rows (their batch is the group)."""
    key_rows, key_batch, value_rows, value_batch = windows
    key_group = 64 if kind == "kivi4" else 1
    recent = {"key": (key_rows, key_batch, key_group), "value": (value_rows, value_batch, 1)}
    return Config(codec, (kind, kind), recent=recent, **sizes)


TestFloatCache = machine(
    "FloatMachine",
    Config(None, ("float", "float"), dtypes=(torch.float32, torch.float64), shifts=SHIFTS),
    150,
    20,
)
TestInt8Cache = machine(
    "Int8Machine",
    coded("int8:batch=1", "int8", (0, 1, 0, 1), shifts=SHIFTS, capacity=(2, 12), tokens=4),
    80,
    20,
)
TestInt4Cache = machine(
    "Int4Machine",
    coded(
        "int4:recent=3,batch=2",
        "int4",
        (3, 2, 3, 2),
        shifts=SHIFTS,
        heads=(2, 2, 64),  # two groups of 32 channels
        capacity=(4, 16),
        tokens=4,
        prefill=(3, 10),
    ),
    100,
    20,
)
# the smallest KIVI window (one 64-row group); values sealed 32 at a time (the default batch)
TestKivi4Cache = machine(
    "Kivi4Machine",
    coded(
        "kivi4:residual=64",
        "kivi4",
        (64, 64, 64, 32),
        shifts=("none", "rope"),  # keys stored before RoPE (add_shift would store key - pos)
        layers=2,
        heads=(1, 2, 32),
        capacity=(200, 320),
        window=(130, 250),
        extra_memory=(0, 40),
        chunk=(32, 100),
        max_batch=(8, 64),
        tokens=70,
        prefill=(90, 200),
        removal=40,
        span=320,
    ),
    30,
    12,
)

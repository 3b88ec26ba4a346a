"""Hypothesis state machine: random start_forward / put / remove / copy_prefix / can_resume
against a tiny pure-Python model of the cache rules (a dict of tokens per sequence).

After every step: each batch row attends to exactly the (key, value) rows the reference says,
stored positions match, used cells equal the distinct tokens alive, and the cell bookkeeping
invariants hold.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache import Batch, CausalCache
from kvcache.errors import CacheFullError, NotSupportedError
from support import add_shift

SEQS = st.integers(0, 3)


@dataclass
class Token:
    uid: int  # identity of the stored token (one cell)
    key: float  # current key (shift adds offsets to it)


class Reference:
    """The rules of the foundation issue, written as plainly as possible."""

    def __init__(self, capacity, max_sequences, max_batch, window, memory, chunk, padding):
        self.window, self.chunk = window, chunk
        m = None
        if window is not None:
            m = window if memory is None else memory
            if max_sequences > 1:
                m = max(m, window + 1)
            if m >= capacity:
                m = None
        self.memory = m
        n = max_sequences * capacity if m is None else max_sequences * m + max_batch
        self.cells = -(-n // padding) * padding
        self.seqs: dict[int, dict[int, Token]] = {}

    def alive(self, seqs=None) -> set[int]:
        source = self.seqs if seqs is None else seqs
        return {t.uid for toks in source.values() for t in toks.values()}

    def after_eviction(self, batch: list[tuple[int, int]]) -> dict[int, dict[int, Token]]:
        if self.memory is None:
            return {s: dict(t) for s, t in self.seqs.items()}
        out = {}
        for s, toks in self.seqs.items():
            mine = [p for q, p in batch if q == s]
            lowest = min(mine) if mine else max(toks, default=-1) + 1
            out[s] = {p: t for p, t in toks.items() if p >= lowest - self.memory}
        return out

    def visible(self, s: int, p: int, causal: bool = True) -> set[tuple[float, int]]:
        seen = set()
        for q, t in self.seqs.get(s, {}).items():
            ok = (q <= p or not causal) and (self.window is None or q >= p - self.window)
            ok = ok and (self.chunk is None or q >= p - p % self.chunk)
            if ok:
                seen.add((t.key, t.uid))
        return seen

    def can_resume(self, s: int, p: int) -> bool:
        if self.memory is None:
            return True
        toks = self.seqs.get(s, {})
        if not toks:
            return False
        return max(0, p - (self.window or 0)) >= min(toks) and p <= max(toks) + 1

    def shared(self, s: int, uid: int) -> bool:
        return any(t.uid == uid for o, toks in self.seqs.items() if o != s for t in toks.values())


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(2, 8),
        max_sequences=st.integers(1, 3),
        max_batch=st.integers(1, 4),
        window=st.none() | st.integers(0, 4),
        extra_memory=st.none() | st.integers(0, 3),
        chunk=st.none() | st.integers(1, 4),
        padding=st.integers(1, 3),
        with_shift=st.booleans(),
    )
    def setup(
        self, capacity, max_sequences, max_batch, window, extra_memory, chunk, padding, with_shift
    ):
        memory = None if window is None or extra_memory is None else window + extra_memory
        self.ref = Reference(capacity, max_sequences, max_batch, window, memory, chunk, padding)
        self.cache = CausalCache(
            capacity,
            max_sequences=max_sequences,
            max_batch=max_batch,
            window=window,
            memory=memory,
            chunk=chunk,
            padding=padding,
            shift=add_shift if with_shift else None,
            dtype=torch.float64,
        )
        self.uids = itertools.count(1)
        assert self.cache.num_cells == self.ref.cells

    @rule(data=st.data(), seqs=st.lists(SEQS, min_size=1, max_size=3, unique=True))
    def forward(self, data, seqs):
        batch: list[tuple[int, int]] = []
        for s in seqs:
            stored = self.ref.seqs.get(s, {})
            start = max(stored, default=-1) + 1 + data.draw(st.integers(0, 2), label="gap")
            n = data.draw(st.integers(1, 3), label="tokens")
            batch += [(s, p) for p in range(start, start + n)]
        order = data.draw(st.permutations(batch), label="order")
        kept = self.ref.after_eviction(order)
        fits = len(self.ref.alive(kept)) + len(order) <= self.ref.cells
        b = Batch([p for _, p in order], [s for s, _ in order])
        if not fits:
            try:
                self.cache.start_forward(b)
            except CacheFullError:
                return
            raise AssertionError(f"expected CacheFullError for {order}")
        self.cache.start_forward(b)
        self.ref.seqs = {s: t for s, t in kept.items() if t}
        new = [Token(next(self.uids), 0.0) for _ in order]
        for tok, (s, p) in zip(new, order, strict=True):
            tok.key = float(tok.uid * 100)
            self.ref.seqs.setdefault(s, {})[p] = tok
        k = torch.zeros(len(order), 1, 2, dtype=torch.float64)
        k[:, 0, 0] = torch.tensor([t.key for t in new], dtype=torch.float64)
        v = torch.zeros_like(k)
        v[:, 0, 1] = torch.tensor([float(t.uid) for t in new], dtype=torch.float64)
        keys, values, mask = self.cache.update(0, k, v)
        causal = data.draw(st.booleans(), label="causal")
        if not causal:
            self.cache.set_causal([0])
            _, _, mask = self.cache.get(0)
        for i, (s, p) in enumerate(order):
            got = {
                (keys[j, 0, 0].item(), int(values[j, 0, 1].item()))
                for j in torch.nonzero(mask[i]).flatten().tolist()
            }
            assert got == self.ref.visible(s, p, causal or i != 0), (i, s, p)

    @rule(data=st.data(), seq=SEQS, length=st.none() | st.integers(0, 4))
    def remove(self, data, seq, length):
        stored = sorted(self.ref.seqs.get(seq, {})) or [0]
        begin = data.draw(st.integers(max(0, stored[0] - 1), stored[-1] + 1), label="begin")
        end = None if length is None else begin + length
        toks = self.ref.seqs.get(seq, {})
        moving = [p for p in toks if end is not None and end > begin and p >= end]
        blocked = moving and (
            self.cache.shift is None or any(self.ref.shared(seq, toks[p].uid) for p in moving)
        )
        if blocked:
            try:
                self.cache.remove(seq, begin, end)
            except NotSupportedError:
                return
            raise AssertionError("expected NotSupportedError")
        self.cache.remove(seq, begin, end)
        out = {}
        for p, t in toks.items():
            if end is None and p >= begin or end is not None and begin <= p < end:
                continue
            if p in moving:
                t.key -= end - begin
                p -= end - begin
            out[p] = t
        self.ref.seqs[seq] = out

    @rule(src=SEQS, dst=SEQS, length=st.integers(0, 10))
    def copy_prefix(self, src, dst, length):
        self.cache.copy_prefix(src, dst, length)
        self.ref.seqs[dst] = {p: t for p, t in self.ref.seqs.get(src, {}).items() if p < length}

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(seq=SEQS, pos=st.integers(0, 12))
    def can_resume(self, seq, pos):
        assert self.cache.can_resume(seq, pos) == self.ref.can_resume(seq, pos)

    @invariant()
    def bookkeeping_matches(self):
        if not hasattr(self, "cache"):
            return
        self.cache.cells.check()
        for s in range(4):
            assert self.cache.positions(s) == sorted(self.ref.seqs.get(s, {})), s
        assert self.cache.used_cells() == len(self.ref.alive())


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=300,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

"""Ollama's ``kvcache.Causal`` as a dict of tokens per sequence: the rules the cell cache must
follow, written from the documents, not from ``kvcache.causal``.

Sources, cited on each rule:

* "spec §N": ``shared/reference/ollama_kvcache.md`` (Ollama's package, in prose).
* "contract": the foundation issue (#2, section 2), binding where it differs from Ollama:
  failed calls change nothing (Ollama evicts before it finds the batch full, and rewrites
  metadata before a remove fails), ``copy_prefix(s, s, n)`` keeps s's positions < n (Ollama
  wipes s), unlimited is spelled ``None`` (Ollama's ``0``), so ``window=0`` is read literally
  by the mask rule ``pos >= p - window`` (a token sees itself only).

The model knows tokens, not cells: a cell is a :class:`Token` object, shared between
sequences by ``copy_prefix`` (two dicts hold the same object). Placement (which cell) is
free for the cache to choose (any placement that keeps these semantics is allowed), so
only the number of free cells matters here. K/V data lives with the caller, keyed by
``Token.uid``; ``Token.moved`` is how far ``remove`` has shifted the token (its key has
been re-rotated by that many positions).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

FULL = "cache full"  # start_forward: not enough free cells (CacheFullError)
NOT_SUPPORTED = "not supported"  # remove: needs a shift / moves a shared cell (NotSupportedError)


@dataclass(eq=False)
class Token:
    """One stored token (= one cell): an identity and the offset remove has applied."""

    uid: int
    moved: int = 0


def normalised_memory(
    window: int | None, memory: int | None, max_sequences: int, capacity: int
) -> int | None:
    """The memory the cache keeps per sequence (None = never evict): spec §3.2 steps 2-5."""
    if window is None:  # spec §3.1 NewCausalCache: unlimited window, unlimited memory
        return None
    m = window if memory is None else memory  # step 3: "M = 0 -> M = W" (contract: None)
    if max_sequences > 1:  # step 4: one extra cell keeps the stop token of a parallel slot
        m = max(m, window + 1)
    if m >= capacity:  # step 5: "M >= capacity -> M = unlimited", eviction disabled
        return None
    return m


def number_of_cells(
    capacity: int, max_sequences: int, max_batch: int, memory: int | None, padding: int
) -> int:
    """spec §3.2 step 7 (and contract "Cells"): per sequence capacity, or memory + a batch."""
    unlimited = memory is None
    n = max_sequences * capacity if unlimited else max_sequences * memory + max_batch
    while n % padding:  # "rounded up to a multiple of CachePadding"
        n += 1
    return n


class OllamaCausal:
    """The cache's observable state: ``seqs[s][pos]`` is the token s holds at position pos."""

    def __init__(
        self,
        capacity: int,
        *,
        max_sequences: int,
        max_batch: int,
        window: int | None,
        memory: int | None,
        chunk: int | None,
        padding: int,
        has_shift: bool,
    ) -> None:
        self.window, self.chunk, self.has_shift = window, chunk, has_shift
        self.memory = normalised_memory(window, memory, max_sequences, capacity)
        self.cells = number_of_cells(capacity, max_sequences, max_batch, self.memory, padding)
        self.seqs: dict[int, dict[int, Token]] = {}
        self.free = self.cells  # free cells after the last start_forward's eviction
        self._uids = itertools.count(1)

    # ---- what is stored ----------------------------------------------------------------
    def tokens(self) -> list[Token]:
        """Every stored token once (a shared token is one cell)."""
        seen: dict[int, Token] = {}
        for toks in self.seqs.values():
            for t in toks.values():
                seen[t.uid] = t
        return list(seen.values())

    def used_cells(self) -> int:
        return len(self.tokens())

    def positions(self, seq: int) -> list[int]:
        return sorted(self.seqs.get(seq, {}))

    # ---- start_forward -----------------------------------------------------------------
    def start_forward(self, batch: list[tuple[int, int]]) -> list[Token] | str:
        """Evict, then place ``batch`` [(seq, pos)]: the new tokens in batch order, or FULL
        (and nothing changed: contract "Placement", a failed start_forward changes nothing)."""
        kept = self._after_eviction(batch)
        alive = {t.uid for toks in kept.values() for t in toks.values()}
        self.free = self.cells - len(alive)  # what the batch could have had
        if len(batch) > self.free:  # spec §3.4 step 3: fewer free cells than tokens
            return FULL
        self.seqs = {s: toks for s, toks in kept.items() if toks}
        new = []
        for seq, pos in batch:  # spec §3.4 step 4: each token gets a cell of its own
            token = Token(next(self._uids))
            self.seqs.setdefault(seq, {})[pos] = token
            new.append(token)
        return new

    def _after_eviction(self, batch: list[tuple[int, int]]) -> dict[int, dict[int, Token]]:
        """spec §3.4 step 2, limited memory only: every sequence (in the batch or not) drops
        its positions < lowest - M, lowest = its smallest position in the batch, or, not in
        the batch, its largest stored position + 1."""
        out = {s: dict(toks) for s, toks in self.seqs.items()}
        if self.memory is None:  # "Unlimited memory: ... Nothing is evicted."
            return out
        for seq, toks in out.items():
            mine = [pos for s, pos in batch if s == seq]
            lowest = min(mine) if mine else max(toks, default=-1) + 1
            for pos in list(toks):
                if pos < lowest - self.memory:
                    del toks[pos]
        return out

    # ---- masks -------------------------------------------------------------------------
    def may_attend(self, row_pos: int, pos: int, causal: bool = True) -> bool:
        """Whether a row at ``row_pos`` may attend to its own sequence's token at ``pos``:
        spec §3.5 rules 2-4 (rule 1, same sequence, is the caller's lookup). ``causal=False``
        is a set_causal exemption (spec §3.8: only rule 2 is switched off)."""
        if causal and pos > row_pos:  # rule 2: no future positions
            return False
        if self.chunk is not None and pos < row_pos - row_pos % self.chunk:  # rule 3
            return False
        # rule 4: a window W sees p - W .. p, W + 1 tokens (contract: window 0 sees itself)
        return self.window is None or pos >= row_pos - self.window

    def visible(self, seq: int, row_pos: int, causal: bool = True) -> list[Token]:
        """The tokens a batch row (seq, row_pos) attends to, by position."""
        toks = self.seqs.get(seq, {})
        return [toks[p] for p in sorted(toks) if self.may_attend(row_pos, p, causal)]

    # ---- sequence operations -----------------------------------------------------------
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """spec §3.9: dst drops every cell, then shares src's tokens with pos < length (no
        copy). contract: copy_prefix(s, s, n) keeps s's positions < n."""
        shared = {p: t for p, t in self.seqs.get(src, {}).items() if p < length}
        self.seqs[dst] = shared

    def remove(self, seq: int, begin: int, end: int | None) -> list[Token] | str:
        """Drop positions [begin, end) of seq (end None: to the end); later positions move
        down by end - begin. Returns the moved tokens, or NOT_SUPPORTED (nothing changed)."""
        toks = self.seqs.get(seq, {})
        offset = 0 if end is None else begin - end  # spec §3.11 step 1
        moving = [p for p in toks if end is not None and p >= end and offset != 0]
        if moving:
            # spec §3.11 step 2: a cell that must move may not be shared with another sequence
            shared = {t.uid for s, other in self.seqs.items() if s != seq for t in other.values()}
            if any(toks[p].uid in shared for p in moving):
                return NOT_SUPPORTED
            # spec §3.11 step 4: moving keys needs a shift function (contract: only when a
            # token actually moves; Ollama also fails when nothing is after end)
            if not self.has_shift:
                return NOT_SUPPORTED
        out: dict[int, Token] = {}
        moved = []
        for pos, token in toks.items():
            if pos >= begin and (end is None or pos < end):
                continue  # dropped (shared cells are fine here, spec §3.11 step 2)
            if pos in moving:
                token.moved += offset  # re-rotated through shift by `offset` positions
                pos += offset
                moved.append(token)
            out[pos] = token
        self.seqs[seq] = out
        return moved

    def evict(self, seq: int, positions: list[int]) -> int:
        """A press's eviction (mask only, kvcache.press): ``seq`` stops holding the tokens at
        ``positions``; the others keep their positions, and a token another sequence still
        holds stays stored. Returns the cells freed (tokens nobody holds any more)."""
        before = self.used_cells()
        toks = self.seqs.get(seq, {})
        self.seqs[seq] = {p: t for p, t in toks.items() if p not in set(positions)}
        return before - self.used_cells()

    def can_resume(self, seq: int, pos: int) -> bool:
        """spec §3.10 (and contract): can a token at ``pos`` be processed from what is
        still stored? Everything it attends to (its window, W not M) must still be stored and
        it may be at most one past the end; gaps are not checked."""
        if self.memory is None:  # nothing is ever evicted: always, even for unknown seqs
            return True
        stored = self.seqs.get(seq, {})
        if not stored:  # "no range, or no cells"
            return False
        assert self.window is not None, "limited memory implies a window (spec §3.2)"
        oldest_needed = max(0, pos - self.window)
        return min(stored) <= oldest_needed and pos <= max(stored) + 1

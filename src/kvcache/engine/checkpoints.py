"""How a prefix hit resumes a holder's state: shared cells (full attention), or the global
layers' cells shared and the local layers restored from a checkpoint (hybrid models).

A sliding window forgets: after a forward a sequence's local-layer cells are only its last
``window`` (+ the forward's) positions, so a holder's live local cells cannot serve a hit
that lies before its end. A hit at ``L`` needs the local cells of ``[L - window, L)`` only
(vLLM's rule for hybrid models); each sequence keeps a bounded ring of checkpoints, copies
of its local cells taken after a forward (llama.cpp's context checkpoints, Ollama's ring).
A checkpoint of cells ``[a, b)`` serves every resume point ``p`` with ``max(0, p - window)
>= a`` and ``p <= b``; the hit resumes at the largest such ``p <= L`` (the global layers
shared up to ``p``) and computes what follows::

    positions       0 ........ a ........ p=L ... b
    checkpoint                 [ local cells      ]      window before p held: served
    global (shared) [ cells 0 .. p                ]

A checkpoint whose cells start after ``p - window`` (taken after the window moved past the
hit) is never used: the hit resumes at an older one, or, with none, computes everything
and records the miss reason "no_checkpoint".
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvcache.snapshot import HybridSnapshot, Snapshot

if TYPE_CHECKING:
    from kvcache.causal import CausalCache
    from kvcache.wrapper import HybridCache


class SharedCells:
    """Full attention: a holder's cells are the prefix itself, shared (nothing copied)."""

    restores = 0  # shared cells need no restore

    def __init__(self, cache: CausalCache) -> None:
        self.cache = cache

    def can_resume(self, holder: int, tokens: int) -> bool:
        return self.cache.can_resume(holder, tokens)

    def resume(self, holder: int, seq: int, tokens: int) -> tuple[int, str | None]:
        """Share ``holder``'s first ``tokens`` positions with ``seq``; (positions, None)."""
        self.cache.copy_prefix(holder, seq, tokens)
        return tokens, None

    def after_forward(self, seq: int, fed: int, chunk: bool) -> None:
        return None

    def released(self, seq: int, kept: int) -> None:
        return None

    def drop(self, seq: int) -> None:
        return None

    def clear(self) -> None:
        return None

    def adopted(self, seq: int, snapshot: object) -> None:
        return None

    def session(self, holder: int, tokens: list[int], tmp: int) -> Snapshot:
        """``holder``'s first ``len(tokens)`` positions as a session snapshot (through the
        unused sequence ``tmp``, which shares them and is freed)."""
        self.cache.copy_prefix(holder, tmp, len(tokens))  # shares cells, copies nothing
        try:
            return self.cache.snapshot(tmp, tokens=tokens)
        finally:
            self.cache.remove(tmp, 0)

    def count(self) -> int:
        return 0

    def nbytes(self) -> int:
        return 0


class LocalCheckpoints:
    """Hybrid caches: a ring of local-layer checkpoints per sequence (module docstring)."""

    def __init__(self, cache: HybridCache, size: int, every: int) -> None:
        """``size``: checkpoints a sequence keeps (the oldest go); ``every``: a decode step
        takes one when the sequence's length is a multiple of it (prompt chunks always do)."""
        self.cache = cache
        self.size = size
        self.every = every
        self.rings: dict[int, deque[Snapshot]] = {}
        self.restores = 0

    def can_resume(self, holder: int, tokens: int) -> bool:
        """The global layers hold every position: whether a checkpoint fits is ``resume``'s."""
        return self.cache.full.can_resume(holder, tokens)

    def best(self, holder: int, tokens: int) -> tuple[int, Snapshot | None]:
        """The largest resume point <= ``tokens`` a checkpoint of ``holder`` serves, and it."""
        found: tuple[int, Snapshot | None] = (0, None)
        for ck in self.rings.get(holder, ()):
            p = min(tokens, ck.positions[-1] + 1)
            if p > found[0] and ck.resumes(p):
                found = (p, ck)
        return found

    def resume(self, holder: int, seq: int, tokens: int) -> tuple[int, str | None]:
        """Global layers shared up to the best checkpoint's point, local layers restored from
        it; (positions resumed, why not all ``tokens``: None, "checkpoint_behind",
        "no_checkpoint")."""
        p, ck = self.best(holder, tokens)
        if ck is None:
            return 0, "no_checkpoint"
        self.cache.full.copy_prefix(holder, seq, p)
        self.cache.local.remove(seq, 0)
        self.cache.local.restore(ck.window_before(p), seq)  # what the local part keeps
        self.restores += 1
        return p, None if p == tokens else "checkpoint_behind"

    def after_forward(self, seq: int, fed: int, chunk: bool) -> None:
        """Checkpoint ``seq``'s local cells after a prompt chunk or every ``every`` positions."""
        if not chunk and fed % self.every:
            return
        if not len(self.cache.local.cells_of(seq)):
            return
        ring = self.rings.setdefault(seq, deque(maxlen=self.size))
        ring.append(self.cache.local.snapshot(seq))

    def released(self, seq: int, kept: int) -> None:
        """``seq`` became an idle holder of ``kept`` positions: its live local cells go (its
        checkpoints serve hits), and so do checkpoints that serve no point <= ``kept``."""
        self.cache.local.remove(seq, 0)
        ring = self.rings.get(seq)
        if ring is None:
            return
        left = [ck for ck in ring if ck.resumes(min(kept, ck.positions[-1] + 1))]
        if kept == 0 or not left:
            del self.rings[seq]
        else:
            self.rings[seq] = deque(left, maxlen=self.size)

    def drop(self, seq: int) -> None:
        """``seq``'s positions changed or went: its checkpoints no longer describe it."""
        self.rings.pop(seq, None)

    def clear(self) -> None:
        self.rings.clear()

    def adopted(self, seq: int, snapshot: object) -> None:
        """``seq`` was restored from a hybrid snapshot: its local part is its checkpoint."""
        assert isinstance(snapshot, HybridSnapshot), f"not a hybrid snapshot: {snapshot!r}"
        self.rings[seq] = deque([snapshot.local], maxlen=self.size)

    def session(self, holder: int, tokens: list[int], tmp: int) -> HybridSnapshot | None:
        """``holder``'s global cells up to its best checkpoint's point within ``tokens``, with
        that checkpoint (None: no checkpoint serves any point); ``tmp`` as SharedCells'."""
        p, ck = self.best(holder, len(tokens))
        if ck is None:
            return None
        full = self.cache.full
        full.copy_prefix(holder, tmp, p)  # shares cells, copies nothing
        try:
            return HybridSnapshot(full.snapshot(tmp, tokens=tokens[:p]), ck.head_before(p))
        finally:
            full.remove(tmp, 0)

    def count(self) -> int:
        return sum(len(r) for r in self.rings.values())

    def nbytes(self) -> int:
        """Bytes the checkpoints hold."""
        return sum(ck.nbytes() for r in self.rings.values() for ck in r)

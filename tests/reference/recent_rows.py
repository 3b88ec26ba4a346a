"""Which rows a quantizing codec keeps in fp16, as a set of encoded tokens.

Documented rule (docs/guide/codecs.md: each sequence keeps its newest 128 rows in fp16;
``kvcache.recent``'s and ``kvcache.codecs``' docstrings:
"every quantizing codec seals a sequence's rows 32 at a time", ``"int4:recent=4,batch=2"``,
``"int8:batch=1"`` and ``"kivi4:residual=64"`` resize them):

* each sequence keeps its newest ``recent`` not-yet-encoded rows (by position) in fp16;
* a forward encodes ("seals") the rows it pushes out of the windows of the sequences in its
  batch, oldest first, only whole ``batch``es of rows of one sequence (so a window holds
  ``recent`` to ``recent + batch - 1`` rows), the sequences in the order they first appear
  in the batch; rows sealed together form groups of ``group`` (KIVI keys: 64 rows share one
  per-channel range; ``batch`` is then ``group``);
* an encoded row stays encoded (a remove or an eviction never reopens one), and a row shared
  by ``copy_prefix`` is sealed by whichever sequence pushes it out first;
* with ``records`` (int4 keys: a key centre per sequence), a sequence gets a record when it
  first seals a row: the mean of the fp16 rows it then holds open (its window and the
  forward's new rows); a row is encoded with the record of the sequence that seals it.
  ``copy_prefix`` hands src's record to dst (dst continues src; dst's own goes), and a
  sequence that a remove or an eviction leaves with no row loses its record.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from reference.ollama_causal import Token


@dataclass
class Seal:
    """Rows encoded together by one sequence in one forward."""

    tokens: list[Token]  # by position
    record: int | None  # the record they are encoded with (None: the codec keeps none)
    basis: list[Token]  # a new record's rows (empty: the record existed already)


class RecentRows:
    """The fp16 windows of one codec (keys or values): which tokens are encoded, in which
    group, with which record."""

    def __init__(self, recent: int, batch: int = 1, group: int = 1, records: bool = False):
        assert batch % group == 0, f"batch {batch} is not whole groups of {group}"
        self.recent, self.batch, self.group, self.records = recent, batch, group, records
        self.group_of: dict[int, int] = {}  # uid of an encoded token -> its group id
        self.record_of: dict[int, int | None] = {}  # uid of an encoded token -> its record
        self.seq_record: dict[int, int] = {}  # sequence -> its record
        self._ids = itertools.count()

    def is_open(self, token: Token) -> bool:
        """Whether the token's row is still in fp16 (exact up to fp16 rounding)."""
        return token.uid not in self.group_of

    def forward(self, seqs: dict[int, dict[int, Token]], batch_seqs: Iterable[int]) -> list[Seal]:
        """Seal what a forward over ``batch_seqs`` pushes out; the groups sealed, in order."""
        sealed = []
        for seq in dict.fromkeys(batch_seqs):  # in order of first appearance
            pending = [t for _, t in sorted(seqs[seq].items()) if self.is_open(t)]
            extra = max(0, len(pending) - self.recent)
            count = extra // self.batch * self.batch  # whole batches only
            if not count:
                continue
            record, basis = self.seq_record.get(seq), []
            if self.records and record is None:
                record = self.seq_record[seq] = next(self._ids)
                basis = pending
            for i in range(0, count, self.group):
                part = pending[i : i + self.group]
                gid = next(self._ids)
                for t in part:
                    self.group_of[t.uid] = gid
                    self.record_of[t.uid] = record
                sealed.append(Seal(part, record, basis if i == 0 else []))
        return sealed

    def copy_prefix(self, src: int, dst: int) -> None:
        """``dst`` continues ``src`` (src != dst): it takes src's record."""
        self.seq_record.pop(dst, None)
        if src in self.seq_record:
            self.seq_record[dst] = self.seq_record[src]

    def emptied(self, seq: int) -> None:
        """A remove or an eviction left ``seq`` with no row: its record goes."""
        self.seq_record.pop(seq, None)

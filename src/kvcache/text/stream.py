"""Streaming text out of generated tokens: incremental detokenization and stop strings.

Byte-level BPE splits a multi-byte character (``é``, an emoji) over several tokens, so the
text of the tokens so far may end in half a character (decoded as U+FFFD). The decoder keeps
two offsets into the token list and emits only text that is complete::

    ids      [ ... already emitted ... | prefix_offset ... read_offset | new ... ]
    emitted  = decode(ids[prefix:]) minus decode(ids[prefix:read])  (held while it ends in U+FFFD)

Decoding from ``prefix_offset`` (not from 0) keeps each step O(new tokens), and includes a
little left context so BPE-level spacing rules decode the same as in the full text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, never splitting a character."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window of the next decode
        self._read = 0  # tokens up to here have been turned into emitted text

    def push(self, token: int) -> str:
        """Add one token; return the text that became complete (maybe empty)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back what could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Text that is safe to emit after ``delta``; sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(hits)]
        hold = self._partial_suffix(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """What was held back, at the end of generation (no stop string completed)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

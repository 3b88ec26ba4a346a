"""One request's life in the engine, and the events it produces.

A request keeps two token lists::

    tokens   [ prompt ............ | generated ...... ]   what was asked and answered
    context  [ prompt ............ | generated ...... ]   the tokens at cache positions 0..n-1
             [ fed: stored in the cache ][ to feed   ]

They differ only after a context shift, which deletes a middle range of ``context`` (and of
the cache) but never of ``tokens``. A preempted request recomputes ``context``, so it
continues from exactly the state it left.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcache.engine.params import RequestParams
from kvcache.text.stream import IncrementalDecoder, StopMatcher
from kvcache.text.tokenizer import Tokenizer

# why a request ended: the tokenizer's end token, a stop string, max_tokens or the context,
# a cancel; an engine failure ends it with "error: <message>"
FINISH_REASONS = ("eos", "stop", "length", "cancelled")


@dataclass(frozen=True)
class Event:
    """Something a request produced: a text delta and its token, or its end."""

    request: int
    text: str = ""
    token: int | None = None
    finished: bool = False
    finish_reason: str | None = None  # one of FINISH_REASONS, or "error: ..."


class Request:
    """One request's state; ``events`` is a thread-safe queue of its :class:`Event` s."""

    def __init__(
        self,
        rid: int,
        prompt: Sequence[int],
        params: RequestParams,
        tokenizer: Tokenizer | None,
        seed_offset: int = 0,
    ) -> None:
        self.id = rid
        self.params = params
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)  # prompt + generated
        self.context = list(prompt)  # tokens at cache positions 0..len-1 (after any shift)
        self.fed = 0  # positions of context stored in the cache
        self.seq = -1  # cache sequence id while running (-1: waiting)
        self.admitted = -1  # admission order (preemption takes the youngest)
        self.awaits: int | None = None  # seq of a running request computing our prefix
        self.cached_tokens: int | None = None  # prompt tokens reused when first started
        self.computed = 0  # tokens this request ran through the model
        self.parked: object | None = None  # what a preemption kept of its cells (if anything)
        self.preemptions = 0  # times preempted for room (spilled or recomputed)
        self.rng = None if params.sampling.greedy else params.sampling.generator(seed_offset)
        self.decoder = IncrementalDecoder(tokenizer.decode) if tokenizer else None
        self.stop_ids = tokenizer.stop_ids if tokenizer else frozenset()
        self.stopper = StopMatcher(params.stop)
        self.text: list[str] = []
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.listener: Callable[[Event], None] | None = None
        self.finish_reason: str | None = None
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.started_at: float | None = None  # first admission (the end of its queue wait)
        self.first_token_at: float | None = None

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def decoding(self) -> bool:
        """Whether the next feed is one sampled token (not a prompt or recompute chunk)."""
        return len(self.tokens) > self.prompt_len and self.fed == len(self.context) - 1

    @property
    def prefilling(self) -> bool:
        """Whether the request still computes its prompt itself (others may wait for it)."""
        return self.seq >= 0 and self.awaits is None and self.fed < self.prompt_len

    @property
    def queued_seconds(self) -> float:
        """Seconds between submission and the first admission (so far, while queued)."""
        end = time.perf_counter() if self.started_at is None else self.started_at
        return end - self.submitted

    def cancel(self) -> None:
        """Stop at the next step and free the request's cells (any thread)."""
        self.cancelled = True

    def emit(self, event: Event) -> Event:
        self.events.put(event)
        if self.listener is not None:
            self.listener(event)
        return event

    def accept(self, token: int) -> tuple[str, str | None]:
        """Record a sampled token: its text and the finish reason it causes (or None)."""
        self.tokens.append(token)
        self.context.append(token)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if token in self.stop_ids and not self.params.ignore_eos:
            return "", "eos"
        text = self.stopper.feed(self.decoder.push(token)) if self.decoder else ""
        self.text.append(text)
        if self.stopper.stopped:
            return text, "stop"
        if len(self.tokens) - self.prompt_len >= self.params.max_tokens:
            return text, "length"
        return text, None

    def flush(self, reason: str) -> str:
        """Text held back by the decoder or the stop matcher, released at the end."""
        if self.decoder is None or reason in ("stop", "cancelled"):
            return ""
        tail = self.stopper.feed(self.decoder.flush())
        tail += "" if self.stopper.stopped else self.stopper.flush()
        self.text.append(tail)
        return tail

"""Text generation on one shared cell cache: continuous batching, prefix sharing, context shift.

Every :meth:`Generator.step` is one forward over all active sequences: one token of each
decoding sequence plus prompt chunks of those still prefilling, within ``max_batch`` tokens::

    batch rows  [ s0 decode | s2 decode | s3 prompt[0:40] | s1 prompt[512:800] ]
    logits of   [    x      |     x     |         x        |   (not yet at end)  ]

Only rows that end something (a decode token, the last prompt token, a shared prefix) go
through the LM head. A finished sequence frees its cells with ``cache.remove(seq, 0)`` and its
sequence id goes to the next queued prompt, which joins between steps.

Prompts submitted together share their common token prefix: the first computes it, the
others ``copy_prefix`` its cells (no K/V copied) and continue from there.

Context shift: a sequence may hold ``capacity`` positions. When the next tokens would not
fit, it keeps its first ``keep`` tokens (at least the prefix it shares, whose cells cannot
move), drops half of the rest with ``remove(seq, keep, keep + discard)`` -- later keys are
re-rotated by the model's RoPE ``shift`` -- and continues at the lower positions.
With a sliding ``window`` the cache forgets old cells itself and no shift is needed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvcache.batch import Batch
from kvcache.errors import InvalidArgumentError
from kvcache.models.llama import Llama
from kvcache.models.sampling import SamplingParams, sample
from kvcache.text.stream import IncrementalDecoder, StopMatcher
from kvcache.text.tokenizer import Tokenizer
from kvcache.validate import config_int

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class GenerationConfig:
    """Per-prompt options: length limit, sampling, stop strings, whether EOS ends it."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidArgumentError("max_new_tokens", self.max_new_tokens, "an int >= 1")
        if self.max_new_tokens < 1:
            raise InvalidArgumentError("max_new_tokens", self.max_new_tokens, "an int >= 1")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidArgumentError("sampling", self.sampling, "a SamplingParams")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidArgumentError("stop", self.stop, "a tuple of non-empty str")


@dataclass(frozen=True)
class TextEvent:
    """New text of one request; the last event of a request has ``finished`` set."""

    request: int
    text: str
    token: int | None = None
    finished: bool = False
    finish_reason: str | None = None  # "eos" | "stop" | "length"


@dataclass
class Completion:
    """Everything one request produced."""

    request: int
    prompt: list[int]
    tokens: list[int]
    text: str
    finish_reason: str


@dataclass
class GenerationStats:
    """Counters and timings of a generator (forwards with prompt tokens count as prefill)."""

    prompt_tokens: int = 0  # tokens of all prompts submitted
    prefill_tokens: int = 0  # prompt tokens computed (a shared prefix once)
    prefill_seconds: float = 0.0
    decode_tokens: int = 0  # tokens sampled in decode-only steps
    decode_seconds: float = 0.0
    forwards: int = 0
    shifts: int = 0

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens computed per second of prefill."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_rate(self) -> float:
        """Tokens generated per second of decode-only steps (all sequences together)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


@dataclass(eq=False)  # compared by identity
class _Request:
    """One prompt's progress through the generator."""

    id: int
    prompt: list[int]
    config: GenerationConfig
    rng: torch.Generator | None
    decoder: IncrementalDecoder | None
    stopper: StopMatcher
    seq: int = -1  # cache sequence id (-1 = queued)
    pos: int = 0  # positions held in the cache = next position to write
    fed: int = 0  # prompt tokens computed (or received through copy_prefix)
    shared: int = 0  # length of a prefix whose cells other sequences use too
    pending: int | None = None  # sampled token not yet fed (decode phase)
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    parent: _Request | None = None  # computes our shared prefix
    children: list[_Request] = field(default_factory=list)
    share_at: int = 0  # prefix length children wait for (parents only)


@dataclass
class _Slot:
    """Rows of one request in the current forward."""

    request: _Request
    count: int
    row: int | None  # batch row whose logits we need, or None


class _Picker:
    """Next tokens from one forward's logits: one batched argmax serves every greedy row."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits  # [rows, V]
        self._argmax: list[int] | None = None

    def pick(self, row: int, r: _Request) -> int:
        if not r.config.sampling.greedy:
            return sample(self.logits[row], r.config.sampling, r.rng)
        if self._argmax is None:
            self._argmax = self.logits.argmax(dim=-1).tolist()
        return self._argmax[row]


class Generator:
    """Continuous batching of many prompts over one :class:`~kvcache.CausalCache`."""

    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer | None = None,
        *,
        capacity: int = 4096,
        max_sequences: int = 1,
        max_batch: int = 512,
        window: int | None = None,
        keep: int | None = None,
        codec: str | None = None,
    ) -> None:
        """``codec``: how the cache stores K/V (``kvcache.codecs`` spec; None: the dtype)."""
        self.model = model
        self.tokenizer = tokenizer
        self.capacity = config_int("capacity", capacity, 2)
        self.max_batch = config_int("max_batch", max_batch, 1)
        # default: 4 "attention sink" tokens survive a shift (fewer in a tiny context)
        self.keep = min(4, self.capacity // 4) if keep is None else config_int("keep", keep, 0)
        if self.keep >= self.capacity // 2:
            raise InvalidArgumentError("keep", keep, f"an int < capacity // 2 = {capacity // 2}")
        self.cache = model.new_cache(
            self.capacity,
            max_sequences=max_sequences,
            max_batch=self.max_batch,
            window=window,
            codec=codec,
        )
        self.window = window
        self.stats = GenerationStats()
        self.results: dict[int, Completion] = {}
        self._free = list(range(max_sequences - 1, -1, -1))  # sequence ids, pop from the end
        self._queue: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._next_id = 0

    # ---- submitting ------------------------------------------------------------------
    def add(self, prompt: Prompt, config: GenerationConfig | None = None) -> int:
        """Queue one prompt (text or token ids); it joins the batch at the next step."""
        return self.add_many([prompt], config)[0]

    def add_many(
        self, prompts: Sequence[Prompt], config: GenerationConfig | None = None
    ) -> list[int]:
        """Queue prompts; those that start now compute their common token prefix once."""
        if isinstance(prompts, str) or not prompts:
            raise InvalidArgumentError("prompts", prompts, "a non-empty list of prompts")
        cfg = GenerationConfig() if config is None else config
        encoded = [self._encode(p) for p in prompts]  # all valid before any is queued
        requests = [self._request(ids, cfg, i) for i, ids in enumerate(encoded)]
        self._queue.extend(requests)
        starting = self._admit()
        self._plan_sharing([r for r in starting if r in requests])
        return [r.id for r in requests]

    def _request(self, ids: list[int], config: GenerationConfig, offset: int) -> _Request:
        self.stats.prompt_tokens += len(ids)
        rng = None if config.sampling.greedy else config.sampling.generator(offset)
        decoder = IncrementalDecoder(self.tokenizer.decode) if self.tokenizer else None
        request = _Request(self._next_id, ids, config, rng, decoder, StopMatcher(config.stop))
        self._next_id += 1
        return request

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("prompt", prompt[:40], "token ids (no tokenizer given)")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidArgumentError("prompt", prompt, "at least one token")
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise InvalidArgumentError(
                "prompt", bad[0], f"token ids < {self.model.config.vocab_size}"
            )
        return ids

    def _admit(self) -> list[_Request]:
        """Give free sequence ids to queued requests (FIFO)."""
        started = []
        while self._queue and self._free:
            request = self._queue.popleft()
            request.seq = self._free.pop()
            self._active.append(request)
            started.append(request)
        return started

    def _plan_sharing(self, group: list[_Request]) -> None:
        """The first of ``group`` computes the common prefix; the others wait and fork it."""
        if len(group) < 2:
            return
        prefix = _common_prefix([r.prompt for r in group])
        if prefix == 0 or prefix > self.capacity:
            return
        parent = group[0]
        parent.share_at, parent.shared = prefix, prefix
        for child in group[1:]:
            child.parent, child.shared = parent, prefix
            parent.children.append(child)

    # ---- running ---------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self._queue or self._active)

    def run(self) -> Iterator[TextEvent]:
        """Step until every request has finished, yielding text as it appears."""
        while self.busy:
            yield from self.step()

    def step(self) -> list[TextEvent]:
        """One forward over all active sequences; returns the text events it produced."""
        self._admit()
        events: list[TextEvent] = []
        slots = self._schedule(events)
        if not slots:
            return events
        tokens, batch = _batch(slots)
        rows = [s.row for s in slots if s.row is not None]
        prefill = sum(s.count for s in slots if s.request.pending is None)
        start = time.perf_counter()
        logits = self.model.forward(tokens, batch, self.cache, outputs=rows)
        sampled = self._advance(slots, logits, events)
        elapsed = time.perf_counter() - start
        self.stats.forwards += 1
        if prefill:
            self.stats.prefill_tokens += prefill
            self.stats.prefill_seconds += elapsed
        else:
            self.stats.decode_tokens += sampled
            self.stats.decode_seconds += elapsed
        return events

    def _schedule(self, events: list[TextEvent]) -> list[_Slot]:
        """Who feeds how many tokens this step: decode tokens first, then prompt chunks."""
        slots: list[_Slot] = []
        budget = self.max_batch
        row = 0
        ordered = sorted(self._active, key=lambda r: r.pending is None)  # decoders first
        for r in ordered:
            if budget == 0:
                break
            if r.parent is not None and r.fed < r.shared:
                continue  # waiting for the parent's prefix
            want = 1 if r.pending is not None else len(r.prompt) - r.fed
            if r.pending is None and r.share_at > r.fed:
                want = r.share_at - r.fed  # stop at the shared prefix so children can fork
            count = self._fit(r, min(want, budget))
            if count == 0:
                events.append(self._finish(r, "length"))
                continue
            ends = r.pending is not None or r.fed + count in (len(r.prompt), r.share_at)
            row += count
            slots.append(_Slot(r, count, row - 1 if ends else None))
            budget -= count
        return slots

    def _fit(self, r: _Request, count: int) -> int:
        """Tokens of ``r`` that fit this step, shifting its context first if needed."""
        if self.window is not None or r.pos + count <= self.capacity:
            return count
        keep = max(self.keep, r.shared)
        discard = (r.pos - keep) // 2
        if discard > 0:
            self.cache.remove(r.seq, keep, keep + discard)  # later keys re-rotated by RoPE
            r.pos -= discard
            self.stats.shifts += 1
        return max(0, min(count, self.capacity - r.pos))

    def _advance(self, slots: list[_Slot], logits: torch.Tensor, events: list[TextEvent]) -> int:
        """Book the forward's tokens, fork shared prefixes, sample; returns tokens sampled."""
        picker = _Picker(logits)
        sampled = 0
        out = 0
        for slot in slots:
            r = slot.request
            r.pos += slot.count
            row = -1
            if slot.row is not None:
                row, out = out, out + 1
            if r.pending is not None:
                r.pending = None
            else:
                r.fed += slot.count
                if r.children and r.fed == r.share_at:
                    assert row >= 0, "the shared prefix's last row has logits"
                    sampled += self._fork(r, picker, row, events)
                if r.fed < len(r.prompt):
                    continue
            assert row >= 0, f"request {r.id} needs logits at pos {r.pos - 1}"
            events.append(self._accept(r, picker.pick(row, r)))
            sampled += 1
        return sampled

    def _fork(self, parent: _Request, picker: _Picker, row: int, events: list[TextEvent]) -> int:
        """Children take the parent's prefix cells; those whose prompt is the prefix sample now."""
        sampled = 0
        for child in parent.children:
            self.cache.copy_prefix(parent.seq, child.seq, parent.share_at)
            child.pos = child.fed = parent.share_at
            if child.fed == len(child.prompt):
                events.append(self._accept(child, picker.pick(row, child)))
                sampled += 1
        parent.children = []
        return sampled

    def _accept(self, r: _Request, token: int) -> TextEvent:
        """Record a sampled token: stream its text or finish the request."""
        r.generated.append(token)
        stops = self.tokenizer.stop_ids if self.tokenizer else frozenset()
        if token in stops and not r.config.ignore_eos:
            return self._finish(r, "eos", token)
        text = r.stopper.feed(r.decoder.push(token)) if r.decoder else ""
        r.text.append(text)
        if r.stopper.stopped:
            return self._finish(r, "stop", token, text)
        if len(r.generated) >= r.config.max_new_tokens:
            return self._finish(r, "length", token, text)
        r.pending = token
        return TextEvent(r.id, text, token)

    def _finish(
        self, r: _Request, reason: str, token: int | None = None, text: str = ""
    ) -> TextEvent:
        """Free the request's cells and sequence id, flush held-back text, keep the result."""
        if r.decoder is not None and reason != "stop":
            tail = r.stopper.feed(r.decoder.flush())
            tail += "" if r.stopper.stopped else r.stopper.flush()
            r.text.append(tail)
            text += tail
        self.cache.remove(r.seq, 0)
        self._free.append(r.seq)
        self._active.remove(r)
        r.seq, r.pending = -1, None
        self.results[r.id] = Completion(r.id, r.prompt, r.generated, "".join(r.text), reason)
        return TextEvent(r.id, text, token, finished=True, finish_reason=reason)

    def close(self) -> None:
        """Release the cache storage."""
        self.cache.close()


def generate(
    model: Llama,
    tokenizer: Tokenizer | None,
    prompts: Prompt | Sequence[Prompt],
    config: GenerationConfig | None = None,
    *,
    capacity: int = 4096,
    max_batch: int = 512,
    window: int | None = None,
) -> list[Completion]:
    """Complete one prompt or many at once (all in one cache); results in prompt order."""
    batch = _as_prompt_list(prompts)
    gen = Generator(
        model,
        tokenizer,
        capacity=capacity,
        max_sequences=len(batch),
        max_batch=max_batch,
        window=window,
    )
    try:
        ids = gen.add_many(batch, config)
        for _ in gen.run():
            pass
        return [gen.results[i] for i in ids]
    finally:
        gen.close()


def _batch(slots: list[_Slot]) -> tuple[list[int], Batch]:
    """Token ids and positions of one step: each slot's pending token or prompt chunk."""
    tokens: list[int] = []
    positions: list[int] = []
    seqs: list[int] = []
    for slot in slots:
        r = slot.request
        if r.pending is not None:
            tokens.append(r.pending)
        else:
            tokens.extend(r.prompt[r.fed : r.fed + slot.count])
        positions.extend(range(r.pos, r.pos + slot.count))
        seqs.extend([r.seq] * slot.count)
    return tokens, Batch(positions, seqs)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        return [prompts]  # type: ignore[list-item]
    if isinstance(prompts[0], int):
        return [[int(t) for t in prompts]]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _common_prefix(prompts: list[list[int]]) -> int:
    """Length of the longest token prefix all prompts share."""
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != first[i] for p in prompts[1:]):
            return i
    return n

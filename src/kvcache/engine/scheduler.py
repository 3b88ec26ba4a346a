"""The serving engine: continuous batching over one cell cache, with prefix reuse.

Each :meth:`Engine.step` is one forward over every running request: one decode token per
generating request, then prompt chunks of those still prefilling, within ``max_batch``
tokens. Requests join and leave between steps.

Prefix reuse (``kvcache.prefix``): a finished request's sequence stays in the cache as a
*holder* of its whole token blocks. A new request whose prompt starts with indexed blocks
shares the holder's cells (``copy_prefix``, no K/V copied) and prefills only the rest.
With a block store (memory / disk / Redis), finished blocks are also published, and a
request that misses locally loads the blocks another replica computed, writing their K/V
straight into its cells (no model compute).

Memory pressure, in order: a forward that does not fit (CacheFullError, which changes
nothing) first evicts holders, least recently used first; then preempts the youngest running
request (frees its cells, requeues it at the front; it recomputes prompt + generated tokens
later and continues where it stopped). A request that could never fit is rejected at
submission; nothing is dropped or truncated silently.

Thread safety: :meth:`Engine.submit` and :meth:`Request.cancel` may be called from any
thread; :meth:`Engine.step` runs on one thread (see :class:`EngineLoop`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.engine.store import (
    BlockIdentity,
    BlockStore,
    CorruptBlockError,
    decode_block,
    encode_block,
)
from kvcache.errors import CacheFullError, InvalidArgumentError, StoreUnavailableError
from kvcache.models.llama import Llama
from kvcache.models.sampling import SamplingParams, sample
from kvcache.prefix import PrefixIndex
from kvcache.text.stream import IncrementalDecoder, StopMatcher
from kvcache.text.tokenizer import Tokenizer
from kvcache.validate import config_int

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine: context per request, parallel requests, tokens per forward."""

    capacity: int = 4096  # positions one request may hold (prompt + generated)
    max_sequences: int = 8  # requests running at once
    max_batch: int = 256  # tokens per forward (decode tokens + prompt chunks)
    pool_sequences: int | None = None  # cells = pool_sequences * capacity (default max_sequences)
    block_size: int = 16  # tokens per prefix-cache block
    prefix_cache: bool = True
    codec: str | None = None  # cell codec (None: the model's dtype)

    def __post_init__(self) -> None:
        config_int("capacity", self.capacity, 2)
        config_int("max_sequences", self.max_sequences, 1)
        config_int("max_batch", self.max_batch, 1)
        config_int("block_size", self.block_size, 1)
        if self.pool_sequences is not None:
            config_int("pool_sequences", self.pool_sequences, 1)


@dataclass(frozen=True)
class RequestParams:
    """Per-request options (OpenAI-style): length, sampling, stop strings."""

    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class Event:
    """Something a request produced: a text delta / token, or its end."""

    request: int
    text: str = ""
    token: int | None = None
    finished: bool = False
    reason: str | None = None  # "eos" | "stop" | "length" | "cancelled"


class Request:
    """One request's state; ``events`` is a thread-safe queue of its :class:`Event` s."""

    def __init__(
        self, rid: int, prompt: list[int], params: RequestParams, tokenizer: Tokenizer | None
    ) -> None:
        self.id = rid
        self.prompt_len = len(prompt)
        self.params = params
        self.tokens = list(prompt)  # prompt + generated (what a preempted request recomputes)
        self.fed = 0  # tokens whose K/V are in the cache (positions 0..fed-1)
        self.seq = -1
        self.admitted = -1  # admission order (preemption takes the youngest)
        self.reused = 0  # prompt tokens taken from the prefix cache (local or store)
        self.computed = 0  # tokens this request ran through the model
        self.rng = None if params.sampling.greedy else params.sampling.generator()
        self.decoder = IncrementalDecoder(tokenizer.decode) if tokenizer else None
        self.stop_ids = tokenizer.stop_ids if tokenizer else frozenset()
        self.stopper = StopMatcher(params.stop)
        self.text: list[str] = []
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.listener: Callable[[Event], None] | None = None
        self.finish_reason: str | None = None
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stop at the next step and free the request's cells (any thread)."""
        self.cancelled = True

    def emit(self, event: Event) -> Event:
        self.events.put(event)
        if self.listener is not None:
            self.listener(event)
        return event


@dataclass
class EngineStats:
    """Counters since start (rates are derived by whoever reads them)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens served from the prefix cache
    store_tokens: int = 0  # ... of which loaded from the block store
    computed_tokens: int = 0  # tokens run through the model (prefill + decode)
    generated_tokens: int = 0
    forwards: int = 0
    evictions: int = 0
    preemptions: int = 0
    store_published: int = 0
    store_rejected: int = 0
    store_errors: int = 0  # the store could not be reached (treated as a miss)
    finished: int = 0


class Engine:
    """Continuous batching of requests over one :class:`~kvcache.CausalCache`."""

    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        *,
        model_id: str = "model",
        store: BlockStore | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        c = self.config
        self.cache = CausalCache(
            c.capacity,
            max_sequences=c.pool_sequences or c.max_sequences,
            max_batch=c.max_batch,
            shift=model.rope.shift,
            dtype=model.dtype,
            codec=c.codec,
        )
        codec = f"{self.cache.key_codec.name}/{self.cache.value_codec.name}"
        self.index = PrefixIndex(c.block_size, namespace=f"{model_id}|{codec}")
        self.identity = BlockIdentity(model_id, codec, c.block_size)
        self.store = store
        self.stats = EngineStats()
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._seqs = itertools.count()
        self._admissions = itertools.count()
        self._published: set[bytes] = set()

    # ---- submitting (any thread) -----------------------------------------------------
    def submit(self, prompt: Sequence[int] | str, params: RequestParams | None = None) -> Request:
        """Queue a request; raises InvalidArgumentError if it could never fit."""
        p = params or RequestParams()
        ids = self._encode(prompt)
        if len(ids) + p.max_tokens > self.config.capacity:
            raise InvalidArgumentError(
                "prompt",
                f"<{len(ids)} tokens + max_tokens {p.max_tokens}>",
                f"at most {self.config.capacity} tokens in all (the context length)",
            )
        if p.max_tokens < 1:
            raise InvalidArgumentError("max_tokens", p.max_tokens, "an int >= 1")
        request = Request(next(self._ids), ids, p, self.tokenizer)
        self._inbox.put(request)
        return request

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("prompt", prompt[:40], "token ids (no tokenizer)")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise InvalidArgumentError("prompt", ids[:8], f"1+ token ids in [0, {vocab})")
        return ids

    # ---- stepping (one thread) -------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or not self._inbox.empty())

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.busy:
            self.step()

    def step(self) -> list[Event]:
        """Admit, run one forward over all running requests, sample; returns the events."""
        events: list[Event] = []
        while not self._inbox.empty():
            r = self._inbox.get()
            self.waiting.append(r)
            self.stats.prompt_tokens += r.prompt_len
        self._drop_cancelled(events)
        self._admit()
        if not self.running:
            return events
        while True:
            plan = self._plan()
            try:
                logits = self._forward(plan)
                break
            except CacheFullError as e:
                if not self._make_room(len(plan.tokens), e):
                    raise
        self._advance(plan, logits, events)
        return events

    def _drop_cancelled(self, events: list[Event]) -> None:
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            events.append(self._end(r, "cancelled"))
        for r in [r for r in self.running if r.cancelled]:
            events.append(self._finish(r, "cancelled"))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_sequences:
            r = self.waiting.popleft()
            r.seq = next(self._seqs)
            r.admitted = next(self._admissions)
            self.running.append(r)
            if self.config.prefix_cache:
                self._reuse_prefix(r)

    def _reuse_prefix(self, r: Request) -> None:
        """Share indexed cells, then load further blocks from the store (local first)."""
        usable = r.tokens[: len(r.tokens) - 1]  # the last token is computed for its logits
        hashes = self.index.hashes(usable)
        match = self.index.lookup(usable, hashes)
        if match.holder is not None:
            self.cache.copy_prefix(match.holder, r.seq, match.tokens)
            r.fed = match.tokens
        if self.store is not None:
            self._load_blocks(r, hashes[match.blocks :])
        r.reused = min(r.fed, r.prompt_len)
        self.stats.reused_tokens += r.reused

    def _load_blocks(self, r: Request, hashes: Sequence[bytes]) -> None:
        assert self.store is not None
        keys: list[list[torch.Tensor]] = []
        values: list[list[torch.Tensor]] = []
        for h in hashes:
            try:
                data = self.store.get(self.identity.key(h))
            except StoreUnavailableError as e:
                log.warning("prefix store unavailable, computing instead: %s", e)
                self.stats.store_errors += 1
                break
            if data is None:
                break
            try:
                k, v = decode_block(data, self.identity, h)
            except CorruptBlockError as e:
                log.warning("ignoring prefix block %s from %s: %s", h.hex(), self.store.name, e)
                self.stats.store_rejected += 1
                break
            if len(k) != self.model.config.num_layers:
                log.warning("ignoring prefix block %s: %d layers", h.hex(), len(k))
                self.stats.store_rejected += 1
                break
            keys.append(k)
            values.append(v)
            self._published.add(h)
        if not keys:
            return
        n = len(keys) * self.config.block_size
        batch = Batch(list(range(r.fed, r.fed + n)), [r.seq] * n)
        try:
            self.cache.start_forward(batch)
        except CacheFullError:
            return  # no room now: compute these tokens instead
        for layer in range(self.model.config.num_layers):
            k_rows = torch.cat([blk[layer] for blk in keys]).to(self.model.dtype)  # [n, H, D]
            v_rows = torch.cat([blk[layer] for blk in values]).to(self.model.dtype)
            self.cache.put(layer, k_rows, v_rows)
        r.fed += n
        self.stats.store_tokens += n

    @dataclass
    class _Plan:
        tokens: list[int]
        positions: list[int]
        seqs: list[int]
        slots: list[tuple[Request, int, bool]]  # (request, count, needs logits)

    def _plan(self) -> Engine._Plan:
        plan = Engine._Plan([], [], [], [])
        budget = self.config.max_batch
        ordered = sorted(self.running, key=lambda r: len(r.tokens) - r.fed > 1)  # decode first
        for r in ordered:
            if budget == 0:
                break
            count = min(len(r.tokens) - r.fed, budget)
            plan.tokens += r.tokens[r.fed : r.fed + count]
            plan.positions += range(r.fed, r.fed + count)
            plan.seqs += [r.seq] * count
            plan.slots.append((r, count, r.fed + count == len(r.tokens)))
            budget -= count
        return plan

    def _forward(self, plan: Engine._Plan) -> torch.Tensor:
        rows = list(itertools.accumulate(c for _, c, _ in plan.slots))
        outputs = [row - 1 for row, (_, _, needs) in zip(rows, plan.slots, strict=True) if needs]
        batch = Batch(plan.positions, plan.seqs)
        return self.model.forward(plan.tokens, batch, self.cache, outputs=outputs)

    def _make_room(self, needed: int, error: CacheFullError) -> bool:
        """Evict holders (LRU), else preempt the youngest request; False if nothing helps."""
        for holder in self.index.lru():
            self.cache.remove(holder, 0)
            self.index.drop(holder, 0)
            self.stats.evictions += 1
            if self.cache.free_cells() >= needed:
                return True
        if len(self.running) <= 1:
            return False
        victim = max(self.running, key=lambda r: r.admitted)
        log.info("preempting request %d (%s)", victim.id, error)
        self.cache.remove(victim.seq, 0)
        self.running.remove(victim)
        victim.seq, victim.fed = -1, 0
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1
        return True

    def _advance(self, plan: Engine._Plan, logits: torch.Tensor, events: list[Event]) -> None:
        self.stats.forwards += 1
        out = 0
        for r, count, needs in plan.slots:
            r.fed += count
            r.computed += count
            self.stats.computed_tokens += count
            if not needs:
                continue
            token = sample(logits[out], r.params.sampling, r.rng)
            out += 1
            events.append(self._accept(r, token))

    def _accept(self, r: Request, token: int) -> Event:
        r.tokens.append(token)
        self.stats.generated_tokens += 1
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
        if token in r.stop_ids and not r.params.ignore_eos:
            return self._finish(r, "eos", token)
        text = r.stopper.feed(r.decoder.push(token)) if r.decoder else ""
        r.text.append(text)
        if r.stopper.stopped:
            return self._finish(r, "stop", token, text)
        if len(r.generated) >= r.params.max_tokens:
            return self._finish(r, "length", token, text)
        return r.emit(Event(r.id, text, token))

    def _finish(self, r: Request, reason: str, token: int | None = None, text: str = "") -> Event:
        """Keep the request's whole blocks as a prefix holder (publish them), free the rest."""
        keep = (r.fed // self.config.block_size) * self.config.block_size
        if self.config.prefix_cache and keep > 0:
            self.cache.remove(r.seq, keep)
            self.index.insert(r.seq, r.tokens[:keep])
            if self.store is not None:
                self._publish(r.seq, r.tokens[:keep])
        else:
            self.cache.remove(r.seq, 0)
        self.running.remove(r)
        return self._end(r, reason, token, text)

    def _end(self, r: Request, reason: str, token: int | None = None, text: str = "") -> Event:
        if r.decoder is not None and reason not in ("stop", "cancelled"):
            tail = r.stopper.feed(r.decoder.flush())
            tail += "" if r.stopper.stopped else r.stopper.flush()
            r.text.append(tail)
            text += tail
        r.finish_reason = reason
        self.stats.finished += 1
        return r.emit(Event(r.id, text, token, finished=True, reason=reason))

    def _publish(self, seq: int, tokens: list[int]) -> None:
        """Write the holder's blocks the store does not have yet."""
        assert self.store is not None
        b = self.config.block_size
        hashes = self.index.hashes(tokens)
        todo = [i for i, h in enumerate(hashes) if h not in self._published]
        if not todo:
            return
        cells = torch.from_numpy(self.cache.cells_of(seq))  # positions 0..len-1, in order
        layers = self.cache.layers()
        for i in todo:
            idx = cells[i * b : (i + 1) * b]
            kv = [self.cache.read(lay, idx) for lay in layers]
            keys = [k.to(self.model.dtype) for k, _ in kv]
            vals = [v.to(self.model.dtype) for _, v in kv]
            try:
                self.store.put(
                    self.identity.key(hashes[i]),
                    encode_block(self.identity, hashes[i], keys, vals),
                )
            except StoreUnavailableError as e:  # not marked published: tried again later
                log.warning("prefix store unavailable, block not published: %s", e)
                self.stats.store_errors += 1
                return
            self._published.add(hashes[i])
            self.stats.store_published += 1

    # ---- introspection ---------------------------------------------------------------
    def holder_cells(self) -> int:
        """Cells held by prefix holders (and nobody else's to free); shared cells count once."""
        held: set[int] = set()
        for h in self.index.lru():
            held.update(self.cache.cells_of(h).tolist())
        return len(held)

    def metrics(self) -> dict[str, float]:
        s = self.stats
        used = self.cache.used_cells()
        return {
            "cells_total": self.cache.num_cells,
            "cells_used": used,
            "cells_free": self.cache.num_cells - used,
            "prefix_blocks": self.index.blocks(),
            "running": len(self.running),
            "queued": len(self.waiting) + self._inbox.qsize(),
            "prompt_tokens_total": s.prompt_tokens,
            "prefix_reused_tokens_total": s.reused_tokens,
            "prefix_store_tokens_total": s.store_tokens,
            "prefix_hit_rate": s.reused_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "computed_tokens_total": s.computed_tokens,
            "generated_tokens_total": s.generated_tokens,
            "forwards_total": s.forwards,
            "evictions_total": s.evictions,
            "preemptions_total": s.preemptions,
            "store_published_total": s.store_published,
            "store_rejected_total": s.store_rejected,
            "store_errors_total": s.store_errors,
            "requests_finished_total": s.finished,
        }

    def close(self) -> None:
        self.cache.close()


class EngineLoop:
    """Runs an engine's steps on a background thread; ``submit`` from any thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        # metrics taken on the stepping thread after each step: other threads read this dict
        # (swapped whole, never mutated) instead of walking engine state while it changes
        self.snapshot: dict[str, float] = engine.metrics()
        self._thread = threading.Thread(target=self._run, name="kvcache-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether requests submitted now will be stepped (a server's liveness check)."""
        return self._thread.is_alive() and not self._stop

    def submit(
        self,
        prompt: Sequence[int] | str,
        params: RequestParams | None = None,
        listener: Callable[[Event], None] | None = None,
    ) -> Request:
        request = self.engine.submit(prompt, params)
        request.listener = listener
        self._wake.set()
        return request

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except BaseException as e:  # noqa: BLE001 - kept for the server to report
                log.exception("engine step failed")
                self.error = e
                self._fail_all(e)
            self.snapshot = self.engine.metrics()

    def _fail_all(self, error: BaseException) -> None:
        eng = self.engine
        for r in eng.running:
            eng.cache.remove(r.seq, 0)  # free the failed requests' cells: the pool stays usable
        for r in [*eng.running, *eng.waiting]:
            r.emit(Event(r.id, "", None, finished=True, reason=f"error: {error}"))
        eng.running.clear()
        eng.waiting.clear()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

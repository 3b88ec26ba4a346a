"""The engine: continuous batching of requests over one cell cache.

Both ``kvcache generate`` (through :mod:`kvcache.generate`) and ``kvcache serve`` run it.
Each :meth:`Engine.step` is one forward over every running request: one decode token per
generating request, then context chunks of those still prefilling, within ``max_batch``
tokens. Only rows that end something (a decode token, the last token of a context) go
through the LM head::

    batch rows  [ r0 decode | r2 decode | r3 prompt[0:40] | r1 prompt[512:800] ]
    logits of   [    x      |     x     |        x        |  (not at its end)   ]

Requests join and leave between steps. Around the forward, in one place:

* prefix reuse (:mod:`kvcache.engine.reuse`): a starting request shares cached cells of its
  prompt's longest indexed prefix, loads further blocks from a block store, or waits for a
  running request that is computing that prefix (the shared-prompt fork);
* the context policy (:mod:`kvcache.engine.context`): reject what cannot fit, shift the
  context, or let a sliding window forget;
* admission: a queued request starts (FIFO) once the part of its context that no prefix
  covers fits beside what the running requests still have to feed (vLLM's rule), so the
  pool never preempts a request that has not computed anything yet;
* memory pressure (:mod:`kvcache.engine.pressure`): a forward that does not fit
  (CacheFullError, which changes nothing) evicts idle prefix holders, least recently used
  first, then preempts the youngest running request, which is requeued at the front;
* cancellation, stop strings, statistics (:mod:`kvcache.engine.stats`).

Thread safety: :meth:`Engine.submit` and :meth:`Request.cancel` may be called from any
thread; :meth:`Engine.step` runs on one thread (see :class:`kvcache.engine.loop.EngineLoop`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvcache.batch import Batch
from kvcache.engine.checkpoints import LocalCheckpoints
from kvcache.engine.context import context_policy
from kvcache.engine.params import EngineConfig, RequestParams
from kvcache.engine.pressing import Pressing, fp16_row_bytes
from kvcache.engine.pressure import HOLDER_EVICTIONS, PREEMPTIONS
from kvcache.engine.request import Event, Request
from kvcache.engine.reuse import NoReuse, PrefixReuse, shared_prefix
from kvcache.engine.spill import Parked
from kvcache.engine.stats import MISS_REASONS, EngineStats
from kvcache.engine.store import BlockStore
from kvcache.errors import CacheFullError, InvalidArgumentError, NotSupportedError
from kvcache.models.llama import Llama
from kvcache.models.sampling import sample
from kvcache.text.tokenizer import Tokenizer
from kvcache.wrapper import HybridCache

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass
class _Plan:
    """One forward: its tokens, and per request how many rows and whether it samples."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    slots: list[tuple[Request, int, bool]] = field(default_factory=list)  # (r, count, samples)
    prefill: int = 0  # rows that are not decode tokens


class _Picker:
    """Next tokens from one forward's logits: one batched argmax serves every greedy row."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits  # [rows, V]
        self._argmax: list[int] | None = None

    def pick(self, row: int, r: Request) -> int:
        if not r.params.sampling.greedy:
            return sample(self.logits[row], r.params.sampling, r.rng)
        if self._argmax is None:
            self._argmax = self.logits.argmax(dim=-1).tolist()
        return self._argmax[row]


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
        """``model_id`` names the model in prefix hashes and store keys: blocks are reused
        only between engines with the same id and codec."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = c = config or EngineConfig()
        # a hybrid model's window layers hold the running requests' cells, its pool the rest
        live = {"live_sequences": c.max_sequences} if getattr(model, "hybrid", False) else {}
        self.cache = model.new_cache(
            c.capacity,
            max_sequences=c.pool,
            max_batch=c.max_batch,
            window=c.window,
            codec=c.codec,
            **live,
        )
        resumer = self._resumer(c, store)
        self.stats = EngineStats()
        self.context = context_policy(c.context, c.capacity, c.kept_tokens, c.window)
        self.preemption = PREEMPTIONS[c.preemption](c.spill)
        self.reuse: PrefixReuse | NoReuse = NoReuse(self.cache)
        self.press = Pressing.start(
            c.press, self.cache, self.stats, model, tokenizer, c.press_cells, c.press_every
        )
        if c.prefix_cache and self.press is None:  # a pressed prompt is no prefix to share
            self.reuse = PrefixReuse(
                self.cache,
                self.stats,
                c.block_size,
                model_id=model_id,
                num_layers=model.config.num_layers,
                store=store,
                eviction=HOLDER_EVICTIONS[c.holder_eviction](),
                resumer=resumer,
            )
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._seqs = itertools.count()
        self._admissions = itertools.count()

    def _resumer(self, c: EngineConfig, store: BlockStore | None) -> LocalCheckpoints | None:
        """A hybrid cache (the model's window layers beside full ones) resumes prefix hits
        from local-layer checkpoints; what it cannot serve yet fails here, typed."""
        if not isinstance(self.cache, HybridCache):
            return None
        if store is not None or c.press is not None:
            what = "a block store" if store is not None else f"press={c.press!r}"
            raise NotSupportedError(f"{what} on a hybrid (sliding-window + global) cache")
        return LocalCheckpoints(self.cache, c.checkpoints, c.checkpoint_every)

    # ---- submitting (any thread) -----------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        params: RequestParams | None = None,
        listener: Callable[[Event], None] | None = None,
    ) -> Request:
        """Queue a request; InvalidArgumentError (nothing queued) if it could never run.

        ``listener`` is called on the stepping thread with each of the request's events
        (set before the request is queued, so it sees every one)."""
        return self.submit_many([prompt], params, listener)[0]

    def submit_many(
        self,
        prompts: Sequence[Prompt],
        params: RequestParams | None = None,
        listener: Callable[[Event], None] | None = None,
    ) -> list[Request]:
        """Queue several requests (all checked before any is queued); sampled requests draw
        from ``seed + i`` so parallel samples of one prompt differ."""
        if isinstance(prompts, str) or not prompts:
            raise InvalidArgumentError("prompts", prompts, "a non-empty list of prompts")
        p = RequestParams() if params is None else params
        if not isinstance(p, RequestParams):
            raise InvalidArgumentError("params", p, "a RequestParams")
        encoded = [self.encode(prompt) for prompt in prompts]
        for ids in encoded:
            self.context.check(len(ids), p.max_tokens)
        requests = [
            Request(next(self._ids), ids, p, self.tokenizer, seed_offset=i)
            for i, ids in enumerate(encoded)
        ]
        for r in requests:
            r.listener = listener
            self._inbox.put(r)
        return requests

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (text needs a tokenizer), checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("prompt", prompt[:40], "token ids (no tokenizer given)")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if not ids or bad:
            raise InvalidArgumentError("prompt", bad[:8] or ids, f"1+ token ids in [0, {vocab})")
        return ids

    def new_sequence(self) -> int:
        """A cache sequence id no request or holder uses (stepping thread only)."""
        return next(self._seqs)

    # ---- stepping (one thread) -------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self.running or self.waiting or not self._inbox.empty())

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.busy:
            self.step()

    def step(self) -> list[Event]:
        """Admit, run one forward over the running requests, sample; returns the events."""
        events: list[Event] = []
        while not self._inbox.empty():
            r = self._inbox.get()
            self.waiting.append(r)
            self.stats.prompt_tokens += r.prompt_len
        self._drop_cancelled(events)
        self._admit()
        self._wake_waiters()
        while self.running:
            plan = self._plan(events)
            if not plan.slots:
                break
            start = time.perf_counter()
            try:
                logits = self._forward(plan)
            except CacheFullError as e:
                if not self._make_room(len(plan.tokens), e):
                    raise
                continue
            sampled = self._advance(plan, logits, events)
            self._time(plan, sampled, time.perf_counter() - start)
            break
        return events

    def _drop_cancelled(self, events: list[Event]) -> None:
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            events.append(self._end(r, "cancelled"))
        for r in [r for r in self.running if r.cancelled]:
            events.append(self._finish(r, "cancelled"))

    def _admit(self) -> None:
        """Queued requests take free slots (FIFO); a preempted one resumes or recomputes."""
        while self.waiting and len(self.running) < self.config.max_sequences:
            r = self.waiting[0]
            if not self._fits(r):
                break  # a parked request waits, first in line, until its cells fit
            self.waiting.popleft()
            r.seq = next(self._seqs)
            r.admitted = next(self._admissions)
            if r.started_at is None:
                r.started_at = time.perf_counter()
            self.running.append(r)
            restored = self.preemption.resume(self.cache, r)
            if restored:
                r.fed = restored
                self.stats.restores += 1
            else:
                self.reuse.attach(r)
                if self.press is not None:
                    self.press.recompute(r)

    def _fits(self, r: Request) -> bool:
        """Whether ``r`` can start now (vLLM's admission rule): its kept cells (if any), else
        the cells of its context that no prefix covers, fit beside what the running requests
        still need for their contexts, with a row to spare for each of them; idle holders
        are evicted for it. Admitting a request whose context cannot fit would only have the
        pool preempt it (or another) a few steps later. With nothing running, a request
        starts anyway (a kept one that still does not fit recomputes instead)."""
        cells = self.preemption.cells_needed(r)
        if cells == 0:
            return self._room_for_context(r)
        want = cells + len(self.running) + 1
        if self.cache.free_cells() < want:
            self.reuse.evict(want)
        if self.cache.free_cells() >= want:
            return True
        if not self.running:
            if self.cache.free_cells() < cells:
                self.preemption.discard(r)
            return True
        return False

    def _room_for_context(self, r: Request) -> bool:
        """Whether ``r``'s uncovered context fits beside the running requests' unfed ones."""
        if not self.running:
            return True
        unfed = sum(len(x.context) - x.fed for x in self.running if x.awaits is None)
        want = len(r.context) - self.reuse.covered(r) + unfed + len(self.running) + 1
        if self.cache.free_cells() < want:
            self.reuse.evict(want)
            want = len(r.context) - self.reuse.covered(r) + unfed + len(self.running) + 1
        return self.cache.free_cells() >= want

    def _wake_waiters(self) -> None:
        """Requests waiting for a prefix that is now computed (or abandoned) start."""
        for r in self.running:
            if r.awaits is not None and not self.reuse.waiting_on(r.awaits):
                self.reuse.attach(r)

    def _plan(self, events: list[Event]) -> _Plan:
        """Who feeds how many tokens: decode tokens first, then context chunks."""
        plan = _Plan()
        budget = self.config.max_batch
        for r in sorted(self.running, key=lambda r: not r.decoding):
            if budget == 0:
                break
            if r.awaits is not None:
                continue
            count = self._fit(r, min(len(r.context) - r.fed, budget))
            if count == 0:
                events.append(self._finish(r, "length"))
                continue
            samples = r.fed + count == len(r.context)
            plan.tokens += r.context[r.fed : r.fed + count]
            plan.positions += range(r.fed, r.fed + count)
            plan.seqs += [r.seq] * count
            plan.slots.append((r, count, samples))
            plan.prefill += 0 if r.decoding else count
            budget -= count
        return plan

    def _fit(self, r: Request, count: int) -> int:
        """Tokens of ``r`` that fit its context now, shifting the context first if needed."""
        keep, discard = self.context.cut(r.fed, count, 0)
        if discard:
            keep, discard = self.context.cut(r.fed, count, shared_prefix(self.cache, r.seq))
        if discard:
            self.reuse.on_shift(r, keep)
            self.cache.remove(r.seq, keep, keep + discard)  # later keys re-rotated by RoPE
            del r.context[keep : keep + discard]
            r.fed -= discard
            self.stats.shifts += 1
        return self.context.room(r.fed, count)

    def _forward(self, plan: _Plan) -> torch.Tensor:
        rows = list(itertools.accumulate(count for _, count, _ in plan.slots))
        outputs = [row - 1 for row, (_, _, s) in zip(rows, plan.slots, strict=True) if s]
        batch = Batch(plan.positions, plan.seqs)
        return self.model.forward(plan.tokens, batch, self.cache, outputs=outputs)

    def _make_room(self, needed: int, error: CacheFullError) -> bool:
        """Evict idle holders (LRU), else preempt the youngest request that computes;
        False if nothing is left to give way."""
        if self.reuse.evict(needed):
            return True
        computing = [r for r in self.running if r.awaits is None]
        if len(computing) <= 1:
            return False
        victim = max(computing, key=lambda r: r.admitted)
        log.info("preempting request %d (%s)", victim.id, error)
        self._preempt(victim)
        return True

    def _preempt(self, victim: Request) -> None:
        """The preemption hook: the victim's cells go (or are parked), it queues first."""
        self.reuse.on_preempt(victim)
        if self.press is not None:
            self.press.preempted(victim)
        self.preemption.preempt(self.cache, victim)
        if isinstance(victim.parked, Parked):
            self.stats.spills += 1
            self.stats.spilled_bytes += victim.parked.nbytes
        self.running.remove(victim)
        victim.seq, victim.fed, victim.awaits = -1, 0, None
        self.waiting.appendleft(victim)
        victim.preemptions += 1
        self.stats.preemptions += 1

    def _advance(self, plan: _Plan, logits: torch.Tensor, events: list[Event]) -> int:
        """Book the forward's tokens and sample where a context ended; returns tokens sampled."""
        self.stats.forwards += 1
        picker = _Picker(logits)
        row = 0
        for r, count, samples in plan.slots:
            r.fed += count
            self.reuse.on_fed(r, count)
            r.computed += count
            self.stats.computed_tokens += count
            if not samples:
                continue
            if self.press is not None:
                self.press.sampled(r)
            self.reuse.on_prefilled(r)
            events.append(self._accept(r, picker.pick(row, r)))
            row += 1
        return row

    def _time(self, plan: _Plan, sampled: int, seconds: float) -> None:
        if plan.prefill:
            self.stats.prefill_tokens += plan.prefill
            self.stats.prefill_seconds += seconds
        else:
            self.stats.decode_tokens += sampled
            self.stats.decode_seconds += seconds

    def _accept(self, r: Request, token: int) -> Event:
        text, reason = r.accept(token)
        self.stats.generated_tokens += 1
        if reason is not None:
            return self._finish(r, reason, token, text)
        return r.emit(Event(r.id, text, token))

    def _finish(self, r: Request, reason: str, token: int | None = None, text: str = "") -> Event:
        """Keep the request's whole blocks as a prefix holder, free the rest, end it."""
        self._count_held(r)
        if self.press is not None:
            self.press.finished(r)
        self.reuse.release(r)
        self.running.remove(r)
        r.seq, r.awaits = -1, None
        return self._end(r, reason, token, text)

    def _count_held(self, r: Request) -> None:
        """Book the bytes ``r``'s cells hold against the fp16 bytes of what it saw."""
        held = self.cache.held_bytes(r.seq)
        if held:
            self.stats.held_bytes += held
            seen = len(r.tokens) - 1  # every token but the last sampled one went in
            self.stats.history_fp16_bytes += seen * fp16_row_bytes(self.cache)

    def _end(self, r: Request, reason: str, token: int | None = None, text: str = "") -> Event:
        text += r.flush(reason)
        r.finish_reason = reason
        self.stats.finished += 1
        return r.emit(Event(r.id, text, token, finished=True, finish_reason=reason))

    def fail_all(self, error: BaseException) -> None:
        """End every running and queued request with ``error: ...`` and free their cells,
        so the pool stays usable after a failed step."""
        for r in self.running:
            self.reuse.on_preempt(r)
            self.cache.remove(r.seq, 0)
        for r in [*self.running, *self.waiting]:
            r.finish_reason = f"error: {error}"
            r.emit(Event(r.id, "", None, finished=True, finish_reason=r.finish_reason))
        self.running.clear()
        self.waiting.clear()

    # ---- introspection ---------------------------------------------------------------
    def holder_cells(self) -> int:
        """Cells held by idle prefix holders; cells they share count once."""
        held: set[int] = set()
        for h in self.reuse.holders():
            held.update(self.cache.cells_of(h).tolist())
        return len(held)

    def running_cells(self) -> int:
        """Cells the running requests use (idle holders' cells are free to evict)."""
        used: set[int] = set()
        for r in self.running:
            used.update(self.cache.cells_of(r.seq).tolist())
        return len(used)

    def metrics(self) -> dict[str, float]:
        """A flat snapshot of gauges and counters (``prefix_miss_total:<reason>`` per reason)."""
        s = self.stats
        used = self.cache.used_cells()
        snap: dict[str, float] = {
            "cells_total": self.cache.num_cells,
            "cells_used": used,
            "cells_free": self.cache.num_cells - used,
            "cells_running": self.running_cells(),
            "prefix_blocks": self.reuse.blocks(),
            "running": len(self.running),
            "queued": len(self.waiting) + self._inbox.qsize(),
            "prompt_tokens_total": s.prompt_tokens,
            "prefix_reused_tokens_total": s.reused_tokens,
            "prefix_store_tokens_total": s.store_tokens,
            "prefix_hit_rate": s.reused_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "computed_tokens_total": s.computed_tokens,
            "generated_tokens_total": s.generated_tokens,
            "forwards_total": s.forwards,
            "context_shifts_total": s.shifts,
            "evictions_total": s.evictions,
            "preemptions_total": s.preemptions,
            "restores_total": s.restores,
            "spills_total": s.spills,
            "spilled_bytes_total": s.spilled_bytes,
            "store_published_total": s.store_published,
            "store_rejected_total": s.store_rejected,
            "store_errors_total": s.store_errors,
            "requests_finished_total": s.finished,
            "held_bytes": self.cache.held_bytes(),
            "checkpoints": self.reuse.resumer.count(),
            "checkpoint_bytes": self.reuse.resumer.nbytes(),
            "checkpoint_restores_total": self.reuse.resumer.restores,
            "pressed_cells_total": s.pressed_cells,
            "press_skipped_total": s.press_skipped,
        }
        for reason in MISS_REASONS:
            snap[f"prefix_miss_total:{reason}"] = s.misses[reason]
        return snap

    def close(self) -> None:
        """Release the cache storage."""
        self.cache.close()

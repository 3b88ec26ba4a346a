"""Several files decoded together in one cell cache: one batched decoder step for all.

Each file in flight holds a *slot*: window ``slot`` of a :class:`WhisperKVCache` (its current
30 s of cross K/V) and the cache sequences ``slot * K .. slot * K + K - 1`` (K = the most
sequences one search needs: beams and their children, or ``best_of`` samples)::

    slot 0: file a  window 0 = a's cross K/V   seqs 0..K-1    search (prompt or one token)
    slot 1: file b  window 1 = b's cross K/V   seqs K..2K-1   search
    ...     every search's rows  ->  one forward_decoder_step  ->  logits back to each search

The self-attention cells of all sequences share one pool. A slot whose search ends hands the
decode to its file (:class:`~kvcache.transcription.longform.LongForm`), which asks for a
fallback decode (same window, new temperature), a new window (encoded, its cross K/V written
over the slot's), or nothing (the next file takes the slot). New windows of several slots are
encoded in one encoder batch. A file's decodes do not depend on its neighbours: its
transcript equals the file transcribed alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcache.models.whisper import Whisper
from kvcache.models.whisper_decode import WhisperKVCache, forward_decoder_step
from kvcache.transcription.longform import LongForm, Request
from kvcache.transcription.options import TranscribeOptions
from kvcache.transcription.rules import LogitRules
from kvcache.transcription.search import BeamSearch, SampleSearch, Search, SearchSpec

RulesFn = Callable[[bool], LogitRules]  # timestamps? -> the logit rules


@dataclass
class _Slot:
    job: LongForm
    request: Request | None = None
    search: Search | None = None


def make_search(
    request: Request,
    seqs: list[int],
    rules: LogitRules,
    options: TranscribeOptions,
    generator: torch.Generator | None,
) -> Search:
    """Beam search at temperature 0 with beams, greedy at 0 without, else best_of samples."""
    spec = SearchSpec(request.prompt, rules, request.max_new, request.temperature)
    if request.temperature > 0:
        return SampleSearch(spec, seqs[: options.best_of], generator)
    if options.beam_size > 1:
        return BeamSearch(spec, seqs, options.beam_size, options.patience)
    return SampleSearch(spec, seqs[:1])


class BatchDecoder:
    """Decode the windows of many files, ``max_batch`` at a time, in one WhisperKVCache."""

    def __init__(
        self, model: Whisper, rules: RulesFn, options: TranscribeOptions, max_batch: int = 8
    ) -> None:
        self.model = model
        self.rules = rules
        self.options = options
        self.max_batch = max_batch
        self.cache: WhisperKVCache | None = None

    def _seqs(self, slot: int) -> list[int]:
        k = self.options.seqs_per_file
        return list(range(slot * k, (slot + 1) * k))

    def _new_cache(self, audio: torch.Tensor) -> WhisperKVCache:
        """A cache with one window per slot and a pool sized for a full search per slot."""
        ctx, k = self.model.config.n_text_ctx, self.options.seqs_per_file
        slots = int(audio.shape[0])
        cells = slots * (ctx + (k - 1) * (ctx // 2))  # a prompt + k branches of half a context
        return WhisperKVCache(
            self.model, audio, max_sequences=slots * k, capacity=-(-cells // (slots * k))
        )

    @torch.inference_mode()
    def run(self, jobs: list[LongForm], on_advance: Callable[[int], None] | None = None) -> None:
        """Decode every job to its end; ``on_advance(frames)`` after each finished window."""
        queue = deque(jobs)
        slots: list[_Slot | None] = [None] * min(self.max_batch, len(jobs))
        try:
            while True:
                self._assign(slots, queue)
                if all(s is None for s in slots):
                    break
                self._encode(slots)
                self._start(slots)
                self._step(slots, on_advance)
        finally:
            if self.cache is not None:
                self.cache.close()
                self.cache = None

    def _assign(self, slots: list[_Slot | None], queue: deque[LongForm]) -> None:
        """Idle slots get their job's next request, or the next job's first."""
        for i, slot in enumerate(slots):
            while slot is None or (slot.search is None and slot.request is None):
                if slot is not None:
                    slot.request = slot.job.request()
                    if slot.request is not None:
                        break
                slot = _Slot(queue.popleft()) if queue else None
                slots[i] = slot
                if slot is None:
                    break

    def _encode(self, slots: list[_Slot | None]) -> None:
        """Encode every new window in one batch; write its cross K/V over its slot's."""
        new = [i for i, s in enumerate(slots) if s and s.request and s.request.features is not None]
        if not new:
            return
        feats = torch.stack([slots[i].request.features for i in new])  # type: ignore[union-attr,misc]
        with torch.inference_mode():
            audio = self.model.forward_encoder(feats)  # [E, 1500, n]
        if self.cache is None:  # the first windows of every slot (zeros for a slot left idle)
            full = audio.new_zeros(len(slots), *audio.shape[1:])  # [slots, 1500, n]
            full[new] = audio
            self.cache = self._new_cache(full)
            return
        for j, i in enumerate(new):
            self.cache.set_audio(i, audio[j])

    def _start(self, slots: list[_Slot | None]) -> None:
        """A search for each slot with a request; its sequences start empty on its window."""
        assert self.cache is not None
        for i, slot in enumerate(slots):
            if slot is None or slot.request is None:
                continue
            seqs = self._seqs(i)
            for s in seqs:
                self.cache.remove(s)
                self.cache.attach(s, i)
            rules = self.rules(not self.options.without_timestamps)
            slot.search = make_search(slot.request, seqs, rules, self.options, slot.job.generator)
            slot.request = None

    def _step(self, slots: list[_Slot | None], on_advance: Callable[[int], None] | None) -> None:
        """One decoder forward over every search's rows; finished searches report back."""
        assert self.cache is not None
        tokens: list[int] = []
        seqs: list[int] = []
        rows: list[int] = []
        spans: list[tuple[_Slot, int, int]] = []  # slot, first logits row, rows
        for slot in slots:
            if slot is None or slot.search is None:
                continue
            t, s, r = slot.search.rows()
            spans.append((slot, len(rows), len(r)))
            rows.extend(len(tokens) + x for x in r)
            tokens.extend(t)
            seqs.extend(s)
        logits = forward_decoder_step(self.model, tokens, seqs, self.cache, logits_rows=rows)
        for slot, first, n in spans:
            assert slot.search is not None
            if slot.search.advance(logits[first : first + n], self.cache):
                advanced = slot.job.take(slot.search.result())
                slot.search = None
                if on_advance is not None and advanced:
                    on_advance(advanced)

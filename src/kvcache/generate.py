"""Text generation: a thin facade over the engine (:mod:`kvcache.engine`).

``Generator`` is an :class:`~kvcache.engine.Engine` configured for one process generating
from a few prompts: the context *shifts* when it is full (keep the first ``keep`` tokens,
drop half of the rest, re-rotate later keys) unless a sliding ``window`` forgets old cells
instead, and prompts share their common prefix down to the token (``block_size=1``):
``kvcache generate -n 4`` computes the prompt once and the other three sequences wait for
it and take its cells. ``kvcache serve`` runs the same engine with a server's settings.

Gemma 3 (sliding-window and global layers over a hybrid cache) runs on the engine too, its
prefix hits restoring the local layers from checkpoints (:mod:`kvcache.engine.checkpoints`);
:func:`stream_tokens` decodes one sequence of any model with ``forward`` over a caller-owned
cache, chunked prefill then one token a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.engine.params import EngineConfig, RequestParams
from kvcache.engine.request import Event, Request
from kvcache.engine.scheduler import Engine, Prompt
from kvcache.engine.session import restore_session, session_snapshot
from kvcache.engine.stats import EngineStats
from kvcache.errors import InvalidArgumentError, NotSupportedError
from kvcache.models.llama import Llama, WeightKind, WeightReader
from kvcache.models.sampling import SamplingParams, sample
from kvcache.protocol import Cache
from kvcache.snapshot import load_any
from kvcache.text.tokenizer import Tokenizer
from kvcache.weights.bundled import resolve_model
from kvcache.weights.gguf import GGUFFile, peek_architecture

TextEvent = Event  # the name this module's events had before the engines were one
GenerationStats = EngineStats


class GenerationConfig(RequestParams):
    """The engine's request options under ``generate``'s names: ``max_new_tokens`` (128)."""

    def __init__(
        self,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
    ) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise InvalidArgumentError("max_new_tokens", max_new_tokens, "an int >= 1")
        if max_new_tokens < 1:
            raise InvalidArgumentError("max_new_tokens", max_new_tokens, "an int >= 1")
        super().__init__(
            max_tokens=max_new_tokens,
            sampling=SamplingParams() if sampling is None else sampling,
            stop=stop,  # type: ignore[arg-type]  # RequestParams keeps a tuple
            ignore_eos=ignore_eos,
        )

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens


@dataclass
class Completion:
    """Everything one request produced."""

    request: int
    prompt: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    cached_tokens: int = 0  # prompt tokens reused (a prefix hit, a session) instead of computed


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
        block_size: int = 1,
        spill: str = "memory",
        press: str | None = None,
        press_cells: int | None = None,
        press_every: int = 16,
    ) -> None:
        """``capacity``: positions per sequence (past it the context shifts); ``keep``:
        tokens a shift keeps at the start (default min(4, capacity // 4)); ``codec``: how
        the cache stores K/V (a ``kvcache.codecs`` spec; None: the model's dtype);
        ``spill``: where a preempted sequence's K/V waits ("memory" or "disk:PATH");
        ``press``: a ``kvcache.press`` spec applied to each request after its prefill;
        ``press_cells``: and during decode, each request pressed back to that many cells
        every ``press_every`` steps once it holds more."""
        config = EngineConfig(
            capacity=capacity,
            max_sequences=max_sequences,
            max_batch=max_batch,
            window=window,
            context="shift",
            keep=keep,
            codec=codec,
            block_size=block_size,
            spill=spill,
            press=press,
            press_cells=press_cells,
            press_every=press_every,
        )
        self.engine = Engine(model, tokenizer, config)
        self.restore_seconds = 0.0  # reading and restoring session files
        self.results: dict[int, Completion] = {}
        self._requests: dict[int, Request] = {}

    @property
    def cache(self) -> CausalCache:
        return self.engine.cache

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    # ---- submitting ------------------------------------------------------------------
    def add(self, prompt: Prompt, config: RequestParams | None = None) -> int:
        """Queue one prompt (text or token ids); it joins the batch at the next step."""
        return self.add_many([prompt], config)[0]

    def add_many(self, prompts: Sequence[Prompt], config: RequestParams | None = None) -> list[int]:
        """Queue prompts (all checked before any is queued); sampled ones draw from seed + i."""
        requests = self.engine.submit_many(
            prompts, GenerationConfig() if config is None else config
        )
        self._requests.update((r.id, r) for r in requests)
        return [r.id for r in requests]

    def cancel(self, request: int) -> None:
        """Stop a request at the next step (its text so far stays in ``results``)."""
        self._requests[request].cancel()

    # ---- running ---------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return self.engine.busy

    def run(self) -> Iterator[Event]:
        """Step until every request has finished, yielding text as it appears."""
        while self.busy:
            yield from self.step()

    def step(self) -> list[Event]:
        """One forward over all active sequences; returns the events it produced."""
        events = self.engine.step()
        for event in events:
            if event.finished:
                r = self._requests.pop(event.request)
                self.results[r.id] = Completion(
                    r.id,
                    r.prompt,
                    r.generated,
                    "".join(r.text),
                    r.finish_reason or "",
                    r.cached_tokens or 0,
                )
        return events

    # ---- sessions (kvcache.engine.session) ---------------------------------------------
    def load_session(self, path: str | Path, prompt: Sequence[int]) -> tuple[int, int]:
        """Restore the cells of a session file whose tokens start ``prompt``, as a prefix
        the prompt then shares; (tokens restored, tokens in the file). Raises SnapshotError
        (changing nothing) for a damaged file or another model's or codec's."""
        start = time.perf_counter()
        snap = load_any(path)
        restored = restore_session(self.engine, snap, prompt)
        self.restore_seconds += time.perf_counter() - start
        return restored, len(snap)

    def save_session(self, path: str | Path, prompt: Sequence[int]) -> int:
        """Save the cells of the longest prefix of ``prompt`` held (after a run); tokens saved."""
        snap = session_snapshot(self.engine, list(prompt))
        if snap is None:
            return 0
        snap.save(path)
        return len(snap)

    def close(self) -> None:
        """Release the cache storage."""
        self.engine.close()


def generate(
    model: Llama,
    tokenizer: Tokenizer | None,
    prompts: Prompt | Sequence[Prompt],
    config: RequestParams | None = None,
    *,
    capacity: int = 4096,
    max_batch: int = 512,
    window: int | None = None,
    codec: str | None = None,
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
        codec=codec,
    )
    try:
        ids = gen.add_many(batch, config)
        for _ in gen.run():
            pass
        return [gen.results[i] for i in ids]
    finally:
        gen.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        return [prompts]  # type: ignore[list-item]
    if isinstance(prompts[0], int):
        return [[int(t) for t in prompts]]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


class CausalLM(Protocol):
    """What :func:`stream_tokens` needs of a model."""

    def forward(
        self,
        tokens: Sequence[int],
        batch: Batch,
        cache: Any,
        *,
        outputs: Sequence[int] | None = None,
    ) -> Any: ...


@dataclass
class DecodeStats:
    """Counters of one :func:`stream_tokens` run (seconds of wall clock)."""

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0  # tokens sampled by decode-only forwards (the first is prefill's)
    decode_seconds: float = 0.0

    @property
    def prefill_rate(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_rate(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def stream_tokens(
    model: CausalLM,
    cache: Cache,
    prompt: Sequence[int],
    config: RequestParams | None = None,
    *,
    stop_ids: frozenset[int] = frozenset(),
    seq: int = 0,
    chunk: int = 512,
    stats: DecodeStats | None = None,
    on_forward: Callable[[Batch], None] | None = None,
) -> Iterator[int]:
    """Tokens generated after ``prompt`` for sequence ``seq`` of ``cache`` (positions from 0):
    the prompt in forwards of at most ``chunk`` tokens (only the last row's logits), then one
    token a forward, until ``config.max_tokens``, a token of ``stop_ids`` (yielded; not with
    ``ignore_eos``) or the end. ``on_forward`` sees each forward's batch after it ran."""
    p = GenerationConfig() if config is None else config
    ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidArgumentError("prompt", ids, "1+ token ids")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InvalidArgumentError("chunk", chunk, "an int >= 1")
    s = DecodeStats() if stats is None else stats
    rng = p.sampling.generator()
    start = time.perf_counter()
    for begin in range(0, len(ids), chunk):
        part = ids[begin : begin + chunk]
        last = begin + len(part) == len(ids)
        batch = Batch.single(seq, begin, len(part))
        logits = model.forward(part, batch, cache, outputs=[len(part) - 1] if last else [])
        if on_forward is not None:
            on_forward(batch)
    s.prompt_tokens += len(ids)
    s.prefill_seconds += time.perf_counter() - start
    for step in range(p.max_tokens):
        token = sample(logits[-1], p.sampling, rng)
        yield token
        if (token in stop_ids and not p.ignore_eos) or step + 1 == p.max_tokens:
            return
        start = time.perf_counter()
        batch = Batch.single(seq, len(ids) + step, 1)
        logits = model.forward([token], batch, cache)
        s.decode_tokens += 1
        s.decode_seconds += time.perf_counter() - start
        if on_forward is not None:
            on_forward(batch)


def _load_llama(gguf: GGUFFile, dtype: torch.dtype, weights: WeightKind) -> Any:
    from kvcache.models.llama import Llama

    return Llama.from_gguf(gguf, dtype=dtype, weights=weights)


def _load_gemma3(gguf: GGUFFile, dtype: torch.dtype, weights: WeightKind) -> Any:
    from kvcache.models.gemma3 import Gemma3

    return Gemma3.from_gguf(gguf, dtype=dtype, weights=weights)


# general.architecture -> the loader of its model
MODELS: dict[str, Callable[[GGUFFile, torch.dtype, WeightKind], Any]] = {
    "llama": _load_llama,
    "gemma3": _load_gemma3,
}


def load_model(
    spec: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    weights: WeightKind = "native",
    before_weights: Callable[[str], None] | None = None,
) -> tuple[Any, Tokenizer]:
    """Model and tokenizer from one read of a GGUF: ``spec`` is a file or a bundled name
    (``smollm2``, the default, or ``gemma3``); the architecture comes from the file;
    ``weights`` the kind (``native`` blocks as stored, ``fp32``, ``bf16``; see ``from_gguf``).
    ``before_weights(arch)`` runs once the architecture is known, before the weights load
    (a caller's check of options against the model)."""
    WeightReader.of(weights, dtype)  # a bad kind fails before the file is read
    path = resolve_model(spec)
    arch = peek_architecture(path)
    if arch not in MODELS:
        raise NotSupportedError(
            f"{path.name}: general.architecture={arch!r} is not supported; "
            f"expected one of {sorted(MODELS)}"
        )
    if before_weights is not None:
        before_weights(arch)
    with GGUFFile(path) as gguf:
        tokenizer = Tokenizer.from_gguf(gguf)
        gguf.release("tokenizer.")  # the parsed vocabulary, gone before the weights arrive
        return MODELS[arch](gguf, dtype, weights), tokenizer

"""Gemma 3 in the engine: prefix reuse that survives the sliding window (global layers shared,
local layers restored from a checkpoint), bit-identical to a fresh prefill with the same
chunks; checkpoints the window has moved past are never used (a miss reason says so); each
sequence's local cells stay within window + the forward's tokens; preempted requests spill
both parts and resume."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
import torch

from kvcache.batch import Batch
from kvcache.engine.checkpoints import LocalCheckpoints
from kvcache.engine.params import EngineConfig, RequestParams
from kvcache.engine.scheduler import Engine
from kvcache.models.gemma3 import Gemma3
from kvcache.models.sampling import SamplingParams

CHUNK = 128
GREEDY = SamplingParams(temperature=0.0)


class Recorder:
    """The model, recording every forward (tokens, positions, logits) and checking after each
    that every sequence's local-layer cells are within window + the forward's tokens."""

    def __init__(self, model: Gemma3) -> None:
        self.model = model
        self.calls: list[tuple[list[int], list[int], torch.Tensor]] = []
        self.worst = 0  # most local cells a sequence held past window + T

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward(self, tokens: Any, batch: Batch, cache: Any, **kw: Any) -> torch.Tensor:
        logits = self.model.forward(tokens, batch, cache, **kw)
        self.calls.append((list(tokens), list(batch.positions), logits.clone()))
        bound = self.model.config.sliding_window + len(batch)
        for seq in cache.local.sequences():
            self.worst = max(self.worst, len(cache.local.cells_of(seq)) - bound)
        return logits


def _replay(model: Gemma3, forwards: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """A fresh cache fed the same forwards (one sequence); the last forward's logits."""
    cache = model.new_cache(1024, max_sequences=2, max_batch=CHUNK)
    logits = torch.empty(0)
    for tokens, positions in forwards:
        logits = model.forward(
            tokens, Batch(positions, [0] * len(tokens)), cache, outputs=[-1 + len(tokens)]
        )
    return logits


@pytest.fixture(scope="module")
def turns(gemma3: Gemma3) -> dict[str, Any]:
    """Turn 1: a 700-token prompt (past the window), 8 tokens; turn 2 extends what it fed."""
    rng = random.Random(0)
    a = [rng.randrange(1000, 20000) for _ in range(700)]
    rec = Recorder(gemma3)
    config = EngineConfig(capacity=1024, max_sequences=2, max_batch=CHUNK, preemption="recompute")
    engine = Engine(rec, None, config)  # type: ignore[arg-type]
    r1 = engine.submit(a, RequestParams(max_tokens=8, sampling=GREEDY))
    engine.run()
    first = len(rec.calls)
    b = a + r1.generated[:-1] + [rng.randrange(1000, 20000) for _ in range(20)]
    r2 = engine.submit(b, RequestParams(max_tokens=1, sampling=GREEDY))
    engine.run()
    return {"engine": engine, "rec": rec, "a": a, "b": b, "r2": r2, "first": first, "rng": rng}


def test_a_second_turn_reuses_past_the_window_bit_identically(turns: dict[str, Any]):
    rec, r2, b = turns["rec"], turns["r2"], turns["b"]
    p = r2.cached_tokens
    assert p == 704, p  # the whole blocks of what turn 1 fed (707 tokens), window long moved
    assert turns["engine"].metrics()["checkpoint_restores_total"] == 1
    turn1 = [(t, pos) for t, pos, _ in rec.calls[: turns["first"]] if pos[0] < p]
    turn2 = [(t, pos) for t, pos, _ in rec.calls[turns["first"] :]]
    assert turn2[0][1][0] == p and sum(len(t) for t, _ in turn2) == len(b) - p
    fresh = _replay(rec.model, turn1 + turn2)
    assert torch.equal(rec.calls[-1][2], fresh)


def test_local_cells_stay_within_window_plus_the_forward(turns: dict[str, Any]):
    assert turns["rec"].worst <= 0


def test_a_checkpoint_the_window_moved_past_is_never_used(turns: dict[str, Any]):
    """Every holder keeps only its newest checkpoint (cells from past 560 - window): a prompt
    that leaves the cached ones at 560 computes everything and the miss is named."""
    engine, rec, rng = turns["engine"], turns["rec"], turns["rng"]
    ckpts = engine.reuse.resumer
    assert isinstance(ckpts, LocalCheckpoints)
    for seq, ring in ckpts.rings.items():
        ckpts.rings[seq] = deque([ring[-1]], maxlen=ckpts.size)
        assert ring[-1].positions[0] > 560 - rec.model.config.window
    misses = engine.stats.misses["no_checkpoint"]
    c = turns["a"][:560] + [rng.randrange(1000, 20000) for _ in range(10)]
    start = len(rec.calls)
    r3 = engine.submit(c, RequestParams(max_tokens=1, sampling=GREEDY))
    engine.run()
    assert r3.cached_tokens == 0
    assert engine.stats.misses["no_checkpoint"] == misses + 1
    forwards = [(t, pos) for t, pos, _ in rec.calls[start:]]
    assert forwards[0][1][0] == 0
    assert torch.equal(rec.calls[-1][2], _replay(rec.model, forwards))


@pytest.mark.parametrize("spill", ["memory", "disk"])
def test_preempted_requests_spill_both_parts_and_resume(gemma3: Gemma3, tmp_path: Any, spill: str):
    """A pool of one request's cells under three: requests are preempted and spilled (the
    global part and the local window, to memory or to a file) and resume where they left
    off; every request's tokens equal those of a pool that never preempts, the local cells
    stay within window + T, and no spill file is left behind."""
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 20000) for _ in range(300)] for _ in range(3)]
    params = RequestParams(max_tokens=80, sampling=GREEDY)

    def run(**kw: Any) -> tuple[Engine, Recorder, list[list[int]]]:
        rec = Recorder(gemma3)
        engine = Engine(rec, None, EngineConfig(max_sequences=3, max_batch=CHUNK, **kw))  # type: ignore[arg-type]
        requests = [engine.submit(p, params) for p in prompts]
        engine.run()
        return engine, rec, [r.generated for r in requests]

    _, _, ref = run(capacity=1024)
    where = "memory" if spill == "memory" else f"disk:{tmp_path}"
    engine, rec, out = run(capacity=700, pool_sequences=1, preemption="spill", spill=where)
    assert engine.stats.spills >= 1 and engine.stats.restores == engine.stats.spills
    assert out == ref
    assert rec.worst <= 0
    assert not list(tmp_path.iterdir())


def _two_turns(
    gemma3: Gemma3, sessions: int, new: int, prefix_cache: bool, **config: Any
) -> list[Any]:
    """``sessions`` 700-token first turns together, then their second turns together (what
    each fed + ``new`` tokens); the second turns' requests."""
    rng = random.Random(2)
    firsts = [[rng.randrange(1000, 20000) for _ in range(700)] for _ in range(sessions)]
    params = RequestParams(max_tokens=4, sampling=GREEDY)
    c = EngineConfig(max_sequences=sessions, max_batch=CHUNK, prefix_cache=prefix_cache, **config)
    e = Engine(gemma3, None, c)  # type: ignore[arg-type]
    ones = [e.submit(p, params) for p in firsts]
    e.run()
    seconds = [
        e.submit(p + r.generated[:-1] + [rng.randrange(1000, 20000) for _ in range(new)], params)
        for p, r in zip(firsts, ones, strict=True)
    ]
    e.run()
    return seconds


def test_admission_reads_the_global_part_and_keeps_the_holders(gemma3: Gemma3):
    """Two second turns of 400 new tokens each: admitting the second beside the first takes
    more cells than the sliding part has free, but that part is sized for every running
    request's window; the engine admits by the global part, so no idle holder is evicted for
    room and both turns reuse their first turn (with the free cells of the fuller part, the
    second turn's own holder went and it computed everything). The pool's sliding part holds
    max_sequences requests however few sequences' global cells the pool has."""
    reused = _two_turns(gemma3, 2, 400, True, capacity=2048)
    fresh = _two_turns(gemma3, 2, 400, False, capacity=2048)
    assert all(r.cached_tokens >= 640 for r in reused), [r.cached_tokens for r in reused]
    assert [r.generated for r in reused] == [r.generated for r in fresh]
    config = EngineConfig(capacity=1024, max_sequences=3, pool_sequences=1, max_batch=CHUNK)
    cache = Engine(gemma3, None, config).cache  # type: ignore[arg-type]
    window = gemma3.config.window
    assert cache.local.num_cells >= 3 * (window + 1) + CHUNK
    assert cache.full.num_cells == 1024
    assert cache.free_cells() == cache.full.free_cells()


def test_many_sequences_resume_from_checkpoints_at_once(gemma3: Gemma3):
    """Four second turns resume together, each from its own checkpoint (taken after a
    128-token chunk: window + chunk cells, more than the local part keeps a sequence): the
    restores take only the window before each resume point, so they fit the local part's
    cells (sized for window + 1 a sequence plus one forward; the full checkpoints did not
    and the engine raised CacheFullError), and each turn's tokens equal those of an engine
    without prefix reuse."""
    reused = _two_turns(gemma3, 4, 20, True, capacity=1024)
    fresh = _two_turns(gemma3, 4, 20, False, capacity=1024)
    assert all(r.cached_tokens >= 640 for r in reused), [r.cached_tokens for r in reused]
    assert [r.generated for r in reused] == [r.generated for r in fresh]

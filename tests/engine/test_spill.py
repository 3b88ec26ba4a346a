"""Spill instead of recompute: more concurrent requests than the pool holds; preempted
requests' cells move into snapshots (host memory or disk) and come back when they resume.
Every request's tokens equal those of a run whose pool holds them all (and the no-cache
reference for the float cache), on the tiny history-sensitive model; a restore that puts
the cells at the wrong positions is caught by the same comparison. Evicted prefix holders
are demoted to the block store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from greedy_reference import greedy, random_prompt
from kvcache.engine import Engine, EngineConfig, Request, RequestParams
from kvcache.engine.metrics import EngineCollector, RateMeter
from kvcache.engine.pressure import Spill
from kvcache.engine.session import restore_session
from kvcache.engine.spill import Parked
from kvcache.engine.store import MemoryStore
from kvcache.errors import InvalidConfigError
from kvcache.models.llama import Llama
from kvcache.snapshot import Snapshot

STEPS = 12


def prompts(n: int) -> list[list[int]]:
    return [random_prompt(20, seed=30 + i) for i in range(n)]


def run(engine: Engine, ps: list[list[int]]) -> list[Request]:
    reqs = [engine.submit(p, RequestParams(max_tokens=STEPS)) for p in ps]
    engine.run()
    assert all(r.finish_reason == "length" for r in reqs)
    return reqs


def tight(codec: str | None, **kwargs: object) -> EngineConfig:
    """4 requests of 20 + 12 tokens at once in one sequence's worth of cells (48)."""
    return EngineConfig(
        capacity=48,
        max_sequences=4,
        pool_sequences=1,
        max_batch=64,
        codec=codec,
        **kwargs,  # type: ignore[arg-type]
    )


def roomy(codec: str | None) -> EngineConfig:
    return EngineConfig(capacity=48, max_sequences=4, max_batch=64, codec=codec)


@pytest.mark.parametrize("codec", [None, "int8", "turbo4"])
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_spilled_requests_complete_as_with_room_for_all(
    history_model: Llama, codec: str | None, tier: str, tmp_path: Path
):
    ps = prompts(4)
    spill = "memory" if tier == "memory" else f"disk:{tmp_path / 'spill'}"
    engine = Engine(history_model, config=tight(codec, spill=spill))
    reqs = run(engine, ps)
    got = [r.generated for r in reqs]
    want = [r.generated for r in run(Engine(history_model, config=roomy(codec)), ps)]
    assert got == want
    if codec is None and tier == "memory":
        assert got == [greedy(history_model, p, STEPS) for p in ps]
    s = engine.stats
    # (a preempted request that held no cells yet has nothing to spill)
    assert s.spills > 0 and s.restores == s.spills and s.preemptions >= s.spills
    assert sum(r.preemptions for r in reqs) == s.preemptions  # each request's own count
    # restored, not recomputed: every token ran through the model once
    assert s.computed_tokens == sum(len(p) + STEPS - 1 for p in ps)
    assert engine.metrics()["spills_total"] == s.spills > 0
    if tier == "disk":
        assert list((tmp_path / "spill").iterdir()) == []  # each file read back and deleted


@pytest.mark.parametrize("preemption", ["spill", "recompute"])
def test_a_request_starts_only_when_its_context_fits(history_model: Llama, preemption: str):
    """vLLM's admission rule: a queued request waits while its context cannot fit beside the
    running ones' (admitted anyway, it was preempted before it held a cell: 7 of the 10
    preemptions of the oversubscribed serve_load run). So every victim holds cells: each
    preemption spills, and recompute preempts no more often."""
    ps = prompts(4)
    engine = Engine(history_model, config=tight(None, preemption=preemption))
    want = [r.generated for r in run(Engine(history_model, config=roomy(None)), ps)]
    assert [r.generated for r in run(engine, ps)] == want
    s = engine.stats
    assert 0 < s.preemptions <= 3  # admitted regardless: 18 (spill), 49 (recompute)
    if preemption == "spill":
        assert s.spills == s.preemptions


def test_recompute_preemption_computes_again(history_model: Llama):
    """The anchor: with recompute preemption the same workload computes more tokens."""
    ps = prompts(4)
    engine = Engine(history_model, config=tight(None, preemption="recompute"))
    want = [r.generated for r in run(Engine(history_model, config=roomy(None)), ps)]
    assert [r.generated for r in run(engine, ps)] == want
    s = engine.stats
    assert s.preemptions > 0 and s.spills == 0 and s.restores == 0
    assert s.computed_tokens > sum(len(p) + STEPS - 1 for p in ps)


def test_a_restore_at_the_wrong_positions_is_caught(
    history_model: Llama, monkeypatch: pytest.MonkeyPatch
):
    """The comparison above sees the cells: restoring them one position later changes the
    tokens (so a restore bug cannot pass it)."""
    resume = Spill.resume

    def shifted(self: Spill, cache, request: Request) -> int:  # type: ignore[no-untyped-def]
        parked = request.parked
        if parked is None:
            return 0  # nothing was spilled (it held no cells)
        assert isinstance(parked, Parked) and isinstance(parked.payload, Snapshot)
        snap = parked.payload
        moved = Snapshot(snap.header, {**snap.tensors, "positions": snap.tensors["positions"] + 1})
        request.parked = Parked(parked.cells, parked.next_position + 1, parked.nbytes, moved)
        return resume(self, cache, request)

    monkeypatch.setattr(Spill, "resume", shifted)
    ps = prompts(4)
    engine = Engine(history_model, config=tight(None))
    got = [r.generated for r in run(engine, ps)]
    assert engine.stats.restores > 0
    assert got != [r.generated for r in run(Engine(history_model, config=roomy(None)), ps)]


def test_spill_metrics_are_exported(history_model: Llama):
    engine = Engine(history_model, config=tight("int8"))
    run(engine, prompts(4))
    collector = EngineCollector(engine.metrics, RateMeter(), lambda: True)
    samples = {s.name: s.value for m in collector.collect() for s in m.samples}
    assert samples["kvcache_spills_total"] == engine.stats.spills > 0
    assert samples["kvcache_spilled_bytes_total"] == engine.stats.spilled_bytes > 0


def test_bad_spill_spec_is_a_typed_error():
    for spec in ("disk:", "host", "memory:1"):
        with pytest.raises(InvalidConfigError, match="spill"):
            EngineConfig(spill=spec)


@pytest.mark.parametrize("policy", ["demote", "drop"])
def test_evicted_holders_are_demoted_to_the_store(history_model: Llama, policy: str):
    """A holder whose blocks the store lacks (restored from a session) is written to the
    store when evicted ("demote"); a second engine then loads them instead of computing
    them. "drop" (the control) loses them."""
    prompt = random_prompt(32, seed=40)
    source = Engine(history_model, config=EngineConfig(capacity=48, max_sequences=1))
    run(source, [prompt])
    snap = source.cache.snapshot(source.reuse.holders()[0], model_id=history_model.model_id)
    snap = Snapshot(snap.header, {**snap.head(32).tensors, "tokens": torch.tensor(prompt)})

    store = MemoryStore()
    cfg = EngineConfig(capacity=48, max_sequences=1, block_size=8, holder_eviction=policy)
    engine = Engine(history_model, config=cfg, model_id="tiny", store=store)
    assert restore_session(engine, snap, prompt) == 32
    assert not store.data  # restored, never published
    run(engine, [random_prompt(30, seed=41)])  # needs the holder's cells: evicted
    assert engine.stats.evictions == 1

    warm = Engine(history_model, config=cfg, model_id="tiny", store=store)
    [r] = run(warm, [[*prompt, 1, 2]])
    assert warm.stats.store_tokens == (32 if policy == "demote" else 0)
    assert r.generated == greedy(history_model, [*prompt, 1, 2], STEPS)


def test_serve_spill_options(tmp_path: Path):
    import argparse

    from kvcache.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser)
    spec = f"disk:{tmp_path}"
    args = parser.parse_args(["--pool-sequences", "2", "--spill", spec])
    config = serve._engine_config(args)
    assert (config.pool, config.preemption, config.spill) == (2, "spill", spec)
    config = serve._engine_config(parser.parse_args(["--spill", "off"]))
    assert config.preemption == "recompute" and config.pool == config.max_sequences
    assert serve._engine_config(parser.parse_args([])).spill == "memory"
    with pytest.raises(InvalidConfigError, match="spill"):
        serve._engine_config(parser.parse_args(["--spill", "tape"]))


def test_prefix_store_none_reuses_the_pool_only(history_model: Llama):
    """``kvcache serve --prefix-store none`` (the no-host-tier baseline of serve_load's
    oversubscribed question): an idle holder in the pool is still shared, but once evicted
    its prefix is computed again, where the default memory store loads it."""
    from kvcache.commands import serve

    assert serve._open_store("none") is None
    assert isinstance(serve._open_store("memory"), MemoryStore)
    prompt = random_prompt(32, seed=42)
    loaded = {}
    for spec in ("none", "memory"):
        cfg = EngineConfig(capacity=48, max_sequences=1, block_size=8)
        engine = Engine(history_model, config=cfg, model_id="tiny", store=serve._open_store(spec))
        run(engine, [prompt])
        [again] = run(engine, [[*prompt, 1]])  # the holder is in the pool: shared
        assert again.cached_tokens == 32
        run(engine, [random_prompt(30, seed=43)])  # needs the holder's cells: evicted
        assert engine.stats.evictions >= 1
        [back] = run(engine, [[*prompt, 2]])
        assert back.generated == greedy(history_model, [*prompt, 2], STEPS)
        loaded[spec] = engine.stats.store_tokens
    assert loaded == {"none": 0, "memory": 32}


def test_a_pressed_request_spills_and_resumes_at_its_next_position(
    history_model: Llama, monkeypatch: pytest.MonkeyPatch
):
    """snapkv:0.5 leaves gaps in a request's positions (20 of a 40-token prompt kept), so a
    spilled request's cell count is not where it goes on: 4 requests of 40 + 40 tokens in
    one sequence's worth of cells (80) spill after their press, and every parked next
    position is the one the cache reported for the sequence before it was spilled."""
    seen: list[tuple[int, int, int]] = []  # (cache's next position, cells, parked's)
    preempt = Spill.preempt

    def spy(self: Spill, cache, request: Request) -> None:  # type: ignore[no-untyped-def]
        nxt, cells = cache.next_position(request.seq), len(cache.cells_of(request.seq))
        preempt(self, cache, request)
        assert isinstance(request.parked, Parked)
        seen.append((nxt, cells, request.parked.next_position))

    monkeypatch.setattr(Spill, "preempt", spy)
    ps = [random_prompt(40, seed=50 + i) for i in range(4)]

    def pressed(**sizes: int) -> tuple[Engine, list[list[int]]]:
        cfg = EngineConfig(capacity=80, max_sequences=4, max_batch=64, press="snapkv:0.5", **sizes)
        engine = Engine(history_model, config=cfg)
        reqs = [engine.submit(p, RequestParams(max_tokens=40)) for p in ps]
        engine.run()
        assert all(r.finish_reason == "length" for r in reqs)
        return engine, [r.generated for r in reqs]

    engine, got = pressed(pool_sequences=1)
    s = engine.stats
    assert s.pressed_cells == 4 * 20
    assert s.spills == s.restores == s.preemptions == len(seen) > 0
    assert all(cells < nxt for nxt, cells, _ in seen)  # spilled after the press: gaps
    assert [parked for _, _, parked in seen] == [nxt for nxt, _, _ in seen]
    seen.clear()
    roomy_engine, want = pressed()
    assert roomy_engine.stats.preemptions == 0 and not seen
    assert got == want

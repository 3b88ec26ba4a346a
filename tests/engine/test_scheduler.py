"""The engine against the model's no-cache forward, on a tiny float64 Llama whose next token
depends on the history (``tests/tiny_models.py``): batching, prefix reuse (the longest holder,
least-recently-used eviction, block stores with every codec), preemption, cancellation,
validation. Wrong K/V anywhere changes the tokens."""

from __future__ import annotations

import pytest
import torch

from greedy_reference import greedy, random_prompt
from kvcache.codecs import CODECS
from kvcache.engine import Engine, EngineConfig, Request, RequestParams
from kvcache.engine.store import MemoryStore
from kvcache.errors import InvalidArgumentError, InvalidConfigError, StoreUnavailableError
from kvcache.models.llama import Llama


def prompts(n: int, length: int = 21, shared: int = 0) -> list[list[int]]:
    """``n`` random prompts whose first ``shared`` tokens are the same."""
    head = random_prompt(shared, seed=11)
    return [head + random_prompt(length - shared, seed=12 + i) for i in range(n)]


def run(engine: Engine, ps: list[list[int]], max_tokens: int = 8) -> list[Request]:
    """Submit ``ps`` together, step until all finished; the requests."""
    reqs = [engine.submit(p, RequestParams(max_tokens=max_tokens)) for p in ps]
    engine.run()
    assert all(r.finish_reason == "length" for r in reqs)
    return reqs


def test_concurrent_requests_equal_the_no_cache_reference(history_model: Llama):
    ps = prompts(8, length=13)
    engine = Engine(history_model, config=EngineConfig(capacity=64, max_sequences=8, max_batch=40))
    got = [r.generated for r in run(engine, ps)]
    assert got == [greedy(history_model, p, 8) for p in ps]
    assert engine.stats.forwards < 8 * 9  # batched, not one request after another


def test_queue_wait_ends_when_the_request_first_starts(history_model: Llama):
    """One request at a time: the second waits in the queue until the first has finished,
    so its queue wait covers the first one's tokens; the first starts at once."""
    engine = Engine(history_model, config=EngineConfig(capacity=64, max_sequences=1))
    first, second = run(engine, prompts(2))
    assert first.started_at is not None and second.started_at is not None
    assert first.first_token_at is not None and second.first_token_at is not None
    assert first.submitted <= first.started_at < first.first_token_at <= second.started_at
    assert second.queued_seconds == second.started_at - second.submitted
    assert second.queued_seconds > first.first_token_at - first.submitted


def test_shared_prefix_prefills_only_new_tokens(history_model: Llama):
    engine = Engine(history_model, config=EngineConfig(capacity=128, max_sequences=2, block_size=8))
    first, second = prompts(2, length=30, shared=20)
    [r1] = run(engine, [first])
    # the first request left blocks of its prompt + output: 30 + 8 - 1 = 37 -> 32 tokens held
    follow = first + r1.generated[:2] + second[20:24]  # continues the first conversation
    [r] = run(engine, [follow])
    assert r.cached_tokens == 32  # 4 whole blocks shared through copy_prefix
    assert r.computed == len(follow) - 32 + 7  # the rest of the prompt + 7 decode feeds
    assert r.generated == greedy(history_model, follow, 8)
    [other] = run(engine, [second])
    assert other.cached_tokens == 16  # the 20 shared tokens hold 2 whole blocks
    assert other.generated == greedy(history_model, second, 8)


def test_the_longest_holder_wins_over_a_newer_shorter_one(history_model: Llama):
    engine = Engine(history_model, config=EngineConfig(capacity=64, max_sequences=1, block_size=8))
    base, tail = random_prompt(16, seed=1), random_prompt(16, seed=2)
    run(engine, [base + tail], max_tokens=2)  # holds 4 blocks
    [newer] = run(engine, [[*base, 5, 6, 7]], max_tokens=2)  # shares 2 of them, holds 2
    assert newer.cached_tokens == 16
    longer = [*base, *tail, 1, 2, 3, 4, 5]
    [r] = run(engine, [longer])
    assert r.cached_tokens == 32  # from the older holder: the newer one holds only 16
    assert r.generated == greedy(history_model, longer, 8)


def test_holders_are_evicted_least_recently_used_first(history_model: Llama):
    # 13-token prompts + 4 tokens leave holders of 16 cells (4 blocks); 60 cells in all
    cfg = EngineConfig(capacity=20, max_sequences=1, pool_sequences=3, block_size=4)
    engine = Engine(history_model, config=cfg)
    a, b, c, d = prompts(4, length=13)
    for p in (a, b, c):
        run(engine, [p], max_tokens=4)
    [again] = run(engine, [a], max_tokens=1)  # a lookup is a use: a is now the newest
    assert again.cached_tokens == 12 and engine.cache.free_cells() == 12
    run(engine, [d], max_tokens=4)  # 13 cells for its prompt: one holder must go
    # b went, with its 16 cells (a's are shared with its second run, c is newer than b)
    assert engine.stats.evictions == 1 and engine.cache.free_cells() == 60 - 3 * 16
    for p in (c, a):  # still held
        [r] = run(engine, [p], max_tokens=1)
        assert r.cached_tokens == 12 and r.generated == greedy(history_model, p, 1)
    [r] = run(engine, [b], max_tokens=1)  # b was the least recently used
    assert r.cached_tokens == 0 and engine.stats.misses["evicted"] == 1
    assert r.generated == greedy(history_model, b, 1)


def test_preemption_under_a_small_cache_completes_every_request(history_model: Llama):
    ps = prompts(4, length=20)
    # one sequence's worth of cells (48) for 4 requests of 20 + 12 tokens each
    cfg = EngineConfig(capacity=48, max_sequences=4, pool_sequences=1, max_batch=64)
    engine = Engine(history_model, config=cfg)
    got = [r.generated for r in run(engine, ps, max_tokens=12)]
    assert engine.stats.preemptions > 0
    assert got == [greedy(history_model, p, 12) for p in ps]
    assert engine.cache.used_cells() == engine.holder_cells()  # only prefix blocks remain


def test_all_cells_free_without_prefix_cache(history_model: Llama):
    cfg = EngineConfig(capacity=64, max_sequences=3, prefix_cache=False)
    engine = Engine(history_model, config=cfg)
    ps = prompts(5)
    assert [r.generated for r in run(engine, ps)] == [greedy(history_model, p, 8) for p in ps]
    assert engine.cache.used_cells() == 0


def test_cancel_frees_cells(history_model: Llama):
    cfg = EngineConfig(capacity=64, max_sequences=2, prefix_cache=False)
    engine = Engine(history_model, config=cfg)
    a, b, queued = (engine.submit(p, RequestParams(max_tokens=30)) for p in prompts(3))
    engine.step()
    engine.step()
    a.cancel()
    queued.cancel()  # never started
    engine.step()
    assert a.finish_reason == queued.finish_reason == "cancelled" and len(engine.running) == 1
    engine.run()
    assert b.finish_reason == "length" and engine.cache.used_cells() == 0
    events = []
    while not a.events.empty():
        events.append(a.events.get())
    assert events[-1].finished and events[-1].finish_reason == "cancelled"
    assert queued.generated == [] and queued.events.get().finish_reason == "cancelled"


def test_invalid_requests_and_configs_are_typed_errors(history_model: Llama):
    engine = Engine(history_model, config=EngineConfig(capacity=32, max_sequences=1))
    with pytest.raises(InvalidArgumentError, match="context length"):
        engine.submit(list(range(30)), RequestParams(max_tokens=8))
    with pytest.raises(InvalidArgumentError, match="token ids"):
        engine.submit([5, 500])
    with pytest.raises(InvalidArgumentError, match="prompt"):
        engine.submit("text needs a tokenizer")
    with pytest.raises(InvalidArgumentError, match="prompt"):
        engine.submit_many([[1, 2], [1, 500]])
    assert not engine.busy  # the valid first prompt was not queued either
    with pytest.raises(InvalidArgumentError, match="params"):
        engine.submit([1, 2], {"max_tokens": 4})  # type: ignore[arg-type]
    bad_params = [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": "END"}, "stop"),
        ({"stop": ("",)}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"sampling": 0.5}, "sampling"),
    ]
    for kwargs, name in bad_params:
        with pytest.raises(InvalidArgumentError, match=name):
            RequestParams(**kwargs)  # type: ignore[arg-type]
    assert RequestParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    bad_configs = [
        ({"capacity": 1}, "capacity"),
        ({"context": "truncate"}, "context"),
        ({"preemption": "swap"}, "preemption"),
        ({"holder_eviction": "keep"}, "holder_eviction"),
        ({"capacity": 16, "keep": 8}, "keep"),
        ({"window": 0}, "window"),
        ({"prefix_cache": "yes"}, "prefix_cache"),
    ]
    for kwargs, name in bad_configs:
        with pytest.raises(InvalidConfigError, match=name):
            EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_second_engine_loads_blocks_from_the_store(history_model: Llama):
    store = MemoryStore()
    cfg = EngineConfig(capacity=128, max_sequences=1, block_size=8)
    (p,) = prompts(1, length=40)
    cold = Engine(history_model, config=cfg, model_id="tiny", store=store)
    run(cold, [p])
    assert cold.stats.store_published == 5  # (40 + 8 - 1) // 8 whole blocks
    warm = Engine(history_model, config=cfg, model_id="tiny", store=store)
    [r] = run(warm, [p])
    assert warm.stats.store_tokens == 32 and r.cached_tokens == 32  # 4 blocks of the 39
    assert r.computed == 40 - 32 + 7
    assert r.generated == greedy(history_model, p, 8)
    other_model = Engine(history_model, config=cfg, model_id="another", store=store)
    [r2] = run(other_model, [p])
    assert r2.cached_tokens == 0  # blocks are only reused by the same model identity


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_every_codec_reloads_published_blocks(history_model: Llama, codec: str):
    # 170 tokens: past the 128 rows int4 / kivi / turbo keep in fp16, so codes are reloaded
    store = MemoryStore()
    cfg = EngineConfig(capacity=192, max_sequences=1, block_size=16, codec=codec)
    p = random_prompt(170, seed=5)
    cold = Engine(history_model, config=cfg, model_id="tiny", store=store)
    [r1] = run(cold, [p])
    warm = Engine(history_model, config=cfg, model_id="tiny", store=store)
    [r2] = run(warm, [p])
    assert warm.stats.store_tokens == r2.cached_tokens == 160  # 10 blocks of the prompt's 169
    assert r2.computed == 10 + 7
    # the reloaded K/V of positions 0..159 against what the first engine held there
    (cold_seq,), (warm_seq,) = cold.cache.sequences(), warm.cache.sequences()
    cold_cells = torch.from_numpy(cold.cache.cells_of(cold_seq)[:160])
    warm_cells = torch.from_numpy(warm.cache.cells_of(warm_seq)[:160])
    for layer in cold.cache.layers():
        for want, got in zip(
            cold.cache.read(layer, cold_cells), warm.cache.read(layer, warm_cells), strict=True
        ):
            error = float((got.double() - want.double()).abs().max() / want.abs().max())
            if codec.startswith(("fp", "bf")):  # floats store what they are given
                assert error == 0, f"layer {layer}: {error}"
            else:  # re-encoding decoded codes may move a code (int4 and turbo centre keys
                assert error < 0.05, f"layer {layer}: {error}"  # by the rows they see)
    if codec.startswith(("fp", "bf")):
        assert r2.generated == r1.generated


def test_corrupt_store_entry_is_ignored(history_model: Llama):
    store = MemoryStore()
    cfg = EngineConfig(capacity=128, max_sequences=1, block_size=8)
    (p,) = prompts(1, length=40)
    run(Engine(history_model, config=cfg, model_id="tiny", store=store), [p])
    for key in store.data:
        store.data[key] = store.data[key][:-3] + b"\x00\x00\x00"
    warm = Engine(history_model, config=cfg, model_id="tiny", store=store)
    [r] = run(warm, [p])
    assert warm.stats.store_rejected == 1 and r.cached_tokens == 0
    assert warm.stats.misses["corrupt"] == 1
    assert r.generated == greedy(history_model, p, 8)


class DownStore(MemoryStore):
    """A store whose server went away: every call raises StoreUnavailableError."""

    name = "down"

    def get(self, key: str) -> bytes | None:
        raise StoreUnavailableError("down")

    def put(self, key: str, data: bytes) -> None:
        raise StoreUnavailableError("down")


def test_unreachable_store_is_a_miss_and_requests_complete(history_model: Llama):
    cfg = EngineConfig(capacity=128, max_sequences=1, block_size=8)
    (p,) = prompts(1, length=40)
    engine = Engine(history_model, config=cfg, model_id="tiny", store=DownStore())
    [r] = run(engine, [p])
    assert r.generated == greedy(history_model, p, 8) and r.cached_tokens == 0
    assert engine.stats.store_errors >= 2  # the lookup and the publish both failed
    assert engine.stats.store_published == 0
    assert engine.stats.misses["store_unavailable"] == 1
    assert engine.metrics()["store_errors_total"] == engine.stats.store_errors

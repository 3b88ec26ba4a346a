"""The serving engine on a tiny float64 Llama: batching equals single runs, prefix reuse
computes only new tokens, preemption completes everything, cells are freed, block stores
share prefixes between engines."""

from __future__ import annotations

import pytest
import torch

from kvcache.engine import Engine, EngineConfig, RequestParams
from kvcache.engine.store import MemoryStore
from kvcache.errors import InvalidArgumentError, StoreUnavailableError
from kvcache.models.llama import Llama, LlamaConfig

TINY = LlamaConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama.random(TINY, seed=3, dtype=torch.float64)


def prompts(n: int, length: int = 21, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    head = torch.randint(0, 97, (shared,), generator=g).tolist()
    return [head + torch.randint(0, 97, (length - shared,), generator=g).tolist() for _ in range(n)]


def run_all(engine: Engine, ps: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    reqs = [engine.submit(p, RequestParams(max_tokens=max_tokens, ignore_eos=True)) for p in ps]
    engine.run()
    assert all(r.finish_reason == "length" for r in reqs)
    return [r.generated for r in reqs]


def single(model: Llama, p: list[int], max_tokens: int = 8) -> list[int]:
    engine = Engine(model, config=EngineConfig(capacity=128, max_sequences=1, prefix_cache=False))
    return run_all(engine, [p], max_tokens)[0]


def test_concurrent_requests_equal_single_requests(model):
    ps = prompts(8, length=13)
    engine = Engine(model, config=EngineConfig(capacity=64, max_sequences=8, max_batch=40))
    together = run_all(engine, ps)
    assert together == [single(model, p) for p in ps]
    assert engine.stats.forwards < 8 * 9  # batched, not one request after another


def test_shared_prefix_prefills_only_new_tokens(model):
    engine = Engine(model, config=EngineConfig(capacity=128, max_sequences=2, block_size=8))
    first, second = prompts(2, length=30, shared=20)
    out1 = run_all(engine, [first])[0]
    # the first request left blocks of its prompt + output: 30 + 8 - 1 = 37 -> 32 tokens held
    follow = first + out1[:2] + second[20:24]  # continues the first conversation
    r = engine.submit(follow, RequestParams(max_tokens=8, ignore_eos=True))
    engine.run()
    assert r.cached_tokens == 32  # 4 whole blocks shared through copy_prefix
    assert r.computed == len(follow) - 32 + 7  # the rest of the prompt + 7 decode feeds
    assert r.generated == single(model, follow)
    other = engine.submit(second, RequestParams(max_tokens=8, ignore_eos=True))
    engine.run()
    assert other.cached_tokens == 16  # the 20 shared tokens hold 2 whole blocks
    assert other.generated == single(model, second)


def test_preemption_under_a_small_cache_completes_every_request(model):
    ps = prompts(4, length=20)
    # one sequence's worth of cells (48) for 4 requests of 20 + 12 tokens each
    cfg = EngineConfig(capacity=48, max_sequences=4, pool_sequences=1, max_batch=64)
    engine = Engine(model, config=cfg)
    out = run_all(engine, ps, max_tokens=12)
    assert engine.stats.preemptions > 0
    assert out == [single(model, p, 12) for p in ps]
    assert engine.cache.used_cells() == engine.holder_cells()  # only prefix blocks remain


def test_all_cells_free_without_prefix_cache(model):
    engine = Engine(model, config=EngineConfig(capacity=64, max_sequences=3, prefix_cache=False))
    run_all(engine, prompts(5))
    assert engine.cache.used_cells() == 0


def test_cancel_frees_cells(model):
    engine = Engine(model, config=EngineConfig(capacity=64, max_sequences=2, prefix_cache=False))
    a, b = (engine.submit(p, RequestParams(max_tokens=30, ignore_eos=True)) for p in prompts(2))
    engine.step()
    engine.step()
    a.cancel()
    engine.step()
    assert a.finish_reason == "cancelled" and len(engine.running) == 1
    engine.run()
    assert b.finish_reason == "length" and engine.cache.used_cells() == 0
    events = []
    while not a.events.empty():
        events.append(a.events.get())
    assert events[-1].finished and events[-1].finish_reason == "cancelled"


def test_request_that_cannot_fit_is_rejected(model):
    engine = Engine(model, config=EngineConfig(capacity=32, max_sequences=1))
    with pytest.raises(InvalidArgumentError, match="context length"):
        engine.submit(list(range(30)), RequestParams(max_tokens=8))
    with pytest.raises(InvalidArgumentError, match="token ids"):
        engine.submit([5, 500])


def test_second_engine_loads_blocks_from_the_store(model):
    store = MemoryStore()
    cfg = EngineConfig(capacity=128, max_sequences=1, block_size=8)
    (p,) = prompts(1, length=40)
    cold = Engine(model, config=cfg, model_id="tiny", store=store)
    out = run_all(cold, [p])[0]
    assert cold.stats.store_published == 5  # (40 + 8 - 1) // 8 whole blocks
    warm = Engine(model, config=cfg, model_id="tiny", store=store)
    r = warm.submit(p, RequestParams(max_tokens=8, ignore_eos=True))
    warm.run()
    assert warm.stats.store_tokens == 32 and r.cached_tokens == 32  # 4 blocks of the prompt's 39
    assert r.computed == 40 - 32 + 7
    assert r.generated == out
    other_model = Engine(model, config=cfg, model_id="another", store=store)
    r2 = other_model.submit(p, RequestParams(max_tokens=8, ignore_eos=True))
    other_model.run()
    assert r2.cached_tokens == 0  # blocks are only reused by the same model identity


def test_corrupt_store_entry_is_ignored(model):
    store = MemoryStore()
    cfg = EngineConfig(capacity=128, max_sequences=1, block_size=8)
    (p,) = prompts(1, length=40)
    out = run_all(Engine(model, config=cfg, model_id="tiny", store=store), [p])[0]
    for key in store.data:
        store.data[key] = store.data[key][:-3] + b"\x00\x00\x00"
    warm = Engine(model, config=cfg, model_id="tiny", store=store)
    r = warm.submit(p, RequestParams(max_tokens=8, ignore_eos=True))
    warm.run()
    assert warm.stats.store_rejected == 1 and r.cached_tokens == 0 and r.generated == out


class DownStore(MemoryStore):
    """A store whose server went away: every call raises StoreUnavailableError."""

    name = "down"

    def get(self, key: str) -> bytes | None:
        raise StoreUnavailableError("down")

    def put(self, key: str, data: bytes) -> None:
        raise StoreUnavailableError("down")


def test_unreachable_store_is_a_miss_and_requests_complete(model):
    cfg = EngineConfig(capacity=128, max_sequences=1, block_size=8)
    (p,) = prompts(1, length=40)
    expected = run_all(Engine(model, config=cfg, model_id="tiny"), [p])[0]
    engine = Engine(model, config=cfg, model_id="tiny", store=DownStore())
    r = engine.submit(p, RequestParams(max_tokens=8, ignore_eos=True))
    engine.run()
    assert r.generated == expected and r.cached_tokens == 0
    assert engine.stats.store_errors >= 2  # the lookup and the publish both failed
    assert engine.stats.store_published == 0
    assert engine.metrics()["store_errors_total"] == engine.stats.store_errors

"""cache_salt, paired as vLLM's salt test asks: the same salt reuses blocks (> 0), another
salt or no salt reuses exactly none, in the pool and in every block-store tier (memory, disk,
a real Redis); answers equal the uncached reference either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from greedy_reference import greedy, random_prompt
from kvcache.engine import Engine, EngineConfig, Request, RequestParams
from kvcache.engine.store import BlockStore, DiskStore, MemoryStore, RedisStore
from kvcache.errors import InvalidArgumentError
from kvcache.models.llama import Llama
from kvcache.prefix import chain_hashes

BLOCK = 8
SHARED = random_prompt(40, seed=31)  # 5 whole blocks: the tenants' common system prompt


def ask(engine: Engine, salt: str | None, tail_seed: int, model: Llama) -> Request:
    """One request over SHARED + a fresh tail, run to its end and checked against greedy."""
    prompt = SHARED + random_prompt(5, seed=tail_seed)
    r = engine.submit(prompt, RequestParams(max_tokens=4, cache_salt=salt))
    engine.run()
    assert r.generated == greedy(model, prompt, 4)
    return r


def engine_over(model: Llama, store: BlockStore | None) -> Engine:
    config = EngineConfig(capacity=96, max_sequences=2, block_size=BLOCK)
    return Engine(model, config=config, model_id="salt-test", store=store)


def test_salt_enters_the_first_block_hash_only():
    tokens = list(range(24))
    plain = chain_hashes(tokens, BLOCK, b"m")
    a, b = chain_hashes(tokens, BLOCK, b"m", "a"), chain_hashes(tokens, BLOCK, b"m", "b")
    assert len({plain[0], a[0], b[0]}) == 3  # every block differs: the chain carries the salt
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert chain_hashes(tokens, BLOCK, b"m", "a") == a  # deterministic


def test_same_salt_reuses_the_pool_other_salts_reuse_nothing(history_model: Llama):
    engine = engine_over(history_model, None)
    assert ask(engine, "tenant-a", 1, history_model).cached_tokens == 0
    assert ask(engine, "tenant-a", 2, history_model).cached_tokens == 40
    assert ask(engine, "tenant-b", 3, history_model).cached_tokens == 0
    assert ask(engine, None, 4, history_model).cached_tokens == 0
    assert ask(engine, None, 5, history_model).cached_tokens == 40  # the shared namespace
    assert ask(engine, "tenant-b", 6, history_model).cached_tokens == 40


@pytest.fixture(params=["memory", "disk", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlockStore:
    if request.param == "memory":
        return MemoryStore()
    if request.param == "disk":
        return DiskStore(tmp_path / "blocks")
    url = request.getfixturevalue("redis_url")
    redis_store = RedisStore(url)
    redis_store.client.flushdb()
    return redis_store


def test_same_salt_reuses_the_store_other_salts_reuse_nothing(history_model: Llama, store):
    """A tenant's blocks, computed by one replica, load into another only for that tenant."""
    writer = engine_over(history_model, store)
    ask(writer, "tenant-a", 1, history_model)
    assert writer.stats.store_published >= 5

    reader = engine_over(history_model, store)  # a second replica: an empty pool
    other = ask(reader, "tenant-b", 2, history_model)
    assert (other.cached_tokens, reader.stats.store_tokens) == (0, 0)
    plain = ask(reader, None, 3, history_model)
    assert (plain.cached_tokens, reader.stats.store_tokens) == (0, 0)
    same = ask(reader, "tenant-a", 4, history_model)
    assert same.cached_tokens == 40 and reader.stats.store_tokens == 40  # all from the store


@pytest.mark.parametrize("salt", ["", 7, b"bytes", "s" * 257])
def test_a_salt_that_is_not_a_short_string_is_refused(salt):
    with pytest.raises(InvalidArgumentError, match="cache_salt"):
        RequestParams(cache_salt=salt)

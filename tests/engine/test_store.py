"""Prefix block stores: round trips through memory, disk and a real Redis; corrupt or
mismatched entries are detected, never loaded."""

from __future__ import annotations

import pytest
import torch

from kvcache.engine.store import (
    BlockIdentity,
    CorruptBlockError,
    DiskStore,
    MemoryStore,
    RedisStore,
    decode_block,
    encode_block,
    open_store,
)
from kvcache.errors import InvalidArgumentError

ID = BlockIdentity(model="smollm2-135m:abc", codec="fp32", block_size=4)
HASH = bytes(range(16))


def block(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 8, generator=g) for _ in range(2)], [
        torch.randn(4, 3, 8, generator=g) for _ in range(2)
    ]


def test_block_round_trip_is_exact():
    keys, values = block()
    k2, v2 = decode_block(encode_block(ID, HASH, keys, values), ID, HASH)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, k2 + v2, strict=True))


@pytest.mark.parametrize(
    "identity, block_hash, match",
    [
        (BlockIdentity("other-model", "fp32", 4), HASH, "model"),
        (BlockIdentity(ID.model, "int8", 4), HASH, "codec"),
        (ID, bytes(16), "hash"),
    ],
)
def test_mismatched_identity_is_rejected(identity, block_hash, match):
    data = encode_block(ID, HASH, *block())
    with pytest.raises(CorruptBlockError, match=match):
        decode_block(data, identity, block_hash)


def test_corrupted_bytes_are_rejected():
    data = bytearray(encode_block(ID, HASH, *block()))
    data[-5] ^= 0xFF  # flip bits inside the tensor data
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_block(bytes(data), ID, HASH)
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(data[:50]), ID, HASH)  # truncated


def test_memory_store_is_lru_bounded():
    store = MemoryStore(max_bytes=25)
    store.put("a", b"x" * 10)
    store.put("b", b"y" * 10)
    assert store.get("a") == b"x" * 10  # a is now the most recent
    store.put("c", b"z" * 10)
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert store.bytes == 20


def test_disk_store_round_trip_and_miss(tmp_path):
    store = DiskStore(tmp_path / "blocks")
    assert store.get(ID.key(HASH)) is None
    data = encode_block(ID, HASH, *block())
    store.put(ID.key(HASH), data)
    assert DiskStore(tmp_path / "blocks").get(ID.key(HASH)) == data  # a second process
    assert not list((tmp_path / "blocks").glob("*.tmp*"))


def test_redis_store_shares_between_clients(redis_url):
    first, second = open_store(redis_url), open_store(redis_url)
    data = encode_block(ID, HASH, *block(3))
    first.put(ID.key(HASH), data)
    keys, _ = decode_block(second.get(ID.key(HASH)) or b"", ID, HASH)
    assert torch.equal(keys[0], block(3)[0][0])
    assert second.get(ID.key(bytes(16))) is None


def test_bad_store_spec():
    with pytest.raises(InvalidArgumentError, match="prefix_store"):
        open_store("ftp://x")


def test_redis_outage_is_a_typed_error(redis_url):
    import socket

    import redis

    from kvcache.errors import StoreUnavailableError

    store = open_store(redis_url)
    assert isinstance(store, RedisStore)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = int(s.getsockname()[1])
    store.client = redis.Redis(port=dead, socket_timeout=1)  # the server went away
    with pytest.raises(StoreUnavailableError, match="redis"):
        store.get("k")
    with pytest.raises(StoreUnavailableError, match="redis"):
        store.put("k", b"v")

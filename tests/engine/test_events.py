"""KV events: a consumer written from vLLM's documented schema (ZMQ SUB + replay socket,
msgpack ``[ts, events, dp_rank]`` batches of tagged maps; none of the publisher's code)
follows a random workload (stores, evictions, preemptions with spill, memory-store drops,
pool resets, salts) and rebuilds exactly the pool's block set and the memory tier's.

The subscriber connects only after the first half of the workload, so those batches are lost
on the PUB socket and must come back through the replay socket."""

from __future__ import annotations

import random
import time
from collections import defaultdict

import msgpack
import pytest
import zmq

from greedy_reference import random_prompt
from kvcache.deploy import free_port
from kvcache.engine import Engine, EngineConfig, RequestParams
from kvcache.engine.events import ZmqEventPublisher
from kvcache.engine.store import MemoryStore
from kvcache.errors import InvalidArgumentError
from kvcache.models.llama import Llama

BLOCK = 4
END = -1


def as_event_hash(block_hash: bytes) -> int:
    """The documented wire form of a block hash: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


class Consumer:
    """What a router keeps per replica: the block hashes of each medium, from the events."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = defaultdict(set)
        self.first_blocks: dict[tuple[tuple[int, ...], str | None], int] = {}
        self.kinds: dict[str, int] = defaultdict(int)

    def apply(self, payload: bytes) -> None:
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        for e in events:
            self.kinds[e["type"]] += 1
            if e["type"] == "BlockStored":
                self.stored(e)
            elif e["type"] == "BlockRemoved":
                held = self.blocks[e["medium"]]
                assert set(e["block_hashes"]) <= held, "removed a block never stored"
                held.difference_update(e["block_hashes"])
            else:
                assert e == {"type": "AllBlocksCleared"}
                self.blocks.clear()

    def stored(self, e: dict) -> None:
        hashes, tokens, size = e["block_hashes"], e["token_ids"], e["block_size"]
        assert size == BLOCK and len(tokens) == size * len(hashes)
        assert len(e["extra_keys"]) == len(hashes) and e["lora_id"] is None
        held = self.blocks[e["medium"]]
        if e["medium"] == "GPU":  # the pool holds whole prefixes: a block's parent is there
            assert e["parent_block_hash"] is None or e["parent_block_hash"] in held
        if e["parent_block_hash"] is None:  # block 0: its key is its tokens and salt
            extra = e["extra_keys"][0]
            key = (tuple(tokens[:size]), None if extra is None else extra[0])
            assert self.first_blocks.setdefault(key, hashes[0]) == hashes[0]
        held.update(hashes)


def random_workload(engine: Engine, rng: random.Random, steps: int) -> None:
    """Requests over 3 shared system prompts, two tenants, resets when idle."""
    heads = [random_prompt(12, seed=100 + i) for i in range(3)]
    for _ in range(steps):
        for _ in range(rng.randint(0, 2)):
            prompt = rng.choice(heads) + [rng.randrange(97) for _ in range(rng.randint(3, 14))]
            salt = rng.choice([None, None, "tenant-1"])
            engine.submit(prompt, RequestParams(max_tokens=rng.randint(4, 20), cache_salt=salt))
        for _ in range(rng.randint(1, 4)):
            engine.step()
        if rng.random() < 0.04:
            engine.run()
            assert engine.reuse.reset()
    engine.run()


def receive(sub: zmq.Socket, last: int) -> dict[int, bytes]:
    """Live batches until ``last`` arrives (or 10 s pass)."""
    got: dict[int, bytes] = {}
    deadline = time.monotonic() + 10
    while last not in got and time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            got[int.from_bytes(seq, "big")] = payload
    return got


def replay(endpoint: str, start: int) -> dict[int, bytes]:
    """Every kept batch from ``start`` on, through the replay socket."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got: dict[int, bytes] = {}
        while True:
            assert dealer.poll(10_000), "no replay answer"
            empty, seq_bytes, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END:
                assert empty == b"" and payload == b""
                return got
            got[seq] = payload
    finally:
        dealer.close(linger=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_consumer_rebuilds_the_pool_from_the_events(history_model: Llama, seed: int):
    store = MemoryStore(max_bytes=16_000)  # ~6 blocks: the tier drops some
    config = EngineConfig(capacity=48, max_sequences=3, pool_sequences=2, block_size=BLOCK)
    engine = Engine(history_model, config=config, model_id="events-test", store=store)
    port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(
        f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv",
        block_size=BLOCK,
    )
    engine.reuse.watch(publisher)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    try:
        rng = random.Random(seed)
        random_workload(engine, rng, 20)  # nobody listens: these batches exist only for replay
        early = publisher.drain()
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)  # the subscription reaches the publisher
        random_workload(engine, rng, 40)
        last = publisher.drain()
        live = receive(sub, last)
        assert early >= 0 and live and min(live) > early  # the first half never arrived
        kept = replay(f"tcp://127.0.0.1:{replay_port}", 0)
    finally:
        sub.close(linger=0)
        publisher.close()

    assert sorted(kept) == list(range(last + 1))  # monotonic, no gaps
    assert all(kept[seq] == payload for seq, payload in live.items())
    consumer = Consumer()
    for seq in range(last + 1):
        consumer.apply(kept[seq])

    pool = {as_event_hash(h) for h in engine.reuse.index.by_hash}
    assert pool and consumer.blocks["GPU"] == pool
    tier = {as_event_hash(engine.reuse.identity.hash_of(k) or b"") for k in store.data}
    assert consumer.blocks["CPU"] == tier
    s = engine.stats
    assert s.evictions > 0 and s.preemptions > 0 and s.spills > 0  # the workload did it all
    assert consumer.kinds["AllBlocksCleared"] >= 1 and consumer.kinds["BlockRemoved"] > 0
    salts = {salt for _, salt in consumer.first_blocks}
    assert salts == {None, "tenant-1"}  # salted first blocks carry the salt, hash apart


def test_bad_endpoint_is_a_typed_error():
    with pytest.raises(InvalidArgumentError, match="kv_events"):
        ZmqEventPublisher("http://127.0.0.1:1", block_size=BLOCK)

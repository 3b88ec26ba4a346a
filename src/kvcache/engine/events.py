"""KV events: every block that enters or leaves the pool or a block-store tier, published in
vLLM's schema so that a KV-aware router (llm-d's precise prefix scorer, Dynamo's KV router,
vllm-router's kv_aware policy) knows which replica holds which prompt blocks.

Wire format (vLLM's ZMQ publisher): a PUB socket sends multipart messages
``(topic, seq, payload)``; ``seq`` is an 8-byte big-endian sequence number counting 0, 1,
2, ... without gaps; ``payload`` is a msgpack array ``[ts, events, data_parallel_rank]``
whose events are msgpack maps tagged by ``type``::

    {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": h0 | None,
     "token_ids": [...2 blocks of tokens...], "block_size": 16, "lora_id": None,
     "medium": "GPU", "lora_name": None, "extra_keys": [[salt] | None, None], "group_idx": 0}
    {"type": "BlockRemoved", "block_hashes": [h1, h2], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

A block hash is our 16-byte chained hash (``kvcache.prefix``) as an unsigned 64-bit int,
its last 8 bytes big-endian (vLLM's rule for int block hashes). A salted request's first
block carries its ``cache_salt`` in ``extra_keys``, as vLLM's does. Mediums: ``GPU`` is the
engine's K/V pool (vLLM's name for its main pool, whatever the device), ``CPU`` the
in-process memory store, ``DISK`` and ``REDIS`` the other tiers (stored only: their entries
outlive this process and nothing here sees them go). ``AllBlocksCleared`` follows a pool
reset (``POST /reset_prefix_cache``), which empties the pool and the memory store.

Replay (vLLM's replay socket): a ROUTER socket; a REQ or DEALER client sends
``[b"", start_seq (8 bytes big-endian)]`` and gets ``[b"", seq, payload]`` for every kept
batch from ``start_seq`` on, then ``[b"", -1 (8 bytes, signed), b""]``.

Both sockets are bound at their endpoints (``tcp://127.0.0.1:5557``, ``tcp://*:5557``,
``ipc://PATH``) and subscribers connect, as to any server address (vLLM connects instead
when the host is not a wildcard). The engine thread only queues events; a publisher thread
encodes, sends and answers replays.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from kvcache.errors import InvalidArgumentError

log = logging.getLogger(__name__)

POOL = "GPU"  # the engine's pool, named as vLLM names its main K/V pool
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
REPLAY_POLL_S = 0.05


def wire_hash(block_hash: bytes) -> int:
    """A block hash as the events carry it: the unsigned 64-bit int of its last 8 bytes."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEvents(Protocol):
    """Where the engine reports blocks entering and leaving the pool and the tiers."""

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        tokens: Sequence[int],
        medium: str,
        salt: str | None,
    ) -> None:
        """Consecutive blocks after ``parent``; ``salt``: the first is a salted block 0."""
        ...

    def removed(self, hashes: Sequence[bytes], medium: str) -> None: ...

    def cleared(self) -> None: ...

    def close(self) -> None: ...


class NoEvents:
    """Events off (the default): nothing is recorded."""

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        tokens: Sequence[int],
        medium: str,
        salt: str | None,
    ) -> None:
        return None

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        return None

    def cleared(self) -> None:
        return None

    def close(self) -> None:
        return None


def block_stored(
    hashes: Sequence[bytes],
    parent: bytes | None,
    tokens: Sequence[int],
    block_size: int,
    medium: str,
    salt: str | None,
) -> dict[str, Any]:
    """vLLM's BlockStored map."""
    extra: list[list[str] | None] = [None] * len(hashes)
    if salt is not None and hashes:
        extra[0] = [salt]
    return {
        "type": "BlockStored",
        "block_hashes": [wire_hash(h) for h in hashes],
        "parent_block_hash": None if parent is None else wire_hash(parent),
        "token_ids": [int(t) for t in tokens],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": extra,
        "group_idx": 0,
    }


def block_removed(hashes: Sequence[bytes], medium: str) -> dict[str, Any]:
    """vLLM's BlockRemoved map."""
    return {
        "type": "BlockRemoved",
        "block_hashes": [wire_hash(h) for h in hashes],
        "medium": medium,
        "group_idx": 0,
    }


def check_endpoint(name: str, endpoint: str) -> str:
    """A ZMQ endpoint spec, or InvalidArgumentError naming the option."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise InvalidArgumentError(name, endpoint, "tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    return endpoint


class ZmqEventPublisher:
    """Publishes queued events in batches on a ZMQ PUB socket, keeps the last
    ``buffer_steps`` batches for replay (vLLM's ``ZmqEventPublisher``)."""

    def __init__(
        self,
        endpoint: str,
        *,
        block_size: int,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        import zmq

        self.endpoint = check_endpoint("kv_events", endpoint)
        self.replay_endpoint = (
            None if replay_endpoint is None else check_endpoint("kv_events_replay", replay_endpoint)
        )
        self.block_size = block_size
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise InvalidArgumentError("kv_events", endpoint, f"a usable endpoint ({e})") from e
        self.next_seq = 0  # the sequence number of the next batch (publisher thread)
        self._sent = threading.Condition()
        self._queued = self._done = 0  # events queued / sent (under _sent)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- the engine thread -----------------------------------------------------------
    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        tokens: Sequence[int],
        medium: str,
        salt: str | None,
    ) -> None:
        self._put(block_stored(hashes, parent, tokens, self.block_size, medium, salt))

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        self._put(block_removed(hashes, medium))

    def cleared(self) -> None:
        self._put({"type": "AllBlocksCleared"})

    def _put(self, event: dict[str, Any]) -> None:
        with self._sent:
            self._queued += 1
        self._queue.put(event)

    def drain(self, timeout: float = 10.0) -> int:
        """Wait until every queued event is sent; the sequence number of the last batch."""
        deadline = time.monotonic() + timeout
        with self._sent:
            target = self._queued
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise TimeoutError("kv events still queued")
                self._sent.wait(left)
            return self.next_seq - 1

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._close_sockets()

    # ---- the publisher thread ---------------------------------------------------------
    def _run(self) -> None:
        import msgpack

        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                first = self._queue.get(timeout=REPLAY_POLL_S)
            except queue.Empty:
                continue
            events, stop = [first], first is None
            while not stop:  # everything queued now goes into one batch, in order
                try:
                    event = self._queue.get_nowait()
                except queue.Empty:
                    break
                stop = event is None
                events.append(event)
            batch = [e for e in events if e is not None]
            if batch:
                payload = msgpack.packb([time.time(), batch, 0], use_bin_type=True)
                seq = self.next_seq
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.next_seq = seq + 1
            with self._sent:
                self._done += len(batch)
                self._sent.notify_all()
            if stop:
                return

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a malformed kv-events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=1000)  # a second to deliver what is sent
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

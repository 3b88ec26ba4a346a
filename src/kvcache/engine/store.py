"""Prefix block stores: K/V of token blocks shared across requests and server replicas.

A block is the K/V of ``block_size`` tokens in every layer, named by the chained hash of
its token prefix (see ``kvcache.prefix``). It is serialized with safetensors, and its header
carries a format version, the model identity, the codec, the hash and a SHA-256 of the
tensor bytes, so a wrong-model, wrong-codec, truncated or corrupted entry is detected and
ignored, never loaded. Tiers (``open_store``)::

    memory            in-process dict, LRU-bounded by bytes (the default)
    disk:PATH         one file per block, written atomically (tmp + rename)
    redis://H:P/DB    a Redis server shared by several replicas
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvcache.errors import InvalidArgumentError, KVCacheError, StoreUnavailableError

FORMAT = "kvcache-block-v1"
log = logging.getLogger(__name__)


class CorruptBlockError(KVCacheError):
    """A stored block failed its checks (version, identity, checksum, shapes).

    ``reason`` says which kind of check (a prefix-miss reason of the engine's metrics):
    "model_mismatch", "codec_mismatch" or "corrupt".
    """

    def __init__(self, message: str, reason: str = "corrupt") -> None:
        super().__init__(message)
        self.reason = reason


# header fields whose mismatch has its own miss reason (any other failed check: "corrupt")
MISMATCH_REASONS = {"model": "model_mismatch", "codec": "codec_mismatch"}


@dataclass(frozen=True)
class BlockIdentity:
    """What must match for a stored block to be reused: same model, codec and prefix."""

    model: str
    codec: str
    block_size: int

    def key(self, block_hash: bytes) -> str:
        return f"kvcache:{FORMAT}:{self.model}:{self.codec}:{self.block_size}:{block_hash.hex()}"

    def hash_of(self, key: str) -> bytes | None:
        """The block hash a key of this identity names (None: another identity's key)."""
        prefix = self.key(b"")
        if not key.startswith(prefix):
            return None
        try:
            return bytes.fromhex(key[len(prefix) :])
        except ValueError:
            return None


def encode_block(
    identity: BlockIdentity, block_hash: bytes, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> bytes:
    """Serialize one block: per layer keys/values [block_size, H, D]."""
    tensors: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        tensors[f"k{i}"] = k.contiguous()
        tensors[f"v{i}"] = v.contiguous()
    meta = {
        "format": FORMAT,
        "model": identity.model,
        "codec": identity.codec,
        "block_size": str(identity.block_size),
        "hash": block_hash.hex(),
        "layers": str(len(keys)),
        "sha256": _digest(tensors),
    }
    return st_save(tensors, metadata=meta)


def decode_block(
    data: bytes, identity: BlockIdentity, block_hash: bytes
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values of a stored block; CorruptBlockError if any check fails."""
    try:
        tensors = st_load(data)
        meta = _metadata(data)
    except Exception as e:  # safetensors raises several types on garbage
        raise CorruptBlockError(f"unreadable block: {e}") from e
    want = {
        "format": FORMAT,
        "model": identity.model,
        "codec": identity.codec,
        "block_size": str(identity.block_size),
        "hash": block_hash.hex(),
    }
    for field, value in want.items():
        if meta.get(field) != value:
            raise CorruptBlockError(
                f"block {field} is {meta.get(field)!r}, expected {value!r}",
                MISMATCH_REASONS.get(field, "corrupt"),
            )
    if meta.get("sha256") != _digest(tensors):
        raise CorruptBlockError("block checksum mismatch")
    layers = int(meta.get("layers", "0"))
    keys = [tensors[f"k{i}"] for i in range(layers)]
    values = [tensors[f"v{i}"] for i in range(layers)]
    if any(k.shape[0] != identity.block_size for k in keys):
        raise CorruptBlockError("block rows differ from block_size")
    return keys, values


def _metadata(data: bytes) -> dict[str, str]:
    import json
    import struct

    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return dict(header.get("__metadata__", {}))


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class BlockStore(Protocol):
    """Bytes by key; a miss is None. Implementations never raise on a missing key, and
    raise StoreUnavailableError when the store itself cannot be reached."""

    name: str
    medium: str  # the tier's name in KV events (kvcache.engine.events)

    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, data: bytes) -> None: ...


class MemoryStore:
    """In-process store, least recently used entries dropped past ``max_bytes``."""

    name = "memory"
    medium = "CPU"

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.data: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0
        self.on_drop: Callable[[str], None] | None = None  # told each key dropped for room

    def get(self, key: str) -> bytes | None:
        value = self.data.get(key)
        if value is not None:
            self.data.move_to_end(key)
        return value

    def put(self, key: str, data: bytes) -> None:
        old = self.data.pop(key, None)
        self.bytes += len(data) - (len(old) if old else 0)
        self.data[key] = data
        while self.bytes > self.max_bytes and self.data:
            gone, dropped = self.data.popitem(last=False)
            self.bytes -= len(dropped)
            if self.on_drop is not None:
                self.on_drop(gone)

    def clear(self) -> None:
        """Forget every entry (a prefix-cache reset; ``on_drop`` is not told)."""
        self.data.clear()
        self.bytes = 0


class DiskStore:
    """One file per block under ``root`` (atomic writes: readers never see half a file)."""

    name = "disk"
    medium = "DISK"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / (hashlib.sha256(key.encode()).hexdigest() + ".kvblock")

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailableError(f"disk store {self.root}: {e}") from e

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            raise StoreUnavailableError(f"disk store {self.root}: {e}") from e


class RedisStore:
    """Blocks in a Redis server (``redis://host:port/db``), shared by server replicas."""

    name = "redis"
    medium = "REDIS"

    def __init__(self, url: str, ttl_seconds: int | None = None) -> None:
        import redis

        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=5)
        self.client.ping()  # fail at start-up, not at the first request
        self.ttl = ttl_seconds

    def get(self, key: str) -> bytes | None:
        import redis

        try:
            value = self.client.get(key)
        except redis.RedisError as e:
            raise StoreUnavailableError(f"redis {self.url}: {e}") from e
        return value if isinstance(value, bytes) else None

    def put(self, key: str, data: bytes) -> None:
        import redis

        try:
            self.client.set(key, data, ex=self.ttl)
        except redis.RedisError as e:
            raise StoreUnavailableError(f"redis {self.url}: {e}") from e


def open_store(spec: str) -> BlockStore:
    """``memory`` | ``disk:PATH`` | ``redis://HOST:PORT/DB``."""
    if spec == "memory":
        return MemoryStore()
    if spec.startswith("disk:") and len(spec) > 5:
        return DiskStore(spec[5:])
    if spec.startswith("redis://"):
        return RedisStore(spec)
    raise InvalidArgumentError("prefix_store", spec, "memory, disk:PATH or redis://HOST:PORT/DB")

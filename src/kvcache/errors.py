"""Typed errors of kvcache.

Three kinds of failure (see ARCHITECTURE.md, house style 6):

* bad input -> a subclass of :class:`KVCacheError` (and of ``ValueError`` where the input's
  value is wrong), naming the argument, the value and what is allowed;
* misuse of call order -> ``RuntimeError`` (:class:`CallOrderError`) saying what to call first;
* broken internal invariants -> ``assert``.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error kvcache raises on purpose."""


class InvalidArgumentError(KVCacheError, ValueError):
    """An argument has a value, type or shape the call does not accept."""

    def __init__(self, name: str, value: object, allowed: str) -> None:
        self.name = name
        self.value = value
        self.allowed = allowed
        super().__init__(f"{name}={value!r} is not allowed: expected {allowed}")


class InvalidConfigError(InvalidArgumentError):
    """A constructor argument (capacity, window, bits, ...) is out of range."""


class DimensionMismatchError(KVCacheError, ValueError):
    """A tensor's shape does not match what the cache holds or the batch has."""

    def __init__(self, expected: object, actual: object, what: str = "tensor shape") -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(f"{what} mismatch: expected {expected}, got {actual}")


class NonFiniteInputError(KVCacheError, ValueError):
    """A key, value or query holds NaN or Inf; ``index`` locates the first bad element."""

    def __init__(self, index: object, what: str = "input") -> None:
        self.index = index
        super().__init__(f"non-finite value (NaN or Inf) in {what} at index {index}")


class CacheFullError(KVCacheError, RuntimeError):
    """No free cell for every token of a batch; the cache was left unchanged."""

    def __init__(self, needed: int, free: int, capacity: int) -> None:
        self.needed = needed
        self.free = free
        self.capacity = capacity
        super().__init__(
            f"kv cache full: batch needs {needed} cells, {free} free (cache has {capacity} cells)"
        )


class NotSupportedError(KVCacheError):
    """The operation is not supported by this cache or model (e.g. shifting without RoPE)."""


class CallOrderError(KVCacheError, RuntimeError):
    """A method was called before the one it depends on (e.g. put before start_forward)."""


class StoreUnavailableError(KVCacheError, OSError):
    """A prefix block store could not be read or written (e.g. Redis down). The engine
    counts it and goes on as with a miss: the prefix is computed instead."""


class SnapshotError(KVCacheError, ValueError):
    """A sequence snapshot cannot be read or restored; the cache was left unchanged."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot file is truncated, edited or inconsistent (its SHA-256 or layout is wrong)."""


class SnapshotVersionError(SnapshotError):
    """A snapshot file is of another format or format version than this kvcache reads."""


class SnapshotMismatchError(SnapshotError):
    """A snapshot is of another model, codec, key_rope mode, dtype or layer shape than the
    cache it is restored into; ``field`` names what differs."""

    def __init__(self, field: str, snapshot: object, cache: object) -> None:
        self.field = field
        self.snapshot = snapshot
        self.cache = cache
        super().__init__(
            f"snapshot {field}={snapshot!r} does not match the cache's {field}={cache!r}"
        )

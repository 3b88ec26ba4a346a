"""Prefix index: which cached sequence already holds the K/V of a token prefix.

Bookkeeping only (ints and bytes, no tensors). Prompts are cut into blocks of ``block_size``
tokens; block i is named by a chained hash ``h_i = H(h_{i-1} || tokens of block i)`` seeded
with a namespace (model identity + codec), so equal hashes mean equal token prefixes of the
same model. A *cache salt* (vLLM's ``cache_salt``: one tenant's secret) enters the first
block's hash, so salted blocks match only prompts with the same salt; no salt is the shared
namespace::

    tokens   [ t0 .. t15 ][ t16 .. t31 ][ t32 .. t47 ][ t48 t49 ]
    hashes       h0            h1            h2        (partial: not indexed)

A *holder* is a sequence id of the cache that keeps its cells after its request finished;
it holds positions 0..n-1, so every block it registers is a whole prefix. A new request
whose prompt starts with blocks h0..hk shares a holder's cells with
``cache.copy_prefix(holder, seq, (k + 1) * block_size)`` and prefills only the rest.
Holders are evicted least recently used first, block by block from their tail.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcache.validate import config_int


@dataclass(frozen=True)
class Match:
    """The longest indexed prefix of a prompt: ``blocks`` whole blocks held by ``holder``."""

    holder: int | None
    blocks: int
    tokens: int


def chain_hashes(
    tokens: Sequence[int], block_size: int, seed: bytes, salt: str | None = None
) -> list[bytes]:
    """Chained hashes of the whole blocks of ``tokens``; ``salt`` goes into the first one."""
    out: list[bytes] = []
    prev = hashlib.blake2b(seed, digest_size=16).digest()
    # token blocks are digits and commas: a NUL-framed salt can never read as one
    first = b"" if salt is None else b"\0salt\0" + salt.encode() + b"\0"
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = ",".join(str(int(t)) for t in tokens[start : start + block_size]).encode()
        head = first if start == 0 else b""
        prev = hashlib.blake2b(prev + head + block, digest_size=16).digest()
        out.append(prev)
    return out


class IndexListener(Protocol):
    """Told when a block hash enters the index (its first holder) or leaves it (its last)."""

    def stored(
        self, hashes: Sequence[bytes], parent: bytes | None, tokens: Sequence[int], salt: str | None
    ) -> None:
        """Consecutive new blocks after ``parent``; ``salt`` is set when they start at block 0."""
        ...

    def removed(self, hashes: Sequence[bytes]) -> None: ...


class PrefixIndex:
    """Block hashes -> holder sequences, with least-recently-used order over holders.

    Each indexed hash keeps its block's tokens (and, for a first block, its salt), so a
    ``listener`` can name what entered; a holder always holds a whole prefix, so a block's
    parent is indexed whenever it is.
    """

    def __init__(
        self, block_size: int = 16, namespace: str = "", listener: IndexListener | None = None
    ) -> None:
        self.block_size = config_int("block_size", block_size, 1)
        self.seed = namespace.encode()
        self.holders: OrderedDict[int, list[bytes]] = OrderedDict()  # LRU first
        self.by_hash: dict[bytes, OrderedDict[int, None]] = {}  # hash -> holders (newest last)
        self.content: dict[bytes, tuple[tuple[int, ...], str | None]] = {}  # hash -> tokens, salt
        self.listener = listener

    def hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[bytes]:
        return chain_hashes(tokens, self.block_size, self.seed, salt)

    def lookup(
        self, tokens: Sequence[int], hashes: Sequence[bytes] | None = None, salt: str | None = None
    ) -> Match:
        """The holder with the longest run of the prompt's blocks (marks it recently used)."""
        found: Match = Match(None, 0, 0)
        for i, h in enumerate(self.hashes(tokens, salt) if hashes is None else hashes):
            holders = self.by_hash.get(h)
            if not holders:
                break
            found = Match(next(reversed(holders)), i + 1, (i + 1) * self.block_size)
        if found.holder is not None:
            self.holders.move_to_end(found.holder)
        return found

    def insert(self, holder: int, tokens: Sequence[int], salt: str | None = None) -> int:
        """Register ``holder`` as holding ``tokens`` at positions 0..; returns blocks indexed."""
        hashes = self.hashes(tokens, salt)
        kept = set(hashes)
        old = self.holders.pop(holder, [])
        self._release(holder, [h for h in old if h not in kept])
        self.holders[holder] = hashes
        b = self.block_size
        new: list[int] = []
        for i, h in enumerate(hashes):
            owners = self.by_hash.get(h)
            if owners is None:
                owners = self.by_hash[h] = OrderedDict()
                self.content[h] = (tuple(tokens[i * b : (i + 1) * b]), salt if i == 0 else None)
                new.append(i)
            owners.pop(holder, None)
            owners[holder] = None  # the newest holder of h
        if self.listener is not None:
            for start, end in _runs(new):
                parent = hashes[start - 1] if start else None
                first_salt = salt if start == 0 else None
                self.listener.stored(
                    hashes[start:end], parent, tokens[start * b : end * b], first_salt
                )
        return len(hashes)

    def drop(self, holder: int, from_block: int) -> None:
        """``holder`` keeps only its blocks < from_block (0: forget it)."""
        hashes = self.holders.get(holder)
        if hashes is None:
            return
        self._release(holder, hashes[max(from_block, 0) :])
        if from_block <= 0:
            del self.holders[holder]
        else:
            self.holders[holder] = hashes[:from_block]

    def _release(self, holder: int, hashes: Sequence[bytes]) -> None:
        """``holder`` no longer holds ``hashes``; those nobody else holds leave the index."""
        gone = []
        for h in hashes:
            owners = self.by_hash[h]
            del owners[holder]
            if not owners:
                del self.by_hash[h]
                del self.content[h]
                gone.append(h)
        if gone and self.listener is not None:
            self.listener.removed(gone)

    def clear(self) -> None:
        """Forget every holder at once (the listener is not told block by block)."""
        self.holders.clear()
        self.by_hash.clear()
        self.content.clear()

    def lru(self) -> list[int]:
        """Holders, least recently used first."""
        return list(self.holders)

    def blocks(self) -> int:
        return sum(len(h) for h in self.holders.values())

    def __contains__(self, holder: object) -> bool:
        return holder in self.holders


def _runs(indexes: list[int]) -> list[tuple[int, int]]:
    """[start, end) ranges of the consecutive ints of a sorted list."""
    runs: list[list[int]] = []
    for i in indexes:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(start, end) for start, end in runs]

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


class PrefixIndex:
    """Block hashes -> holder sequences, with least-recently-used order over holders."""

    def __init__(self, block_size: int = 16, namespace: str = "") -> None:
        self.block_size = config_int("block_size", block_size, 1)
        self.seed = namespace.encode()
        self.holders: OrderedDict[int, list[bytes]] = OrderedDict()  # LRU first
        self.by_hash: dict[bytes, OrderedDict[int, None]] = {}  # hash -> holders (newest last)

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
        self.drop(holder, 0)
        hashes = self.hashes(tokens, salt)
        self.holders[holder] = hashes
        for h in hashes:
            self.by_hash.setdefault(h, OrderedDict())[holder] = None
        return len(hashes)

    def drop(self, holder: int, from_block: int) -> None:
        """``holder`` keeps only its blocks < from_block (0: forget it)."""
        hashes = self.holders.get(holder)
        if hashes is None:
            return
        for h in hashes[from_block:]:
            holders = self.by_hash[h]
            del holders[holder]
            if not holders:
                del self.by_hash[h]
        if from_block <= 0:
            del self.holders[holder]
        else:
            self.holders[holder] = hashes[:from_block]

    def lru(self) -> list[int]:
        """Holders, least recently used first."""
        return list(self.holders)

    def blocks(self) -> int:
        return sum(len(h) for h in self.holders.values())

    def __contains__(self, holder: object) -> bool:
        return holder in self.holders

"""Prefix reuse: a request starts from cells that another sequence already computed.

Two prefix indexes (``kvcache.prefix``) over the same chained block hashes::

    index     blocks whose K/V are in the cache now: idle holders (finished requests that
              keep their whole blocks) and running requests (their prompt, once computed)
    pending   blocks a running request is computing now (its prompt, while it prefills)

A request that starts looks up all of its context but the last token (that one is computed
for its logits). If a running request is computing a longer prefix than the cache holds,
the request *waits* for it (``Request.awaits``) and then takes it like any other hit:
``kvcache generate -n 4`` computes the prompt once this way. Otherwise it shares the
holder's cells (``copy_prefix``, no K/V copied), then loads further blocks from the block
store (memory / disk / Redis; K/V written straight into its cells, no model compute).

A request's ``cache_salt`` enters the first block's hash (``kvcache.prefix``): its blocks,
in the pool and in the store, match only requests with the same salt.

Holders are evicted least recently used first (a lookup counts as a use) through the
holder-eviction hook (``kvcache.engine.pressure``). Running requests are never evicted
here: the scheduler preempts them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.engine.checkpoints import LocalCheckpoints, SharedCells
from kvcache.engine.events import POOL, KVEvents, NoEvents
from kvcache.engine.pressure import HolderEviction
from kvcache.engine.request import Request
from kvcache.engine.stats import EngineStats
from kvcache.engine.store import (
    BlockIdentity,
    BlockStore,
    CorruptBlockError,
    MemoryStore,
    decode_block,
    encode_block,
)
from kvcache.errors import CacheFullError, StoreUnavailableError
from kvcache.prefix import Match, PrefixIndex

log = logging.getLogger(__name__)

EVICTED_MEMORY = 1 << 16  # block hashes remembered as evicted (to name a miss "evicted")
NO_MATCH = Match(None, 0, 0)


class NoReuse:
    """Prefix caching off: every request computes its whole context, finished cells go."""

    def __init__(self, cache: CausalCache) -> None:
        self.cache = cache
        self.resumer = SharedCells(cache)

    def attach(self, r: Request) -> None:
        if r.cached_tokens is None:
            r.cached_tokens = 0

    def waiting_on(self, seq: int) -> bool:
        return False

    def covered(self, r: Request) -> int:
        return 0

    def on_prefilled(self, r: Request) -> None:
        return None

    def on_shift(self, r: Request, keep: int) -> None:
        return None

    def on_preempt(self, r: Request) -> None:
        return None

    def on_fed(self, r: Request, count: int) -> None:
        return None

    def release(self, r: Request) -> None:
        self.cache.remove(r.seq, 0)

    def evict(self, needed: int) -> bool:
        return False

    def holders(self) -> list[int]:
        return []

    def blocks(self) -> int:
        return 0

    def watch(self, events: KVEvents) -> None:
        return None

    def reset(self) -> bool:
        return True


class _MediumEvents:
    """Index changes reported as events of one medium (the pool's)."""

    def __init__(self, events: KVEvents, medium: str) -> None:
        self.events = events
        self.medium = medium

    def stored(
        self, hashes: Sequence[bytes], parent: bytes | None, tokens: Sequence[int], salt: str | None
    ) -> None:
        self.events.stored(hashes, parent, tokens, self.medium, salt)

    def removed(self, hashes: Sequence[bytes]) -> None:
        self.events.removed(hashes, self.medium)


class PrefixReuse:
    """Finds, shares, loads, publishes and evicts prefix blocks for the scheduler."""

    def __init__(
        self,
        cache: CausalCache,
        stats: EngineStats,
        block_size: int,
        *,
        model_id: str,
        num_layers: int,
        store: BlockStore | None,
        eviction: HolderEviction,
        resumer: SharedCells | LocalCheckpoints | None = None,
    ) -> None:
        """``resumer``: how a hit takes over a holder's state (default: shared cells)."""
        self.cache = cache
        self.resumer = SharedCells(cache) if resumer is None else resumer
        self.stats = stats
        self.block_size = block_size
        self.num_layers = num_layers
        codec = f"{cache.key_codec.name}/{cache.value_codec.name}"
        namespace = f"{model_id}|{codec}"
        self.index = PrefixIndex(block_size, namespace=namespace)
        self.pending = PrefixIndex(block_size, namespace=namespace)
        self.identity = BlockIdentity(model_id, codec, block_size)
        self.store = store
        self.eviction = eviction
        self._running: set[int] = set()  # holders in `index` that belong to running requests
        self._published: set[bytes] = set()
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self.events: KVEvents = NoEvents()
        if isinstance(store, MemoryStore):
            store.on_drop = self._store_dropped

    def watch(self, events: KVEvents) -> None:
        """Report every block entering or leaving the pool or the store to ``events``."""
        self.events = events
        self.index.listener = _MediumEvents(events, POOL)

    def reset(self) -> bool:
        """Empty the prefix cache: idle holders' cells, the index and an in-process memory
        store (vLLM's ``reset_prefix_cache``); False, changing nothing, while requests run."""
        if self._running or self.pending.holders:
            return False
        for holder in list(self.index.holders):
            self.cache.remove(holder, 0)
        self.index.clear()
        self.resumer.clear()
        if isinstance(self.store, MemoryStore):
            self.store.clear()
            self._published.clear()
        self.events.cleared()
        return True

    def _store_dropped(self, key: str) -> None:
        """The memory store dropped a block for room: publish it again when next evicted."""
        h = self.identity.hash_of(key)
        if h is not None and self.store is not None:
            self._published.discard(h)
            self.events.removed([h], self.store.medium)

    # ---- a request starts ------------------------------------------------------------
    def attach(self, r: Request) -> None:
        """Start ``r`` (fed == 0) from the longest reusable prefix, or make it wait for a
        running request that is computing a longer one."""
        assert r.fed == 0 and r.seq >= 0, f"attach of request {r.id} at fed {r.fed} seq {r.seq}"
        usable = r.context[: len(r.context) - 1]
        hashes = self.index.hashes(usable, r.params.cache_salt)
        local, reason = self._local_match(usable, hashes)
        soon = self.pending.lookup(usable, hashes)
        if soon.holder is not None and soon.blocks > local.blocks:
            r.awaits = soon.holder
            return
        r.awaits = None
        blocks = local.blocks
        if local.holder is not None:
            r.fed, short = self.resumer.resume(local.holder, r.seq, local.tokens)
            reason = short or reason
        if self.store is not None and blocks < len(hashes):
            loaded, store_reason = self._load_blocks(r, hashes[blocks:])
            blocks += loaded
            reason = store_reason or reason
        if r.cached_tokens is None:  # first start: count what was reused and why not more
            r.cached_tokens = min(r.fed, r.prompt_len)
            self.stats.reused_tokens += r.cached_tokens
            miss = self._miss_reason(len(usable), hashes, blocks, reason, r.fed < local.tokens)
            if miss is not None:
                self.stats.misses[miss] += 1
        if r.fed < len(r.context) - 1:  # others may wait for the blocks it computes now
            self.pending.insert(r.seq, r.context[: max(r.prompt_len, r.fed)], r.params.cache_salt)

    def waiting_on(self, seq: int) -> bool:
        """Whether ``seq`` is still computing blocks that others wait for."""
        return seq in self.pending

    def covered(self, r: Request) -> int:
        """Tokens of ``r``'s context that ``attach`` would share rather than compute: an
        indexed prefix, or one a running request is computing (loads from the block store
        are not counted: they take cells)."""
        usable = r.context[: len(r.context) - 1]
        hashes = self.index.hashes(usable, r.params.cache_salt)
        local, _ = self._local_match(usable, hashes)
        soon = self.pending.lookup(usable, hashes)
        return max(local.tokens, soon.blocks * self.block_size)

    def _local_match(self, usable: list[int], hashes: list[bytes]) -> tuple[Match, str | None]:
        """The index's longest match whose holder can still be resumed from."""
        match = self.index.lookup(usable, hashes)
        if match.holder is not None and not self.resumer.can_resume(match.holder, match.tokens):
            return NO_MATCH, "evicted"  # a sliding window forgot the prefix's cells
        return match, None

    def _miss_reason(
        self, usable: int, hashes: list[bytes], blocks: int, reason: str | None, short: bool
    ) -> str | None:
        """Why the reuse stopped after ``blocks`` blocks, or (``short``) before the hit it
        found (None: everything usable reused)."""
        if short:
            return reason
        if blocks < len(hashes):
            if reason is not None:
                return reason
            return "evicted" if hashes[blocks] in self._evicted else "no_holder"
        return "partial_block" if usable > blocks * self.block_size else None

    def _load_blocks(self, r: Request, hashes: Sequence[bytes]) -> tuple[int, str | None]:
        """Blocks read from the store into ``r``'s next positions; and why it stopped early."""
        assert self.store is not None
        keys: list[list[torch.Tensor]] = []
        values: list[list[torch.Tensor]] = []
        reason = None
        for h in hashes:
            try:
                data = self.store.get(self.identity.key(h))
            except StoreUnavailableError as e:
                log.warning("prefix store unavailable, computing instead: %s", e)
                self.stats.store_errors += 1
                reason = "store_unavailable"
                break
            if data is None:
                break
            try:
                k, v = decode_block(data, self.identity, h)
                if len(k) != self.num_layers:
                    raise CorruptBlockError(f"{len(k)} layers, expected {self.num_layers}")
            except CorruptBlockError as e:
                log.warning("ignoring prefix block %s from %s: %s", h.hex(), self.store.name, e)
                self.stats.store_rejected += 1
                reason = e.reason
                break
            keys.append(k)
            values.append(v)
            self._published.add(h)
        if not keys or not self._write(r, keys, values):
            return 0, reason
        return len(keys), reason

    def _write(
        self, r: Request, keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]]
    ) -> bool:
        """Store loaded blocks' K/V in ``r``'s next cells, evicting idle holders for them
        if need be (False: still no room, compute instead)."""
        n = len(keys) * self.block_size
        batch = Batch(list(range(r.fed, r.fed + n)), [r.seq] * n)
        try:
            self.cache.start_forward(batch)
        except CacheFullError:  # changes nothing: make room and try once more
            if not self.evict(n):
                return False
            try:
                self.cache.start_forward(batch)
            except CacheFullError:
                return False
        dtype = self.cache.dtype
        for layer in range(self.num_layers):
            k_rows = torch.cat([blk[layer] for blk in keys]).to(dtype)  # [n, H, D]
            v_rows = torch.cat([blk[layer] for blk in values]).to(dtype)
            self.cache.put(layer, k_rows, v_rows)
        r.fed += n
        self.stats.store_tokens += n
        return True

    # ---- a request runs --------------------------------------------------------------
    def on_prefilled(self, r: Request) -> None:
        """``r`` computed its whole context: its blocks become a hit for others."""
        if r.seq not in self.pending:
            return
        self.pending.drop(r.seq, 0)
        n = (r.fed // self.block_size) * self.block_size
        if n:
            self.index.insert(r.seq, r.context[:n], r.params.cache_salt)
            self._running.add(r.seq)

    def on_shift(self, r: Request, keep: int) -> None:
        """``r`` drops positions from ``keep``: blocks from there on no longer describe it."""
        self.index.drop(r.seq, keep // self.block_size)
        self.pending.drop(r.seq, keep // self.block_size)
        self.resumer.drop(r.seq)

    def on_preempt(self, r: Request) -> None:
        """``r`` loses its cells: it holds nothing and computes nothing any more."""
        self.index.drop(r.seq, 0)
        self.pending.drop(r.seq, 0)
        self._running.discard(r.seq)
        self.resumer.drop(r.seq)

    def on_fed(self, r: Request, count: int) -> None:
        """``r`` just fed ``count`` tokens (a prompt chunk when more than one)."""
        self.resumer.after_forward(r.seq, r.fed, count > 1)

    # ---- a request ends --------------------------------------------------------------
    def release(self, r: Request) -> None:
        """Keep ``r``'s whole blocks as an idle holder (published to the store), free the rest."""
        self.pending.drop(r.seq, 0)
        self._running.discard(r.seq)
        n = (r.fed // self.block_size) * self.block_size
        if n == 0:
            self.index.drop(r.seq, 0)
            self.cache.remove(r.seq, 0)
            self.resumer.drop(r.seq)
            return
        self.cache.remove(r.seq, n)
        self.resumer.released(r.seq, n)
        self.index.insert(r.seq, r.context[:n], r.params.cache_salt)
        if self.store is not None:
            self.publish(r.seq, self.index.holders[r.seq])

    def publish(self, seq: int, hashes: list[bytes]) -> None:
        """Write the blocks of ``seq`` (its ``hashes``, from position 0) the store lacks."""
        if self.store is None:
            return
        todo = [i for i, h in enumerate(hashes) if h not in self._published]
        if not todo:
            return
        b = self.block_size
        cells = torch.from_numpy(self.cache.cells_of(seq))  # in position order
        first = self.cache.positions(seq)[0] if len(cells) else 0  # > 0 after a window forgot
        layers = self.cache.layers()
        for i in todo:
            if i * b < first:
                continue  # no longer stored
            idx = cells[i * b - first : (i + 1) * b - first]
            kv = [self.cache.read(layer, idx) for layer in layers]
            try:
                self.store.put(
                    self.identity.key(hashes[i]),
                    encode_block(self.identity, hashes[i], [k for k, _ in kv], [v for _, v in kv]),
                )
            except StoreUnavailableError as e:  # not marked published: tried again later
                log.warning("prefix store unavailable, block not published: %s", e)
                self.stats.store_errors += 1
                return
            self._published.add(hashes[i])
            self.stats.store_published += 1
            content = self.index.content.get(hashes[i])
            if content is not None:
                parent = hashes[i - 1] if i else None
                medium = getattr(self.store, "medium", self.store.name.upper())
                self.events.stored([hashes[i]], parent, content[0], medium, content[1])

    def adopt(self, seq: int, tokens: Sequence[int], snapshot: object = None) -> int:
        """``seq`` (cells restored from elsewhere: a session, ``snapshot``) becomes an idle
        holder of ``tokens``' whole blocks; cells past them are freed. Returns the tokens
        indexed."""
        n = self.index.insert(seq, tokens) * self.block_size
        self.cache.remove(seq, n)
        if n == 0:
            self.index.drop(seq, 0)
            return 0
        self.resumer.adopted(seq, snapshot)
        self.resumer.released(seq, n)
        return n

    # ---- room ------------------------------------------------------------------------
    def evict(self, needed: int) -> bool:
        """Evict idle holders, least recently used first, until ``needed`` cells are free;
        whether any was evicted."""
        evicted = False
        for holder in self.holders():
            if self.cache.free_cells() >= needed:
                break
            hashes = self.index.holders[holder]
            self.eviction.evict(self, holder, hashes)
            self.index.drop(holder, 0)
            self.resumer.drop(holder)
            for h in hashes:
                self._evicted[h] = None
                self._evicted.move_to_end(h)
            while len(self._evicted) > EVICTED_MEMORY:
                self._evicted.popitem(last=False)
            self.stats.evictions += 1
            evicted = True
        return evicted

    def holders(self) -> list[int]:
        """Idle holders, least recently used first."""
        return [h for h in self.index.lru() if h not in self._running]

    def blocks(self) -> int:
        return self.index.blocks()


def shared_prefix(cache: CausalCache, seq: int) -> int:
    """Positions at the start of ``seq`` whose cells another sequence uses too."""
    cells = cache.cells_of(seq)
    others = [cache.cells_of(s) for s in cache.sequences() if s != seq]
    if not len(cells) or not others:
        return 0
    shared = np.flatnonzero(np.isin(cells, np.concatenate(others)))
    return int(cache.positions(seq)[shared[-1]]) + 1 if len(shared) else 0

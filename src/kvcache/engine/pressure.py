"""What gives way when the cell pool is full: idle prefix holders first, then running requests.

Two hooks, each a policy chosen by name from a table (``EngineConfig.holder_eviction``,
``EngineConfig.preemption``)::

    need cells ──> evict idle holders, least recently used first   HOLDER_EVICTIONS
               └─> preempt the youngest running request            PREEMPTIONS
                   ... readmitted later: resume(), else recompute

Preemption: ``Spill`` (the default) moves the victim's cells into a snapshot
(``kvcache.engine.spill``: host memory, or files with ``EngineConfig.spill="disk:PATH"``) on
``request.parked`` and restores them, exactly as stored, when the request is readmitted;
``Recompute`` forgets them and the request computes its context again (vLLM's recompute mode).
``cells_needed`` tells the scheduler how many free cells a readmission takes, so a parked
request waits at the head of the queue until its cells fit.

Holder eviction: ``Demote`` (the default) first writes the holder's blocks that the block
store lacks (``reuse.publish``; nothing without a store), so a later prompt loads them instead
of computing them; ``DropHolder`` forgets the cells.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvcache.engine.spill import Parked, SpillTier, spill_tier

if TYPE_CHECKING:
    from kvcache.causal import CausalCache
    from kvcache.engine.request import Request
    from kvcache.engine.reuse import PrefixReuse


class Preemption(Protocol):
    """What happens to a running request's cells when the pool needs them."""

    name: str

    def preempt(self, cache: CausalCache, request: Request) -> None:
        """Free the cells of ``request.seq`` (keeping whatever ``resume`` needs)."""
        ...

    def resume(self, cache: CausalCache, request: Request) -> int:
        """On readmission into ``request.seq``: positions restored (0: recompute them)."""
        ...

    def cells_needed(self, request: Request) -> int:
        """Free cells ``resume`` needs (0: none, it recomputes)."""
        ...

    def discard(self, request: Request) -> None:
        """Give up what was kept: the request will recompute."""
        ...


class Recompute:
    """Throw the cells away; the readmitted request recomputes its context."""

    name = "recompute"

    def preempt(self, cache: CausalCache, request: Request) -> None:
        cache.remove(request.seq, 0)

    def resume(self, cache: CausalCache, request: Request) -> int:
        return 0

    def cells_needed(self, request: Request) -> int:
        return 0

    def discard(self, request: Request) -> None:
        return None


class Spill:
    """Snapshot the cells into a spill tier, free them, restore them on readmission."""

    name = "spill"

    def __init__(self, tier: SpillTier) -> None:
        self.tier = tier

    def preempt(self, cache: CausalCache, request: Request) -> None:
        if len(cache.cells_of(request.seq)):
            request.parked = self.tier.put(cache.snapshot(request.seq))
        cache.remove(request.seq, 0)

    def resume(self, cache: CausalCache, request: Request) -> int:
        parked = request.parked
        if not isinstance(parked, Parked):
            return 0
        # fits: cells_needed said so; a HybridCache (typed here as CausalCache) takes its own
        cache.restore(self.tier.take(parked), request.seq)  # type: ignore[arg-type]
        request.parked = None
        return parked.next_position

    def cells_needed(self, request: Request) -> int:
        parked = request.parked
        return parked.cells if isinstance(parked, Parked) else 0

    def discard(self, request: Request) -> None:
        if isinstance(request.parked, Parked):
            self.tier.drop(request.parked)
        request.parked = None


class HolderEviction(Protocol):
    """What happens to an idle prefix holder's cells when the pool needs them."""

    name: str

    def evict(self, reuse: PrefixReuse, holder: int, hashes: list[bytes]) -> None:
        """Free the holder's cells (``hashes``: the blocks it held, in order)."""
        ...


class DropHolder:
    """Forget the holder: its blocks live on only where they were published."""

    name = "drop"

    def evict(self, reuse: PrefixReuse, holder: int, hashes: list[bytes]) -> None:
        reuse.cache.remove(holder, 0)


class Demote:
    """Write the holder's unpublished blocks to the block store, then forget its cells."""

    name = "demote"

    def evict(self, reuse: PrefixReuse, holder: int, hashes: list[bytes]) -> None:
        reuse.publish(holder, hashes)
        reuse.cache.remove(holder, 0)


# EngineConfig.preemption -> the policy, given EngineConfig.spill
PREEMPTIONS: dict[str, Callable[[str], Preemption]] = {
    "spill": lambda spill: Spill(spill_tier(spill)),
    "recompute": lambda spill: Recompute(),
}
HOLDER_EVICTIONS: dict[str, type[HolderEviction]] = {"demote": Demote, "drop": DropHolder}

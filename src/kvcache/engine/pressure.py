"""What gives way when the cell pool is full: idle prefix holders first, then running requests.

Two hooks, each a policy chosen by name from a table (``EngineConfig.holder_eviction``,
``EngineConfig.preemption``)::

    need cells ──> evict idle holders, least recently used first   HOLDER_EVICTIONS
               └─> preempt the youngest running request            PREEMPTIONS
                   ... readmitted later: resume(), else recompute

``DropHolder`` forgets an evicted holder's cells; ``Recompute`` forgets a preempted request's
cells, and the request recomputes its context when it is readmitted (vLLM's recompute mode).
A policy that keeps state elsewhere implements the same methods: ``evict`` may first demote
the holder's blocks (``reuse.publish(holder, hashes)`` writes them to the block store), and
``preempt`` may park a snapshot of the request's cells on ``request.parked``; ``resume`` then
restores them into the request's new sequence and returns the positions restored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

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


class Recompute:
    """Throw the cells away; the readmitted request recomputes its context."""

    name = "recompute"

    def preempt(self, cache: CausalCache, request: Request) -> None:
        cache.remove(request.seq, 0)

    def resume(self, cache: CausalCache, request: Request) -> int:
        return 0


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


PREEMPTIONS: dict[str, type[Preemption]] = {"recompute": Recompute}
HOLDER_EVICTIONS: dict[str, type[HolderEviction]] = {"drop": DropHolder}

"""Where a preempted request's cells wait until it is readmitted (``EngineConfig.spill``).

    memory       the :class:`~kvcache.snapshot.Snapshot` itself, in this process (default)
    disk:PATH    a snapshot file ``PATH/spill-<pid>-<n>.safetensors``, read back (its SHA-256
                 checked) and deleted when the request resumes

Either way the cells come back exactly as they were stored (codes, fp16 window rows,
positions), so a resumed request continues as if it had never left the pool (vLLM's swap
to host memory, SGLang's hierarchical cache) instead of computing its context again.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvcache.errors import InvalidConfigError
from kvcache.snapshot import HybridSnapshot, Snapshot, load_any

Snap = Snapshot | HybridSnapshot  # a hybrid cache's requests spill both parts


@dataclass(frozen=True)
class Parked:
    """A spilled request's cells: where they are and what restoring them takes."""

    cells: int  # cells the restore needs
    next_position: int  # one past the highest position restored (what the request has fed)
    nbytes: int  # bytes of the stored cells
    payload: Snap | Path


class SpillTier(Protocol):
    """Keeps snapshots of preempted requests."""

    name: str

    def put(self, snapshot: Snap) -> Parked: ...

    def take(self, parked: Parked) -> Snap:
        """The snapshot back (the tier forgets it)."""
        ...

    def drop(self, parked: Parked) -> None:
        """Forget a snapshot that will not be restored."""
        ...


def _parked(snapshot: Snap, payload: Snap | Path) -> Parked:
    return Parked(len(snapshot), snapshot.positions[-1] + 1, snapshot.nbytes(), payload)


class MemoryTier:
    """Snapshots kept as objects in this process (host memory)."""

    name = "memory"

    def put(self, snapshot: Snap) -> Parked:
        return _parked(snapshot, snapshot)

    def take(self, parked: Parked) -> Snap:
        assert not isinstance(parked.payload, Path), f"not a memory snapshot: {parked}"
        return parked.payload

    def drop(self, parked: Parked) -> None:
        return None


class DiskTier:
    """Snapshots written as files under ``folder`` (created if missing)."""

    name = "disk"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._names = itertools.count()

    def put(self, snapshot: Snap) -> Parked:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"spill-{os.getpid()}-{next(self._names)}.safetensors"
        snapshot.save(path)
        return _parked(snapshot, path)

    def take(self, parked: Parked) -> Snap:
        assert isinstance(parked.payload, Path), f"not a spill file: {parked}"
        try:
            return load_any(parked.payload)
        finally:
            parked.payload.unlink(missing_ok=True)

    def drop(self, parked: Parked) -> None:
        if isinstance(parked.payload, Path):
            parked.payload.unlink(missing_ok=True)


def spill_tier(spec: str) -> SpillTier:
    """The tier a spec names: "memory" or "disk:PATH"."""
    if spec == "memory":
        return MemoryTier()
    if isinstance(spec, str) and spec.startswith("disk:") and len(spec) > len("disk:"):
        return DiskTier(Path(spec[len("disk:") :]))
    raise InvalidConfigError("spill", spec, '"memory" or "disk:PATH"')

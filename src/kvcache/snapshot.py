"""A sequence's cells saved and restored exactly as stored (llama.cpp's slot save/restore,
Ollama's cache snapshots): ``cache.snapshot(seq)``, ``cache.restore(snapshot, seq)``,
``Snapshot.save(path)``, ``Snapshot.load(path)``.

Nothing is decoded or re-encoded: a snapshot copies the codec's bytes (codes, scales,
minimums, key centres, KIVI's channel ranges), the fp16 rows still in the sequence's recent
window and which rows those are, the metadata records the rows use, and the positions (after
any shift or removal). Restoring writes the same bytes into free cells of a cache with the
same model, codecs, key_rope mode, dtype, attention policy and layer shapes, so a decode
after a restore gives the same logits as one that was never interrupted (attention reads a
sequence's cells in position order, wherever they landed: ``kvcache.kernels.plan``).

Tensors of a snapshot of n cells, cell i being the sequence's i-th by position::

    positions                int64 [n]
    tokens                   int64 [n]    optional: each cell's token id (sessions)
    window.{w}.open          uint8 [n]    1: the row is in its fp16 window
    window.{w}.record        int32 [n]    the sealed row's metadata record (-1: none)
    window.{w}.sequence      int32 [1]    the sequence's own record (-1: none)
    layer.{l}.{role}.{name}  a buffer's bytes (``Buffer.export_rows``): codes, scale, low,
                             data [sealed, ...]; residual fp16 [open, H, D]; record.{name}
                             [records, ...] (records numbered 0.. per window, as above)

``role`` is "key" or "value"; ``w`` names a codec window by the role that owns it ("value"
only when the values' window differs from the keys'). The header (JSON) says what the bytes
need: format and version, model id, both codecs' identities, key_rope, dtype, window, chunk,
each layer's (kv_heads, head_dim) of K and V, and n.

File: safetensors, the header under metadata "kvcache.snapshot" and a SHA-256 over the header
and every tensor (name, dtype, shape, bytes) under "sha256", checked on load. A file that
cannot be trusted raises :class:`~kvcache.errors.SnapshotCorruptError`, one of another format
version :class:`~kvcache.errors.SnapshotVersionError`, a snapshot of another model or codec
:class:`~kvcache.errors.SnapshotMismatchError`; each leaves the cache as it was, and so does a
restore into a cache without enough free cells (:class:`~kvcache.errors.CacheFullError`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors
import safetensors.torch
import torch

from kvcache.codecs.base import Buffer
from kvcache.errors import (
    CacheFullError,
    InvalidArgumentError,
    SnapshotCorruptError,
    SnapshotMismatchError,
    SnapshotVersionError,
)
from kvcache.recent import Windows, WindowState
from kvcache.storage import LayerStorage, Storage

if TYPE_CHECKING:
    from kvcache.causal import CausalCache

FORMAT = "kvcache.snapshot"
VERSION = 1
HEADER_KEY = "kvcache.snapshot"
HASH_KEY = "sha256"
ROLES = ("key", "value")
ModelId = str | Mapping[str, Any]


def model_id_str(model_id: ModelId) -> str:
    """A model identity as one canonical string (mappings as sorted JSON)."""
    if isinstance(model_id, str):
        return model_id
    if isinstance(model_id, Mapping):
        return json.dumps(dict(model_id), sort_keys=True, default=str)
    raise InvalidArgumentError("model_id", model_id, "a str or a mapping")


@dataclass(frozen=True)
class Snapshot:
    """One sequence's stored cells (layout in the module docstring)."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def model_id(self) -> str:
        return str(self.header["model_id"])

    def __len__(self) -> int:
        """Number of cells (tokens) held."""
        return int(self.header["cells"])

    @property
    def positions(self) -> list[int]:
        return [int(p) for p in self.tensors["positions"].tolist()]

    @property
    def tokens(self) -> list[int] | None:
        """Each cell's token id, when the snapshot was taken with them."""
        t = self.tensors.get("tokens")
        return None if t is None else [int(x) for x in t.tolist()]

    def head(self, count: int) -> Snapshot:
        """The first ``count`` cells by position, as ``remove(seq, positions[count])`` after
        a restore would leave them (no re-encoding: rows are sliced, unused records go)."""
        n = len(self)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= n:
            raise InvalidArgumentError("count", count, f"an int in [1, {n}]")
        return self._cells(0, count)

    def _cells(self, lo: int, hi: int) -> Snapshot:
        """Cells ``lo..hi-1`` by position (1 <= hi - lo): encoded rows, fp16 window rows and
        the records the kept cells (and the sequence) use, sliced without re-encoding."""
        if lo == 0 and hi == len(self):
            return self
        out: dict[str, torch.Tensor] = {
            k: self.tensors[k][lo:hi].clone() for k in ("positions", "tokens") if k in self.tensors
        }
        opened: dict[str, tuple[int, int]] = {}  # a window's open rows before lo and before hi
        kept_records: dict[str, torch.Tensor] = {}
        for w in [k.split(".")[1] for k in self.tensors if k.endswith(".open")]:
            every_open = self.tensors[f"window.{w}.open"]
            open_ = every_open[lo:hi]
            record = self.tensors[f"window.{w}.record"][lo:hi]
            sequence = int(self.tensors[f"window.{w}.sequence"][0])
            used = torch.unique(torch.cat([record[record >= 0], torch.tensor([sequence])]))
            used = used[used >= 0]  # old local ids kept, ascending
            remap = torch.full((max(int(used.max()) + 1, 1) if len(used) else 1,), -1)
            remap[used] = torch.arange(len(used))
            out[f"window.{w}.open"] = open_.clone()
            out[f"window.{w}.record"] = torch.where(record >= 0, remap[record.clamp_min(0)], -1).to(
                torch.int32
            )
            out[f"window.{w}.sequence"] = torch.tensor(
                [int(remap[sequence]) if sequence >= 0 else -1], dtype=torch.int32
            )
            opened[w] = (int(every_open[:lo].sum()), int(every_open[:hi].sum()))
            kept_records[w] = used
        for name, t in self.tensors.items():
            if not name.startswith("layer."):
                continue
            _, layer, role, field = name.split(".", 3)
            owner = _owner(self.tensors, layer, role)
            if owner is None:
                out[name] = t[lo:hi].clone()  # a float buffer: one row a cell
                continue
            open_lo, open_hi = opened[owner]
            if field == "residual":  # the open cells' rows, in position order
                out[name] = t[open_lo:open_hi].clone()
            elif field.startswith("record."):
                out[name] = t.index_select(0, kept_records[owner])
            else:  # the encoded cells' rows, in position order
                out[name] = t[lo - open_lo : hi - open_hi].clone()
        return Snapshot({**self.header, "cells": hi - lo}, out)

    def resumes(self, pos: int) -> bool:
        """Whether a token at ``pos`` can be processed from these cells once restored (the
        rule of ``CausalCache.can_resume``: a window cache needs the window before ``pos``)."""
        stored = self.positions
        if self.header["window"] is None:
            return pos <= len(self)
        return max(0, pos - self.header["window"]) >= stored[0] and pos <= stored[-1] + 1

    def head_before(self, pos: int) -> Snapshot:
        """The cells at positions < ``pos`` (at least one), as :meth:`head` cuts them."""
        count = sum(1 for p in self.positions if p < pos)
        return self if count == len(self) else self.head(count)

    def window_before(self, pos: int) -> Snapshot:
        """What resuming at ``pos`` needs (:meth:`resumes`): the cells at positions < ``pos``,
        of a window cache only those the window before ``pos`` holds, so a restore takes no
        more cells than the sequence keeps between forwards."""
        positions = self.positions
        hi = sum(1 for p in positions if p < pos)
        window = self.header["window"]
        lo = 0 if window is None else sum(1 for p in positions[:hi] if p < pos - window)
        return self._cells(lo, max(hi, lo + 1))

    def nbytes(self) -> int:
        """Bytes of the stored cells: every layer's tensors (the bookkeeping not counted)."""
        return sum(_nbytes(t) for n, t in self.tensors.items() if n.startswith("layer."))

    def save(self, path: str | Path) -> None:
        """Write a safetensors file (atomically: a temporary file renamed over ``path``)."""
        _write(path, self.header, self.tensors)

    @classmethod
    def load(cls, path: str | Path) -> Snapshot:
        """Read a file written by :meth:`save`; any damage raises SnapshotCorruptError."""
        return cls.from_bytes(Path(path).read_bytes(), str(path))

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "snapshot") -> Snapshot:
        """A snapshot from a file's bytes (checked as :meth:`load` does)."""
        header, tensors = _read(data, name, FORMAT)
        _check_header(header, name)
        return cls(header, tensors)


# ---- taking ------------------------------------------------------------------------------
def take(cache: CausalCache, seq: int, model_id: ModelId, tokens: Sequence[int] | None) -> Snapshot:
    """``seq``'s cells of ``cache`` as stored (see ``CausalCache.snapshot``)."""
    cells = cache.cells.ordered(seq).copy()  # [n] by position
    if len(cells) == 0:
        raise InvalidArgumentError("seq", seq, "a sequence that holds cells")
    tensors = {"positions": torch.from_numpy(cache.cells.pos[cells].copy())}
    if tokens is not None:
        if len(tokens) != len(cells):
            raise InvalidArgumentError("tokens", f"{len(tokens)} ids", f"{len(cells)} (one a cell)")
        tensors["tokens"] = torch.tensor([int(t) for t in tokens], dtype=torch.int64)
    storage = cache.storage
    records: dict[str, np.ndarray] = {}
    for w, windows in _windows(storage).items():
        state, records[w] = windows.export(seq, cells)
        tensors[f"window.{w}.open"] = torch.from_numpy(state.open.astype(np.uint8))
        tensors[f"window.{w}.record"] = torch.from_numpy(state.record)
        tensors[f"window.{w}.sequence"] = torch.tensor([state.sequence], dtype=torch.int32)
    for layer, st in sorted(storage.layers.items()):
        for role, buf in zip(ROLES, (st.keys, st.values), strict=True):
            owner = _window_of(storage, role)
            ids = records[owner] if owner is not None else np.zeros(0, dtype=np.int64)
            for name, t in buf.export_rows(cells, ids).items():
                tensors[f"layer.{layer}.{role}.{name}"] = t.cpu().contiguous()
    return Snapshot(_header(cache, model_id_str(model_id), len(cells)), tensors)


def _header(cache: CausalCache, model_id: str, n: int) -> dict[str, Any]:
    storage = cache.storage
    return {
        "format": FORMAT,
        "version": VERSION,
        "cells": n,
        **_identity(cache, model_id),
        "layers": {
            str(layer): [list(st.key_shape), list(st.value_shape)]
            for layer, st in sorted(storage.layers.items())
        },
    }


def _identity(cache: CausalCache, model_id: str) -> dict[str, Any]:
    """What a snapshot's bytes must match in the cache that restores them."""
    kc, vc = cache.storage.codecs
    return {
        "model_id": model_id,
        "codecs": {"key": kc.identity(), "value": vc.identity()},
        "key_rope": cache.key_rope,
        "dtype": str(cache.dtype),
        "window": cache.window,
        "chunk": cache.chunk,
    }


# ---- restoring ---------------------------------------------------------------------------
def restore(cache: CausalCache, snap: Snapshot, seq: int, model_id: ModelId) -> None:
    """Write ``snap``'s cells into free cells of ``cache`` as sequence ``seq`` (see
    ``CausalCache.restore``); every check runs before anything changes."""
    if not isinstance(snap, Snapshot):
        raise InvalidArgumentError("snapshot", type(snap).__name__, "a kvcache Snapshot")
    if len(cache.cells.cells_of(seq)):
        raise InvalidArgumentError("seq", seq, "a sequence holding no cells (remove it first)")
    _check_header(snap.header, "snapshot")
    want = _identity(cache, model_id_str(model_id))
    for key, value in want.items():
        if snap.header[key] != value:
            raise SnapshotMismatchError(key, snap.header[key], value)
    n = len(snap)
    positions = _positions(snap, n)
    states = {w: _state(snap, w, windows, n) for w, windows in _windows(cache.storage).items()}
    layers = _layers(cache.storage, snap)
    _check_tensors(cache.storage, snap, layers, states)
    free = cache.cells.free_count()
    if free < n:
        raise CacheFullError(n, free, cache.num_cells)
    # ---- nothing has changed so far; from here on nothing fails -----------------------
    if seq in cache.cells.ranges:  # known, but empty (copy_prefix of nothing)
        cache.cells.forget(seq)
        cache.storage.forget(seq)
    locs = cache.cells.find_free(n)
    cache.cells.occupy(locs, positions, np.full(n, seq, dtype=np.int64))
    ids = {w: windows.adopt(seq, locs, states[w]) for w, windows in _windows(cache.storage).items()}
    for layer, st in layers.items():
        cache.storage.layers[layer] = st
        for role, buf in zip(ROLES, (st.keys, st.values), strict=True):
            w = _window_of(cache.storage, role)
            rec = ids[w] if w is not None else np.zeros(0, dtype=np.int64)
            prefix = f"layer.{layer}.{role}."
            rows = {k[len(prefix) :]: t for k, t in snap.tensors.items() if k.startswith(prefix)}
            buf.import_rows(locs, rec, rows)


def _positions(snap: Snapshot, n: int) -> np.ndarray:
    t = _tensor(snap, "positions", torch.int64, (n,))
    pos = t.numpy()
    if n and (int(pos.min()) < 0 or len(np.unique(pos)) != n or (np.diff(pos) <= 0).any()):
        raise SnapshotCorruptError("positions must be distinct, >= 0 and ascending")
    if "tokens" in snap.tensors:
        _tensor(snap, "tokens", torch.int64, (n,))
    return pos.copy()


def _state(snap: Snapshot, w: str, windows: Windows, n: int) -> WindowState:
    open_ = _tensor(snap, f"window.{w}.open", torch.uint8, (n,)).numpy()
    record = _tensor(snap, f"window.{w}.record", torch.int32, (n,)).numpy().copy()
    sequence = int(_tensor(snap, f"window.{w}.sequence", torch.int32, (1,))[0])
    if (open_ > 1).any():
        raise SnapshotCorruptError(f"window.{w}.open holds values other than 0 and 1")
    used = record[record >= 0]
    count = max(int(used.max()) + 1 if len(used) else 0, sequence + 1)
    state = WindowState(open_.astype(bool), record, sequence, count)
    problem = windows.problem(state)
    if problem is not None:
        raise SnapshotCorruptError(f"window.{w}: {problem}")
    return state


def _layers(storage: Storage, snap: Snapshot) -> dict[int, LayerStorage]:
    """The cache's layer storages for the snapshot's layers (new ones not registered yet)."""
    shapes = {
        int(k): ((int(v[0][0]), int(v[0][1])), (int(v[1][0]), int(v[1][1])))
        for k, v in snap.header["layers"].items()
    }
    have = {k: (st.key_shape, st.value_shape) for k, st in storage.layers.items()}
    if have and sorted(have) != sorted(shapes):
        raise SnapshotMismatchError("layers", sorted(shapes), sorted(have))
    out = {}
    for layer, (k_shape, v_shape) in sorted(shapes.items()):
        if layer in have and have[layer] != (k_shape, v_shape):
            raise SnapshotMismatchError(f"layer {layer} shapes", (k_shape, v_shape), have[layer])
        st = storage.layers.get(layer)
        out[layer] = st if st is not None else storage.new_layer(k_shape, v_shape)
    return out


def _check_tensors(
    storage: Storage,
    snap: Snapshot,
    layers: dict[int, LayerStorage],
    states: dict[str, WindowState],
) -> None:
    """Every tensor the layers' buffers will take has its dtype and shape; no other exists."""
    n = len(snap)
    expected = {"positions", "tokens"} | {
        f"window.{w}.{k}" for w in states for k in ("open", "record", "sequence")
    }
    for layer, st in layers.items():
        for role, buf in zip(ROLES, (st.keys, st.values), strict=True):
            w = _window_of(storage, role)
            state = states[w] if w is not None else None
            formats = _formats(buf, state, n)
            for name, (dtype, shape) in formats.items():
                full = f"layer.{layer}.{role}.{name}"
                _tensor(snap, full, dtype, shape)
                expected.add(full)
    extra = sorted(set(snap.tensors) - expected)
    if extra:
        raise SnapshotCorruptError(f"unexpected tensors {extra[:4]}")


def _formats(buf: Buffer, state: WindowState | None, n: int) -> dict[str, Any]:
    if state is None:
        return buf.row_formats(n, 0, 0)
    opened = int(np.count_nonzero(state.open))
    return buf.row_formats(n - opened, opened, state.count)


def _tensor(snap: Snapshot, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = snap.tensors.get(name)
    if t is None:
        raise SnapshotCorruptError(f"tensor {name!r} is missing")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise SnapshotCorruptError(
            f"tensor {name!r} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}"
        )
    return t


# ---- shared ------------------------------------------------------------------------------
def _windows(storage: Storage) -> dict[str, Windows]:
    """The storage's codec windows by owning role (the values' only when not the keys')."""
    out: dict[str, Windows] = {}
    for role, windows in zip(ROLES, storage.roles, strict=True):
        if windows is not None and all(windows is not w for w in out.values()):
            out[role] = windows
    return out


def _window_of(storage: Storage, role: str) -> str | None:
    """Name of the window a role's buffers use (None: a codec without one)."""
    mine = storage.roles[ROLES.index(role)]
    for w, windows in _windows(storage).items():
        if windows is mine:
            return w
    return None


def _owner(tensors: Mapping[str, torch.Tensor], layer: str, role: str) -> str | None:
    """Window a snapshot's buffer uses: its role's, else the keys' (shared), None (float)."""
    if f"layer.{layer}.{role}.residual" not in tensors:
        return None
    return role if f"window.{role}.open" in tensors else "key"


_HEADER_TYPES = {
    "format": str,
    "version": int,
    "cells": int,
    "model_id": str,
    "codecs": dict,
    "key_rope": str,
    "dtype": str,
    "layers": dict,
}


def _check_header(header: object, name: str) -> None:
    if not isinstance(header, dict):
        raise SnapshotCorruptError(f"{name}: the header is not a JSON object")
    for key, kind in _HEADER_TYPES.items():
        if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
            raise SnapshotCorruptError(f"{name}: header field {key!r} missing or not {kind}")
    if header["cells"] < 1:
        raise SnapshotCorruptError(f"{name}: cells={header['cells']} (a snapshot holds >= 1)")
    for key in ("window", "chunk"):
        if key not in header or not (header[key] is None or isinstance(header[key], int)):
            raise SnapshotCorruptError(f"{name}: header field {key!r} missing or not an int")
    for layer, shapes in header["layers"].items():
        ok = layer.isdigit() and isinstance(shapes, list) and len(shapes) == 2
        ok = ok and all(
            isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and x > 0 for x in s)
            for s in shapes
        )
        if not ok:
            raise SnapshotCorruptError(f"{name}: layer {layer!r} shapes {shapes!r}")


def _metadata(data: bytes, name: str) -> dict[str, Any]:
    """The safetensors header's ``__metadata__`` (8-byte little-endian length, then JSON)."""
    if len(data) < 8:
        raise SnapshotCorruptError(f"{name}: {len(data)} bytes, too short for safetensors")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise SnapshotCorruptError(f"{name}: header of {size} bytes in a {len(data)}-byte file")
    header = _json(data[8 : 8 + size], name)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise SnapshotCorruptError(f"{name}: no safetensors metadata")
    return meta


def _write(path: str | Path, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file with the header and its SHA-256, atomically (a temporary renamed)."""
    text = json.dumps(header, sort_keys=True)
    meta = {HEADER_KEY: text, HASH_KEY: _digest(text, tensors)}
    data = safetensors.torch.save(tensors, metadata=meta)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read(data: bytes, name: str, fmt: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A snapshot file's header and tensors, its format, version and SHA-256 checked."""
    meta = _metadata(data, name)
    header_text = meta.get(HEADER_KEY)
    if not isinstance(header_text, str):
        raise SnapshotCorruptError(f"{name}: no {HEADER_KEY!r} metadata")
    header = _json(header_text, name)
    if header.get("format") != fmt or header.get("version") != VERSION:
        raise SnapshotVersionError(
            f"{name}: format {header.get('format')!r} version {header.get('version')!r}, "
            f"this kvcache reads {fmt!r} version {VERSION}"
        )
    try:
        tensors = safetensors.torch.load(data)
    except (safetensors.SafetensorError, ValueError, TypeError, RuntimeError) as e:
        raise SnapshotCorruptError(f"{name}: unreadable tensors ({e})") from e
    if meta.get(HASH_KEY) != _digest(header_text, tensors):
        raise SnapshotCorruptError(f"{name}: SHA-256 mismatch (the file was changed)")
    return header, tensors


def _json(text: str | bytes, name: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise SnapshotCorruptError(f"{name}: header is not JSON ({e})") from e
    if not isinstance(value, dict):
        raise SnapshotCorruptError(f"{name}: header is not a JSON object")
    return value


def _digest(header: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the header text and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(header.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- a hybrid cache's snapshot (kvcache.wrapper.HybridCache) -------------------------------
HYBRID_FORMAT = "kvcache.hybrid-snapshot"
PARTS = ("full", "local")


@dataclass(frozen=True)
class HybridSnapshot:
    """A sequence's cells in both parts of a hybrid cache: every position of the full
    (global-layer) part, the last window of the local part; one file, each part checked
    as a :class:`Snapshot` is."""

    full: Snapshot
    local: Snapshot

    @property
    def model_id(self) -> str:
        return self.full.model_id

    def __len__(self) -> int:
        """Positions held (those of the full part)."""
        return len(self.full)

    @property
    def positions(self) -> list[int]:
        return self.full.positions

    @property
    def tokens(self) -> list[int] | None:
        return self.full.tokens

    def head(self, count: int) -> HybridSnapshot:
        """The first ``count`` positions; InvalidArgumentError unless the local part still
        holds the window before them (a head further back needs an older checkpoint)."""
        if not self.local.resumes(count):
            raise InvalidArgumentError(
                "count", count, "a head whose local window the snapshot still holds"
            )
        return HybridSnapshot(self.full.head(count), self.local.head_before(count))

    def nbytes(self) -> int:
        return self.full.nbytes() + self.local.nbytes()

    def save(self, path: str | Path) -> None:
        """One safetensors file: each part's tensors under ``full/`` and ``local/``, both
        headers and a SHA-256 over everything."""
        tensors = {f"{part}/{k}": t for part in PARTS for k, t in self._part(part).tensors.items()}
        header = {"format": HYBRID_FORMAT, "version": VERSION}
        _write(path, header | {part: self._part(part).header for part in PARTS}, tensors)

    def _part(self, part: str) -> Snapshot:
        return self.full if part == "full" else self.local

    @classmethod
    def load(cls, path: str | Path) -> HybridSnapshot:
        """Read a file written by :meth:`save`; any damage raises SnapshotCorruptError."""
        name = str(path)
        header, tensors = _read(Path(path).read_bytes(), name, HYBRID_FORMAT)
        parts = []
        for part in PARTS:
            sub = header.get(part)
            _check_header(sub, f"{name} ({part})")
            prefix = f"{part}/"
            own = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
            parts.append(Snapshot(sub, own))  # type: ignore[arg-type]
        return cls(parts[0], parts[1])


def load_any(path: str | Path) -> Snapshot | HybridSnapshot:
    """A snapshot file of either kind (the header's format says which)."""
    data = Path(path).read_bytes()
    meta = _metadata(data, str(path))
    text = meta.get(HEADER_KEY)
    fmt = _json(text, str(path)).get("format") if isinstance(text, str) else None
    if fmt == HYBRID_FORMAT:
        return HybridSnapshot.load(path)
    return Snapshot.from_bytes(data, str(path))

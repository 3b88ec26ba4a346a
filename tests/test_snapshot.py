"""Sequence snapshots on a tiny history-sensitive model whose attention runs in the C++
kernels (head_dim 16, float32): restore then decode gives the uninterrupted logits bit for
bit, every codec, wherever the cells land; a snapshot of a restored sequence is the same
bytes; mismatched, full and corrupt restores raise typed errors and change nothing (200
seeded corruptions of a saved file). Real-model and cross-process checks:
``tests/models/test_snapshot_smollm2.py``."""

from __future__ import annotations

import copy
import json
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.errors import (
    CacheFullError,
    InvalidArgumentError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotMismatchError,
    SnapshotVersionError,
)
from kvcache.models.llama import Llama
from kvcache.snapshot import Snapshot
from tiny_models import TINY, history_llama

CODECS = ["fp32", "fp16", "int8", "int4", "kivi4", "turbo4", "int8/int4", "kivi2", "turbo3"]
PROMPT = 190  # prefill, then DECODED decode steps: beyond every codec's 128-row fp16 window
DECODED = 9
AFTER = 40  # steps decoded after the restore (crosses seal boundaries of 32 and 64 rows)


@pytest.fixture(scope="module")
def model() -> Llama:
    return history_llama(replace(TINY, head_dim=16), seed=3, dtype=torch.float32)


def tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(
        0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def prefill(model: Llama, cache: CausalCache, seq: int, toks: list[int], start: int = 0) -> None:
    model.forward(toks, Batch.single(seq, start, len(toks)), cache, outputs=[len(toks) - 1])


def decode(model: Llama, cache: CausalCache, seq: int, toks: list[int], start: int) -> torch.Tensor:
    """Logits [len(toks), V] of feeding ``toks`` one step at a time from ``start``."""
    rows = [model.forward([t], Batch.single(seq, start + i, 1), cache) for i, t in enumerate(toks)]
    return torch.cat(rows)


def filled(model: Llama, codec: str, capacity: int = 512) -> CausalCache:
    """A cache holding sequence 0: PROMPT tokens prefilled, DECODED decoded."""
    cache = model.new_cache(capacity, max_sequences=4, codec=codec)
    toks = tokens(PROMPT + DECODED)
    prefill(model, cache, 0, toks[:PROMPT])
    decode(model, cache, 0, toks[PROMPT:], PROMPT)
    return cache


def crowded(model: Llama, codec: str, capacity: int = 512) -> CausalCache:
    """A cache whose low cells are taken by two other sequences, with holes between them."""
    cache = model.new_cache(capacity, max_sequences=4, codec=codec)
    prefill(model, cache, 1, tokens(37, seed=2))
    prefill(model, cache, 2, tokens(21, seed=3))
    cache.remove(1, 30)  # frees cells 30..36: the restore fills them first
    return cache


def observable(cache: CausalCache) -> tuple[object, ...]:
    """What a caller can see of the cache: sequences, their cells and positions, free cells,
    allocated bytes."""
    seqs = cache.sequences()
    return (
        seqs,
        {s: cache.positions(s) for s in seqs},
        {s: cache.cells_of(s).tolist() for s in seqs},
        cache.free_cells(),
        cache.memory_usage_bytes(),
    )


def next_logits(model: Llama, cache: CausalCache, seq: int = 1) -> torch.Tensor:
    """Logits of one more decode step of ``seq`` on a copy of the cache (the cache keeps its state)."""
    probe = copy.deepcopy(cache)
    return decode(model, probe, seq, [5, 6], probe.next_position(seq))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("through_file", [False, True])
def test_restore_then_decode_is_bit_identical(
    model: Llama, codec: str, through_file: bool, tmp_path: Path
):
    source = filled(model, codec)
    snap = source.snapshot(0, model_id=model.model_id)
    if through_file:
        snap.save(tmp_path / "s.safetensors")
        snap = Snapshot.load(tmp_path / "s.safetensors")
    after = tokens(AFTER, seed=9)
    want = decode(model, source, 0, after, PROMPT + DECODED)  # the uninterrupted sequence

    target = crowded(model, codec)
    target.restore(snap, 7, model_id=model.model_id)
    assert target.positions(7) == list(range(PROMPT + DECODED))
    assert target.cells_of(7).tolist() != source.cells_of(0).tolist()[: len(snap)]  # moved
    got = decode(model, target, 7, after, PROMPT + DECODED)
    assert torch.equal(got, want), f"{codec}: max diff {(got - want).abs().max()}"
    for w in target.storage.windows.values():
        w.check(target.cells)
    target.cells.check()


@pytest.mark.parametrize("codec", ["int4", "turbo4", "kivi4", "int8"])
def test_snapshot_of_a_restored_sequence_is_the_same_bytes(model: Llama, codec: str):
    """Restoring re-encodes nothing: snapshotting the restored sequence gives the same tensors."""
    snap = filled(model, codec).snapshot(0, model_id="m", tokens=tokens(PROMPT + DECODED))
    target = crowded(model, codec)
    target.restore(snap, 3, model_id="m")
    again = target.snapshot(3, model_id="m", tokens=snap.tokens)
    assert again.header == snap.header
    assert sorted(again.tensors) == sorted(snap.tensors)
    for name, t in snap.tensors.items():
        assert torch.equal(again.tensors[name], t), name
    assert any(".record." in n for n in snap.tensors) == (codec != "int8")


def test_positions_after_a_middle_remove_are_kept(model: Llama):
    """A sequence whose middle was removed (keys re-rotated, positions moved down) restores
    with its new positions and decodes as the original does."""
    for codec in ("int4", "turbo4"):
        source = filled(model, codec)
        source.remove(0, 10, 30)
        snap = source.snapshot(0, model_id="m")
        assert snap.positions == list(range(PROMPT + DECODED - 20))
        after = tokens(5, seed=4)
        want = decode(model, source, 0, after, PROMPT + DECODED - 20)
        target = crowded(model, codec)
        target.restore(snap, 0, model_id="m")
        assert torch.equal(decode(model, target, 0, after, PROMPT + DECODED - 20), want)


def test_snapshot_holds_the_codec_bytes(model: Llama):
    """int4 keys: sealed rows' codes/scales/mins and the window's fp16 rows, nothing more."""
    cache = filled(model, "int4")
    snap = cache.snapshot(0)
    n = PROMPT + DECODED
    opened = int(snap.tensors["window.key.open"].sum())
    assert 128 <= opened < 128 + 32
    heads, dim = TINY.num_kv_heads, 16
    codes = snap.tensors["layer.0.key.codes"]
    assert codes.shape == (n - opened, heads, dim // 2) and codes.dtype == torch.uint8
    assert snap.tensors["layer.0.key.residual"].shape == (opened, heads, dim)
    assert snap.tensors["layer.0.key.record.centre"].shape == (1, heads, dim)
    sealed = cache.cells_of(0)[: n - opened]
    stored = cache.storage.layers[0].keys.codes[torch.from_numpy(sealed)]  # type: ignore[attr-defined]
    assert torch.equal(codes, stored)


# ---- refusals: typed errors, nothing changed ---------------------------------------------
def other_model_cache(model: Llama) -> tuple[CausalCache, str]:
    other = history_llama(replace(TINY, head_dim=16, num_kv_heads=1), seed=5, dtype=torch.float32)
    cache = other.new_cache(512, max_sequences=4, codec="int4")
    prefill(other, cache, 1, tokens(20))
    return cache, other.model_id


@pytest.mark.parametrize(
    "change",
    ["codec", "value codec", "model", "key_rope", "layer shapes", "window", "codec option"],
)
def test_mismatched_restore_is_refused(model: Llama, change: str):
    snap = filled(model, "int4").snapshot(0, model_id=model.model_id)
    model_id = model.model_id
    if change == "layer shapes":
        target, _ = other_model_cache(model)  # same model id claimed, other K/V shapes
    else:
        kwargs: dict[str, object] = {"codec": "int4"}
        kwargs.update(
            {
                "codec": {"codec": "int8"},
                "value codec": {"codec": "int4/int8"},
                "codec option": {"codec": "int4:recent=64"},
                "key_rope": {"key_rope": "pre"},
                "window": {"window": 64},
            }.get(change, {})
        )
        target = CausalCache(512, max_sequences=4, shift=model.rope, **kwargs)  # type: ignore[arg-type]
        prefill(model, target, 1, tokens(20))
        model_id = "another model" if change == "model" else model_id
    before, logits = (
        observable(target),
        next_logits(model, target) if change != "layer shapes" else None,
    )
    with pytest.raises(SnapshotMismatchError):
        target.restore(snap, 0, model_id=model_id)
    assert observable(target) == before
    if logits is not None:
        assert torch.equal(next_logits(model, target), logits)


def test_caches_of_another_model_refuse_by_default(model: Llama):
    """new_cache stamps the model's id: no model_id argument is needed to be refused."""
    snap = filled(model, "int4").snapshot(0)
    assert snap.model_id == model.model_id
    twin = history_llama(replace(TINY, head_dim=16), seed=4, dtype=torch.float32)  # same shapes
    target = twin.new_cache(512, max_sequences=4, codec="int4")
    before = observable(target)
    with pytest.raises(SnapshotMismatchError):
        target.restore(snap, 0)
    assert observable(target) == before
    model.new_cache(512, max_sequences=4, codec="int4").restore(snap, 0)  # its own model: fine


def test_restore_into_a_full_cache_raises_cache_full(model: Llama):
    snap = filled(model, "turbo4").snapshot(0)
    target = crowded(model, "turbo4", capacity=64)  # 4 sequences x 64 cells, 51 used
    prefill(model, target, 3, tokens(100, seed=7))
    before, logits = observable(target), next_logits(model, target)
    with pytest.raises(CacheFullError):
        target.restore(snap, 0)
    assert observable(target) == before
    assert torch.equal(next_logits(model, target), logits)


def test_restore_into_a_sequence_with_cells_is_refused(model: Llama):
    snap = filled(model, "int8").snapshot(0)
    target = crowded(model, "int8")
    before = observable(target)
    with pytest.raises(InvalidArgumentError, match="seq"):
        target.restore(snap, 1)
    assert observable(target) == before
    with pytest.raises(InvalidArgumentError, match="seq"):
        target.snapshot(9)  # holds nothing


# ---- 200 corruptions -----------------------------------------------------------------------
def _split(data: bytes) -> tuple[dict[str, object], bytes]:
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def _join(header: dict[str, object], body: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def header_edit(data: bytes, rng: np.random.Generator) -> bytes:
    """An edit of the safetensors header JSON, the SHA-256 left as it was."""
    header, body = _split(data)
    meta = header["__metadata__"]
    assert isinstance(meta, dict)
    names = sorted(k for k in header if k != "__metadata__")
    name = names[int(rng.integers(len(names)))]
    entry = header[name]
    assert isinstance(entry, dict)
    ours = json.loads(meta["kvcache.snapshot"])
    kind = int(rng.integers(9))
    if kind == 0:
        entry["dtype"] = {"U8": "I8", "I8": "U8"}.get(entry["dtype"], "U8")
    elif kind == 1:
        entry["shape"] = [entry["shape"][0] + 1, *entry["shape"][1:]] if entry["shape"] else [1]
    elif kind == 2:
        a, b = entry["data_offsets"]
        entry["data_offsets"] = [a, b + 1]
    elif kind == 3:
        header[name + "x"] = header.pop(name)
    elif kind == 4:
        del header[name]
    elif kind == 5:
        meta.pop("sha256")
    elif kind == 6:
        meta["sha256"] = meta["sha256"][::-1]
    else:
        key = ["cells", "model_id", "version", "key_rope", "layers", "window"][int(rng.integers(6))]
        ours[key] = {"cells": ours["cells"] + 1, "version": 2, "window": 4}.get(key, "other")
        meta["kvcache.snapshot"] = json.dumps(ours, sort_keys=True)
    return _join(header, body)


def forged(snap: Snapshot, rng: np.random.Generator, path: Path) -> bytes:
    """A file with a correct SHA-256 whose contents no cache can hold as they are."""
    header = copy.deepcopy(snap.header)
    tensors = dict(snap.tensors)
    kind = int(rng.integers(12))
    if kind == 0:
        header["cells"] += 1
    elif kind == 1:
        header["version"] = 2
    elif kind == 2:
        header["codecs"]["key"]["name"] = "'int8'"
    elif kind == 3:
        header["layers"].pop("1")
    elif kind == 4:
        header["layers"]["0"] = [[2, 8], [2, 16]]
    elif kind == 5:
        p = tensors["positions"].clone()
        p[3] = p[2]
        tensors["positions"] = p
    elif kind == 6:
        o = tensors["window.key.open"].clone()
        o[-1] = 2
        tensors["window.key.open"] = o
    elif kind == 7:
        r = tensors["window.key.record"].clone()
        r[0] = 5
        tensors["window.key.record"] = r
    elif kind == 8:
        tensors.pop("layer.1.value.codes")
    elif kind == 9:
        tensors["layer.0.key.extra"] = torch.zeros(3)
    elif kind == 10:
        tensors["layer.0.key.residual"] = tensors["layer.0.key.residual"][1:].clone()
    else:
        tensors["layer.0.value.scale"] = tensors["layer.0.value.scale"].float()
    Snapshot(header, tensors).save(path)
    return path.read_bytes()


def test_200_corruptions_are_refused_and_change_nothing(model: Llama, tmp_path: Path):
    snap = filled(model, "int4").snapshot(0, model_id=model.model_id)
    path = tmp_path / "good.safetensors"
    snap.save(path)
    good = path.read_bytes()
    others = []  # valid files of another model and of other codecs
    other_cache, other_id = other_model_cache(model)
    others.append(other_cache.snapshot(1, model_id=other_id))
    for codec in ("int8", "turbo4", "int4:recent=64"):
        others.append(filled(model, codec).snapshot(0, model_id=model.model_id))
    other_files = []
    for i, o in enumerate(others):
        o.save(tmp_path / f"other{i}.safetensors")
        other_files.append((tmp_path / f"other{i}.safetensors").read_bytes())

    target = crowded(model, "int4")
    before, logits = observable(target), next_logits(model, target)
    rng = np.random.default_rng(12)
    seen: dict[str, int] = {}
    for i in range(200):
        kind = ["truncate", "flip", "header", "forged", "other"][i % 5]
        if kind == "truncate":
            bad = good[: int(rng.integers(len(good)))]
        elif kind == "flip":
            at = int(rng.integers(len(good)))
            bad = good[:at] + bytes([good[at] ^ (1 << int(rng.integers(8)))]) + good[at + 1 :]
        elif kind == "header":
            bad = header_edit(good, rng)
        elif kind == "forged":
            bad = forged(snap, rng, tmp_path / "forged.safetensors")
        else:
            bad = other_files[i // 5 % len(other_files)]
        assert bad != good
        case = tmp_path / "case.safetensors"
        case.write_bytes(bad)
        with pytest.raises(SnapshotError) as caught:
            target.restore(Snapshot.load(case), 0, model_id=model.model_id)
        name = type(caught.value).__name__
        seen[name] = seen.get(name, 0) + 1
        assert observable(target) == before, f"case {i} ({kind}) changed the cache"
        if i % 20 == 0:
            assert torch.equal(next_logits(model, target), logits), f"case {i} ({kind})"
    assert torch.equal(next_logits(model, target), logits)
    assert set(seen) == {"SnapshotCorruptError", "SnapshotVersionError", "SnapshotMismatchError"}
    target.restore(Snapshot.load(path), 0, model_id=model.model_id)  # the good file still works
    assert target.positions(0) == snap.positions


def test_load_errors_are_typed(tmp_path: Path):
    path = tmp_path / "x"
    path.write_bytes(b"")
    with pytest.raises(SnapshotCorruptError):
        Snapshot.load(path)
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(SnapshotCorruptError):
        Snapshot.load(path)
    assert issubclass(SnapshotVersionError, SnapshotError)
    assert issubclass(SnapshotError, ValueError)


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "kivi4", "turbo4", "int8/int4"])
def test_head_is_restore_then_remove(model: Llama, codec: str):
    """A snapshot's first k cells restore to what restoring all of them and removing the
    rest leaves: the same bytes, the same next logits (k cuts kivi groups and windows)."""
    snap = filled(model, codec).snapshot(0, model_id="m", tokens=tokens(PROMPT + DECODED))
    for k in (1, 70, 150, PROMPT + DECODED):
        cut = model.new_cache(512, max_sequences=4, codec=codec)
        cut.restore(snap.head(k), 0, model_id="m")
        whole = model.new_cache(512, max_sequences=4, codec=codec)
        whole.restore(snap, 0, model_id="m")
        whole.remove(0, k)
        a, b = cut.snapshot(0), whole.snapshot(0)
        assert sorted(a.tensors) == sorted(b.tensors)
        for name, t in a.tensors.items():
            assert torch.equal(b.tensors[name], t), (k, name)
        assert snap.head(k).tokens == snap.tokens[:k]  # type: ignore[index]
        after = tokens(3, seed=11)
        assert torch.equal(decode(model, cut, 0, after, k), decode(model, whole, 0, after, k))
    with pytest.raises(InvalidArgumentError, match="count"):
        snap.head(0)


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "kivi4", "turbo4", "int8/int4"])
def test_window_before_keeps_only_the_window_a_resume_needs(model: Llama, codec: str):
    """A window cache's snapshot taken right after a 190-token forward (a checkpoint: more
    cells than the window) cut to the window before p: at most ``window`` cells, the ones at
    positions p - window .. p - 1, and decoding from p on it gives the logits of a restore
    of every cell before p, bit for bit (cuts through kivi groups, seals and fp16 rows)."""
    window = 64
    source = model.new_cache(512, max_sequences=2, max_batch=PROMPT, window=window, codec=codec)
    toks = tokens(PROMPT)
    prefill(model, source, 0, toks)
    snap = source.snapshot(0, model_id="m", tokens=toks)
    assert len(snap) == PROMPT  # the forward's tokens are all still there
    for p in (window + 1, 100, 150, PROMPT):
        cut = snap.window_before(p)
        assert cut.positions == list(range(p - window, p)), p
        assert cut.tokens == toks[p - window : p]
        a = model.new_cache(512, max_sequences=2, window=window, codec=codec)
        a.restore(cut, 0, model_id="m")
        b = model.new_cache(512, max_sequences=2, window=window, codec=codec)
        b.restore(snap.head_before(p), 0, model_id="m")
        after = tokens(3, seed=12)
        assert torch.equal(decode(model, a, 0, after, p), decode(model, b, 0, after, p)), p
    assert snap.window_before(PROMPT + 5).positions == list(range(PROMPT + 5 - window, PROMPT))

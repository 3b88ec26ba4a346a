"""``CausalCache.evict`` (what a press calls) keeps the cell cache's contract, for every codec
with histories beyond every fp16 window: survivors unchanged, masks = the kept set, freed
cells reused by other sequences, ``copy_prefix`` cells kept alive, ``remove`` / context
shift / window eviction after a press, compaction's re-rotation, atomic failures, bytes held,
specs, and decode-time pressing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.errors import InvalidArgumentError, NotSupportedError
from kvcache.kernels import grouped_attention
from kvcache.models.llama import Llama
from kvcache.models.rope import Rope
from kvcache.press import PRESSES, make_press, total_compression
from support import scoring_query

H, G, D, LAYERS = 3, 3, 64, 2
ROPE = Rope(D, 10000.0)
CODECS = ["fp32", "fp16", "bf16", "int8", "int4", "kivi4", "turbo4", "int8/int4"]
REL = 1e-5  # kernels in float32 vs the float64 reference over the same decoded codes (and the
# query the cache scores with: support.scoring_query)


class Driver:
    """Forwards of random q/k/v through ``attention``, each checked against the reference
    (float64 softmax over ``get``'s decoded K/V and mask)."""

    def __init__(self, cache: CausalCache, seed: int = 0) -> None:
        self.cache = cache
        self.g = torch.Generator().manual_seed(seed)
        self.worst = 0.0

    def forward(self, positions: list[int], seqs: list[int]) -> None:
        self.cache.start_forward(Batch(positions, seqs))
        t = len(positions)
        for layer in range(LAYERS):
            q = torch.randn(t, H * G, D, generator=self.g)
            k = torch.randn(t, H, D, generator=self.g)
            k[..., 3] += 5.0
            v = torch.randn(t, H, D, generator=self.g)
            out = self.cache.attention(layer, q, k, v)
            keys, values, mask = self.cache.get(layer)
            qs = scoring_query(self.cache, q, D**-0.5).double()
            ref = grouped_attention(qs, keys.double(), values.double(), mask, D**-0.5)
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            self.worst = max(self.worst, err)

    def prompt(self, seq: int, n: int, chunk: int = 160) -> None:
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            self.forward(list(range(a, b)), [seq] * (b - a))


def visible(cache: CausalCache, row: int) -> set[int]:
    """Positions row ``row`` of the forward in progress may attend, from get()'s mask."""
    lo, _ = cache.plan.history()
    mask = cache.plan.mask()[row].numpy()
    return {int(cache.cells.pos[lo + j]) for j in np.flatnonzero(mask)}


def check_books(cache: CausalCache) -> None:
    cache.cells.check()
    for w in cache.storage.windows.values():
        w.check(cache.cells)


def snapshot(cache: CausalCache) -> tuple:
    c = cache.cells
    wins = [
        (w.open.copy(), w.slot_of.copy(), w.meta_of.copy()) for w in cache.storage.windows.values()
    ]
    return (c.pos.copy(), c.refs.copy(), c.member.copy(), dict(c.ranges), wins)


def same(a: tuple, b: tuple) -> bool:
    arrays_a, arrays_b = (a[0], a[1], a[2]), (b[0], b[1], b[2])
    if not all(np.array_equal(x, y) for x, y in zip(arrays_a, arrays_b, strict=True)):
        return False
    wins = all(
        all(np.array_equal(x, y) for x, y in zip(wa, wb, strict=True))
        for wa, wb in zip(a[4], b[4], strict=True)
    )
    return a[3] == b[3] and wins


@pytest.mark.parametrize("codec", CODECS)
def test_evict_keeps_survivors_masks_and_reuses_cells(codec: str) -> None:
    cache = CausalCache(1024, max_sequences=3, shift=ROPE, codec=codec)
    run = Driver(cache)
    run.prompt(0, 300)
    cells = cache.cells_of(0)
    before = {layer: cache.read(layer, torch.from_numpy(cells)) for layer in range(LAYERS)}
    held = cache.held_bytes(0)
    rng = np.random.default_rng(1)
    drop = np.sort(rng.choice(300, 150, replace=False))  # sealed rows and window rows
    kept = sorted(set(range(300)) - set(drop.tolist()))
    free_before = cache.free_cells()
    assert cache.evict(0, drop) == 150
    check_books(cache)
    assert cache.positions(0) == kept
    assert cache.free_cells() == free_before + 150
    assert cache.held_bytes(0) < held
    survivors = cells[np.array(kept)]
    for layer in range(LAYERS):  # eviction changes no survivor's codes
        k, v = cache.read(layer, torch.from_numpy(survivors))
        assert torch.equal(k, before[layer][0][np.array(kept)])
        assert torch.equal(v, before[layer][1][np.array(kept)])
    run.prompt(1, 150)  # another sequence takes exactly the freed cells (the lowest free)
    assert set(cache.cells_of(1).tolist()) == set(cells[drop].tolist())
    for step in range(40):  # decode past a seal batch: windows seal around the gaps
        run.forward([300 + step, 150 + step], [0, 1])
        assert visible(cache, 0) == set(kept) | set(range(300, 301 + step))
        assert visible(cache, 1) == set(range(151 + step))
    check_books(cache)
    assert run.worst < REL, (codec, run.worst)


def test_copy_prefix_cells_stay_alive_for_the_other_sequence() -> None:
    cache = CausalCache(1024, max_sequences=2, shift=ROPE, codec="int4")
    run = Driver(cache)
    run.prompt(0, 200)
    cache.copy_prefix(0, 1, 200)
    run.forward([200], [1])
    held1 = cache.held_bytes(1)
    assert cache.evict(0, list(range(10, 110))) == 0  # shared: nothing goes back to the pool
    assert cache.positions(1) == list(range(201))
    assert cache.held_bytes(1) == held1
    run.forward([200, 201], [0, 1])
    assert visible(cache, 0) == set(range(10)) | set(range(110, 201))
    assert visible(cache, 1) == set(range(202))
    assert cache.evict(1, list(range(10, 110))) == 100  # now nobody holds them
    check_books(cache)
    assert run.worst < REL


@pytest.mark.parametrize("codec", ["fp32", "kivi4"])  # keys after / before RoPE
def test_remove_and_context_shift_after_a_press(codec: str) -> None:
    cache = CausalCache(1024, shift=ROPE, codec=codec)
    run = Driver(cache)
    run.prompt(0, 300)
    cache.evict(0, list(range(20, 60, 2)))
    kept = cache.positions(0)
    moved = cache.cells_of(0)[np.array(kept) >= 200]
    old_k = cache.read(0, torch.from_numpy(moved))[0]
    cache.remove(0, 100, 200)  # a context shift: 100 positions out, later ones move down
    want = [p for p in kept if p < 100] + [p - 100 for p in kept if p >= 200]
    assert cache.positions(0) == want
    new_k = cache.read(0, torch.from_numpy(moved))[0]
    shifted = ROPE.shift(0, old_k, torch.full((len(moved),), -100))
    torch.testing.assert_close(new_k, shifted, rtol=2e-3, atol=2e-3)
    run.forward([200], [0])
    assert visible(cache, 0) == set(want) | {200}
    check_books(cache)
    assert run.worst < REL


def test_window_eviction_still_holds_after_a_press() -> None:
    cache = CausalCache(256, window=64, memory=96, max_sequences=2, shift=ROPE, codec="int8")
    run = Driver(cache)
    run.prompt(0, 90, chunk=30)
    cache.evict(0, [70, 71, 80])
    for p in range(90, 130):
        run.forward([p], [0])
        stored = cache.positions(0)
        assert min(stored) >= p - 96  # memory still drops the old ones
        assert visible(cache, 0) == {q for q in stored if q >= p - 64}
        assert not {70, 71, 80} & set(stored)
    check_books(cache)
    assert run.worst < REL


@pytest.mark.parametrize("codec", ["fp32", "kivi4"])
def test_compaction_renumbers_and_rerotates(codec: str) -> None:
    cache = CausalCache(1024, shift=ROPE, codec=codec)
    run = Driver(cache)
    run.prompt(0, 200)
    drop = list(range(0, 200, 3))
    kept = [p for p in range(200) if p % 3]
    cells = cache.cells_of(0)[np.array(kept)]
    old = [cache.read(layer, torch.from_numpy(cells))[0] for layer in range(LAYERS)]
    cache.evict(0, drop, compact=True)
    assert cache.positions(0) == list(range(len(kept)))
    assert np.array_equal(cache.cells_of(0), cells)
    offsets = torch.arange(len(kept)) - torch.tensor(kept)
    for layer in range(LAYERS):
        new = cache.read(layer, torch.from_numpy(cells))[0]
        tol = 1e-5 if codec == "fp32" else 2e-3
        torch.testing.assert_close(new, ROPE.shift(layer, old[layer], offsets), rtol=tol, atol=tol)
    run.forward([len(kept)], [0])
    check_books(cache)
    assert run.worst < REL


def test_failed_evictions_change_nothing() -> None:
    cache = CausalCache(512, max_sequences=2, shift=ROPE, codec="kivi4")
    run = Driver(cache)
    run.prompt(0, 200)
    cache.copy_prefix(0, 1, 50)
    before = snapshot(cache)
    bad = ([5, 5], [199, 200], [1.5], [[1, 2]], "ab", [-1])
    for positions in bad:
        with pytest.raises(InvalidArgumentError):
            cache.evict(0, positions)  # type: ignore[arg-type]
        assert same(snapshot(cache), before)
    with pytest.raises(InvalidArgumentError):
        cache.evict(-1, [1])
    with pytest.raises(NotSupportedError, match="shared"):
        cache.evict(0, [10], compact=True)  # cells 11..49 are shared with seq 1: cannot move
    assert same(snapshot(cache), before)
    plain = CausalCache(64)
    plain.start_forward(Batch(list(range(8)), [0] * 8))
    plain.put(0, torch.zeros(8, 1, 2), torch.zeros(8, 1, 2))
    with pytest.raises(NotSupportedError, match="shift"):
        plain.evict(0, [2], compact=True)
    assert plain.positions(0) == list(range(8))
    assert plain.evict(0, [2]) == 1  # mask only needs no shift


def test_held_bytes_counts_rows_windows_and_records() -> None:
    fp32 = CausalCache(512, shift=ROPE)
    Driver(fp32).prompt(0, 100)
    assert fp32.held_bytes(0) == 100 * LAYERS * 2 * H * D * 4
    fp32.evict(0, list(range(40)))
    assert fp32.held_bytes() == 60 * LAYERS * 2 * H * D * 4
    # int8: one byte per value + an fp16 scale per (row, head); rows wait in fp16 until
    # 32 of a sequence can be sealed together (300 = 9 x 32 sealed + 12 open)
    int8 = CausalCache(512, shift=ROPE, codec="int8")
    Driver(int8).prompt(0, 300)
    assert int8.held_bytes(0) == LAYERS * 2 * (288 * H * (D + 2) + 12 * H * D * 2)
    # kivi keys: a group of 64 rows shares one record (fp16 scale + min per channel), held
    # as long as one of its rows is
    kivi = CausalCache(512, shift=ROPE, codec="kivi4")
    Driver(kivi).prompt(0, 300)
    a = kivi.held_bytes(0)
    kivi.evict(0, list(range(63)))
    b = kivi.held_bytes(0)
    kivi.evict(0, [63])
    c = kivi.held_bytes(0)
    assert (b - c) - (a - b) / 63 == pytest.approx(LAYERS * 2 * 2 * H * D)
    assert total_compression(int8, 0) == pytest.approx(
        300 * LAYERS * 2 * H * D * 2 / int8.held_bytes(0)
    )


@pytest.mark.parametrize(
    "spec",
    [
        "nope:0.5",
        "snapkv",
        "snapkv:1",
        "snapkv:1.0",
        "snapkv:-0.1",
        "snapkv:abc",
        "snapkv:nan",
        "snapkv:0.5,window=0",
        "snapkv:0.5,kernel=4",
        "snapkv:0.5,foo=1",
        "snapkv:0.5,window",
        "snapkv:0.5,compact=2",
        "adakv:0.5,inner=adakv",
        "adakv:0.5,alpha=2",
        "adakv:0.5,inner=chunkkv",
        "chunkkv:0.5,inner=adakv",
        "chunkkv:0.5,chunk=0",
        "kvzip:0.5,chunk=0",
        "kvzip:0.5,sinks=-1",
        "kvzip:0.5,inner=knorm",
        "expected:0.5,future=x",
        "snapout:0.5,kernel=5",
        "snapout:0.5,window=0",
    ],
)
def test_bad_specs_get_typed_errors(spec: str) -> None:
    with pytest.raises(InvalidArgumentError, match="press") as err:
        make_press(spec)
    assert isinstance(err.value, ValueError)
    assert spec in str(err.value)


def test_specs_and_registry() -> None:
    assert {"streaming", "snapkv", "knorm", "tova", "expected", "adakv", "chunkkv"} <= set(PRESSES)
    p = make_press("snapkv:0.25,window=32,kernel=7,compact=1")
    assert (p.ratio, p.query_rows, p.kernel, p.compact) == (0.25, 32, 7, True)
    ada = make_press("adakv:0.5,inner=knorm,alpha=0.1")
    assert type(ada.inner).__name__ == "KeyNorm" and ada.query_rows == 0
    chunked = make_press("chunkkv:0.5,inner=snapkv,chunk=8")
    assert (type(chunked.inner).__name__, chunked.query_rows, chunked.chunk) == ("SnapKV", 64, 8)
    zip_ = make_press("chunkkv:0.5,inner=kvzip,chunk=16")
    assert zip_.reconstructs and zip_.inner.chunk == 2048 and zip_.chunk == 16
    assert make_press("kvzip:0.3,chunk=512,sinks=2").chunk == 512
    assert not chunked.reconstructs and chunked.extra_cells(1000) == 0
    assert not chunked.needs_model and zip_.needs_model
    out = make_press("snapout:0.25,window=32")
    assert (out.ratio, out.query_rows, out.needs_model, out.reconstructs) == (0.25, 32, True, False)
    assert make_press("adakv:0.5,inner=snapout").needs_model  # a wrapper binds its inner press


def test_decode_time_pressing_caps_the_cache(history_model: Llama) -> None:
    cache = history_model.new_cache(256)
    dp = make_press("snapkv:0").during_decode(max_cells=40, every=8)
    dp.step(cache, 0)  # starts observing before the prompt
    tokens = np.random.default_rng(0).integers(0, 97, 200).tolist()
    history_model.forward(tokens[:30], Batch(list(range(30)), [0] * 30), cache)
    for p in range(30, 200):
        history_model.forward([tokens[p]], Batch([p], [0]), cache)
        dp.step(cache, 0)
        n = len(cache.cells_of(0))
        assert n <= 40 + 7, (p, n)
        if (p - 29) % 8 == 0 and p > 40:  # every 8th step, once there is more than 40
            assert n == 40
        elif p > 48:  # in between, the cache grows
            assert n > 40
    assert cache.next_position(0) == 200  # mask only: the sequence goes on where it was
    dp.close()
    assert not cache._observers

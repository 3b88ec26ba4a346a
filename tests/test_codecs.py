"""Codecs of the cell cache: round-trip error bounds, honest byte counts, per-sequence fp16
windows and metadata, and the same mask semantics as the float cache through remove /
copy_prefix / window eviction / reused cells / many sequences.

Every lossy check puts data beyond every full-precision window the codec keeps (the newest
128 rows of each sequence, KIVI's partial groups): a test inside the window compares fp16
copies. Bounds come from the codec's step on the data itself: half a quantization step
(of the range the codec must cover) plus the fp16 rounding every row goes through.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.codecs import CODECS, make_codec
from kvcache.codecs.ints import KEY_REFITS, MAX_REFITS
from kvcache.codecs.pack import unpack, unpack4
from kvcache.codecs.window import SHRINK_AFTER
from kvcache.errors import InvalidConfigError
from kvcache.models.rope import Rope
from reference.codec_bounds import FP16, group_step
from support import render

H, D = 3, 64


def outlier_rows(n: int, seed: int = 0) -> torch.Tensor:
    """Rows like real keys: a few channels much larger than the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, D, generator=g)
    x[..., 5] *= 12.0
    x[..., 40] += 6.0
    return x


def rope_like(layer: int, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    ang = offsets.to(keys.dtype)[:, None, None] * 0.1
    half = keys.shape[-1] // 2
    x1, x2 = keys[..., :half], keys[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)


def one_sequence(spec: str, x: torch.Tensor, role: str) -> CausalCache:
    """A cache whose ``role`` codec is ``spec`` (the other fp32) holding rows x as one
    sequence's prompt (positions 0..n-1 in cells 0..n-1)."""
    cache = CausalCache(len(x), **{f"{role}_codec": spec})
    cache.start_forward(Batch.single(0, 0, len(x)))
    cache.put(0, x, x)
    return cache


def roundtrip(spec: str, x: torch.Tensor, role: str = "key") -> torch.Tensor:
    keys, values = one_sequence(spec, x, role).storage.read(0, slice(0, len(x)))
    return keys if role == "key" else values


def buffer(cache: CausalCache, role: str, layer: int = 0):
    st = cache.storage.layers[layer]
    return st.keys if role == "key" else st.values


# ---- round trips -------------------------------------------------------------------------
def test_float_codecs_round_trip():
    x = outlier_rows(64)
    assert torch.equal(roundtrip("fp32", x), x)
    assert torch.allclose(roundtrip("fp16", x), x, rtol=1e-3, atol=1e-4)
    assert torch.allclose(roundtrip("bf16", x), x, rtol=1e-2, atol=1e-3)


def test_int8_error_is_within_half_a_step():
    x = outlier_rows(256)
    xr = x.half().float()  # rows wait in fp16 for their batch, then are encoded
    err = (roundtrip("int8", x) - xr).abs()  # [T, H, D]
    step = xr.abs().amax(-1, keepdim=True) / 127  # [T, H, 1]
    assert (err <= step * 0.5 * 1.01 + 1e-6).all()
    assert err.max() > 0  # it really quantizes


@pytest.mark.parametrize("name, group", [("int4", 32), ("int4g64", 64)])
@pytest.mark.parametrize("role", ["key", "value"])
def test_int4_error_is_within_half_a_step_per_group(name, group, role):
    x = outlier_rows(256)
    got = roundtrip(f"{name}:recent=0", x, role)
    xr = x.half().float()  # rows are rounded to fp16 before they are encoded
    # keys are centred by their sequence's centre: the fp16 mean of its rows at the first seal
    c = xr.mean(0).half().float() if role == "key" else torch.zeros(H, D)
    bound = group_step(xr - c, group, 15) + xr.abs() * FP16 + 1e-4
    assert ((got - xr).abs() <= bound).all()
    assert (got - x).abs().mean() > 1e-3  # it really quantizes


def test_key_centring_cuts_the_error_of_offset_channels():
    x = outlier_rows(256)
    x[..., 7] += 20.0  # a channel with a large common offset, as real keys have
    key_err = (roundtrip("int4:recent=0", x, "key") - x).pow(2).mean()
    value_err = (roundtrip("int4:recent=0", x, "value") - x).pow(2).mean()  # not centred
    assert key_err < value_err / 3


@pytest.mark.parametrize("spec", ["int4", "turbo4"])
def test_each_sequence_has_its_own_key_centre(spec):
    """A pool-wide centre (the first write's mean) would fit only the first sequence."""
    a, b = outlier_rows(300, seed=1), outlier_rows(300, seed=2)
    b[..., 9] += 40.0  # sequence 1's keys sit far from sequence 0's
    cache = CausalCache(600, max_sequences=2, key_codec=spec)
    for seq, x in ((0, a), (1, b)):
        cache.start_forward(Batch.single(seq, 0, 300))
        cache.put(0, x, x)
    keys = cache.storage.read(0, slice(0, 600))[0]
    err_a = (keys[:172] - a[:172]).pow(2).mean()  # sealed rows (the newest 128 stay fp16)
    err_b = (keys[300:472] - b[:172]).pow(2).mean()
    assert err_b < 2 * err_a  # without its own centre, b's offset costs it ~20x the error
    alone = one_sequence(spec, b, "key").storage.read(0, slice(0, 300))[0]
    assert torch.equal(keys[300:600], alone)  # b's codes do not depend on a


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_keys_per_channel_over_64_positions_newest_in_fp16(bits):
    x = outlier_rows(320)  # 3 groups of 64 sealed; the newest 128 stay in fp16
    got = roundtrip(f"kivi{bits}", x, "key")
    assert torch.equal(got[192:], x[192:].half().float())
    xr = x[:192].half().float().reshape(3, 64, H, D)
    err = (got[:192].reshape(3, 64, H, D) - xr).abs()
    step = (xr.amax(1, keepdim=True) - xr.amin(1, keepdim=True)) / (2**bits - 1)
    assert (err <= step * 0.5 * 1.01 + xr.abs() * FP16 + 1e-4).all()  # per channel and group
    assert err.mean() > 1e-3


def test_kivi_values_per_token():
    x = outlier_rows(320)
    got = roundtrip("kivi4", x, "value")
    xr = x[:192].half().float()
    assert ((got[:192] - xr).abs() <= group_step(xr, 64, 15) + xr.abs() * FP16 + 1e-4).all()
    assert torch.equal(got[192:], x[192:].half().float())


@pytest.mark.parametrize(
    "name, role, cosine, row_bytes, norm_rtol",
    [
        ("turbo4", "key", 0.995, 5 * 64 // 8 + 2, 1e-2),  # 5-bit codes + a bf16 norm
        ("turbo4", "value", 0.97, 3 * 64 // 8 + 2, 1e-2),
        ("turbo3", "key", 0.99, 4 * 64 // 8 + 2, 1e-2),
        ("turbo3", "value", 0.92, 2 * 64 // 8 + 1, 0.05),  # a log-coded 1-byte norm
    ],
)
def test_turbo_rows_round_trip_and_bytes(name, role, cosine, row_bytes, norm_rtol):
    x = outlier_rows(200)
    cache = one_sequence(f"{name}:recent=0", x, role)
    got = cache.storage.read(0, slice(0, 200))[0 if role == "key" else 1]
    cos = torch.nn.functional.cosine_similarity(got.reshape(-1, D), x.reshape(-1, D))
    assert cos.mean() > cosine and cos.min() > cosine - 0.06
    # norm-preserving, for keys of the centred rows (the sequence's fp16 mean)
    c = x.half().float().mean(0).half().float() if role == "key" else torch.zeros(H, D)
    assert torch.allclose((got - c).norm(dim=-1), (x - c).norm(dim=-1), rtol=norm_rtol)
    assert make_codec(name, role).bytes_per_row(H, D) == H * row_bytes


# ---- bytes -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, row_bytes",
    [
        ("fp32", H * D * 4),
        ("fp16", H * D * 2),
        ("bf16", H * D * 2),
        ("int8", H * D + H * 2),  # codes + fp16 scale per head
        ("int4", H * D // 2 + H * (D // 32) * 2 * 2),  # nibbles + fp16 scale, min per group
        ("int4g64", H * D // 2 + H * 2 * 2),
        ("kivi4", H * D // 2 + H * 2 * 2),  # values: one scale, min per row and head
    ],
)
def test_bytes_per_row(name, row_bytes):
    assert make_codec(name, "value").bytes_per_row(H, D) == row_bytes


@pytest.mark.parametrize("spec", ["int8", "int4", "kivi4", "turbo4", "int4:recent=0"])
def test_bytes_count_every_tensor_and_codes_only_where_rows_are_sealed(spec):
    x = outlier_rows(1000)
    cache = CausalCache(4096, codec=spec)
    cache.start_forward(Batch.single(0, 0, 1000))
    cache.put(0, x, x)
    total = 0
    for buf in (buffer(cache, "key"), buffer(cache, "value")):
        tensors = {id(v): v for v in vars(buf).values() if isinstance(v, torch.Tensor)}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        if spec != "int8":  # codes cover the sealed cells, not the whole pool of 4096
            windows = buf.windows
            w, b = windows.spec.window, windows.spec.batch  # sealed b rows at a time
            sealed = int((windows.slot_of[:1000] < 0).sum())
            assert sealed == (1000 - w) // b * b  # 864 (kivi keys: 832 = 13 x 64)
            assert sealed <= buf.rows <= sealed * 1.25 + 64
            assert windows.slots == 1000 - sealed  # the window rows: 128 (kivi keys 168)
            assert windows.slots <= buf.residual.shape[0] < windows.slots + 16
    maps = sum(w.slot_of.nbytes + w.meta_of.nbytes for w in cache.storage.windows.values())
    assert cache.memory_usage_bytes() == total + maps


def test_the_window_keeps_its_rows_while_sequences_decode_together():
    """Sequences decoding together seal their waiting rows at the same step (int8: 32 of a
    sequence at once), so the window empties and fills again every 32 steps. It keeps its
    rows through those lows (shrinking at each and growing back reallocated it most steps),
    and shrinks to the rows in use once under half of it has been used for SHRINK_AFTER
    stores in a row."""
    seqs, prompt = 4, 64
    cache = CausalCache(4096, max_sequences=seqs, codec="int8")
    g = torch.Generator().manual_seed(0)
    for s in range(seqs):
        cache.start_forward(Batch.single(s, 0, prompt))
        cache.put(0, *torch.randn(2, prompt, H, D, generator=g))
    buf = buffer(cache, "key")
    window, reallocated, peak = buf.residual, 0, 0
    for step in range(96):  # three seal batches
        cache.start_forward(Batch([prompt + step] * seqs, list(range(seqs))))
        cache.put(0, *torch.randn(2, seqs, H, D, generator=g))
        assert buf.windows.slots <= buf.residual.shape[0]
        peak = max(peak, buf.windows.slots)
        if step >= 32:  # grown in the first batch
            reallocated += buf.residual is not window
        window = buf.residual
    assert peak == 31 * seqs  # 31 rows of each sequence wait before 32 are sealed
    assert reallocated == 0 and buf.residual.shape[0] >= peak
    for s in range(1, seqs):
        cache.remove(s, 0)
    pos = prompt + 96
    for step in range(SHRINK_AFTER + 1):  # sequence 0 alone: at most 31 of 124 rows in use
        assert step > 32 or buf.residual.shape[0] >= peak  # a batch later: not shrunk yet
        cache.start_forward(Batch.single(0, pos + step, 1))
        cache.put(0, *torch.randn(2, 1, H, D, generator=g))
    assert buf.windows.slots <= buf.residual.shape[0] < peak // 2


@pytest.mark.parametrize("spec", ["int4", "kivi4", "turbo4", "turbo3"])
def test_a_short_context_costs_no_more_than_fp16(spec):
    """79 tokens fit in the window: the window holds them, no codes exist yet (the pool-wide
    window plus codes for every cell cost turbo4 2.2 MiB against fp16's 1.75 MiB)."""

    def held(codec: str) -> int:
        cache = CausalCache(79, codec=codec)
        cache.start_forward(Batch.single(0, 0, 79))
        for layer in range(30):
            cache.put(layer, outlier_rows(79, seed=layer), outlier_rows(79, seed=layer + 99))
        return cache.memory_usage_bytes()

    maps = 79 * 8 * 2  # a slot and a metadata map (int32 per cell) for K's and V's windows
    assert held(spec) <= held("fp16") + maps


def test_turbo_split_keeps_the_average_bits_and_the_even_split_is_an_option():
    def bits(spec: str) -> float:  # bits per stored K+V value of one sealed cell
        k, v = make_codec(spec, "key"), make_codec(spec, "value")
        return (k.bytes_per_row(H, D) + v.bytes_per_row(H, D)) * 8 / (2 * H * D)

    assert bits("turbo4") == bits("turbo4:key_bits=4,value_bits=4") == 4.25
    assert bits("turbo3") <= 3.2  # 1/5 of fp16's 16 bits
    with pytest.raises(InvalidConfigError, match="key_bits"):
        make_codec("turbo4:key_bits=9", "key")


# ---- windows per sequence ----------------------------------------------------------------
@pytest.mark.parametrize("spec", ["int4", "turbo4", "kivi4"])
def test_each_decoding_sequence_keeps_its_newest_rows_in_fp16(spec):
    """16 sequences decoding together: each keeps its own newest 128 rows (a pool-wide window
    of 128 rows would leave each 8)."""
    n_seq, prompt, steps = 16, 100, 60
    cache = CausalCache(prompt + steps, max_sequences=n_seq, value_codec=spec)
    rows: dict[int, list[torch.Tensor]] = {s: [] for s in range(n_seq)}
    for s in range(n_seq):
        x = outlier_rows(prompt, seed=s)
        cache.start_forward(Batch.single(s, 0, prompt))
        cache.put(0, x, x)
        rows[s].extend(x)
    for step in range(steps):  # one token of every sequence per forward: cells interleave
        x = outlier_rows(n_seq, seed=1000 + step)
        cache.start_forward(Batch([prompt + step] * n_seq, list(range(n_seq))))
        cache.put(0, x, x)
        for s in range(n_seq):
            rows[s].append(x[s])
    for s in range(n_seq):
        cells = torch.from_numpy(cache.cells_of(s))
        got = cache.read(0, cells)[1]  # values by position
        want = torch.stack(rows[s])
        newest = slice(len(want) - 128, None)
        assert torch.equal(got[newest], want[newest].half().float())
        assert (got[:32] - want[:32]).abs().max() > 1e-2  # the oldest are codes
    windows = cache.storage.windows[cache.value_codec.spec]
    assert int((windows.slot_of >= 0).sum()) == n_seq * 128  # 160 rows: 32 sealed each
    assert windows.slots <= n_seq * (128 + windows.spec.batch)


def test_kivi_groups_are_64_positions_of_one_sequence():
    cache = CausalCache(400, max_sequences=2, key_codec="kivi4")
    for step in range(400):  # two sequences writing alternately: their cells interleave
        cache.start_forward(Batch.single(step % 2, step // 2, 1))
        x = outlier_rows(1, seed=step)
        cache.put(0, x, x)
    windows = cache.storage.windows[cache.key_codec.spec]
    for s in (0, 1):
        cells = cache.cells_of(s)
        meta = windows.meta_of[cells]
        sealed = meta[meta >= 0]
        assert len(sealed) == 64  # 200 positions: one group sealed, 136 still in the window
        assert set(sealed.tolist()) == {sealed[0]} and np.all(meta[:64] == sealed[0])
    assert windows.meta_of[cache.cells_of(0)][0] != windows.meta_of[cache.cells_of(1)][0]


# ---- the cache's semantics with codecs, histories beyond every window -------------------
N_PROMPT = 300
MOVED = range(90, N_PROMPT)  # cells of sequence 0 that a middle remove moves (re-rotates)


def run_scenario(cache: CausalCache) -> list[tuple[list[str], slice]]:
    """Two long sequences, a middle removal with shifting, a fork, a finished sequence whose
    cells a third reuses, then all decoding together. Returns (mask, history range) after
    each forward; the stored rows are compared after the run."""
    out = []
    n = N_PROMPT

    def fwd(positions, seqs):
        cache.start_forward(Batch(positions, seqs))
        g = torch.Generator().manual_seed(sum(positions) + 7 * len(seqs))
        x = torch.randn(len(positions), H, D, generator=g)
        x[..., 5] *= 8.0  # an outlier channel
        x[..., 40] += 4.0
        _, _, mask = cache.update(0, x, x.flip(-1))
        lo, hi = cache.plan.history()
        out.append((render(mask), slice(lo, hi)))

    fwd(list(range(n)), [0] * n)
    fwd(list(range(n)), [1] * n)
    cache.remove(0, 10, 90)  # moves positions 90..n of seq 0 down by 80 (keys re-rotated)
    cache.copy_prefix(0, 2, n - 100)
    fwd([n - 80, n - 100, n], [0, 2, 1])
    cache.remove(1, 0)  # sequence 1 finished: its cells are free, sequence 3 reuses them
    fwd(list(range(40)), [3] * 40)
    for p in range(5):
        fwd([n - 79 + p, n - 99 + p, 40 + p], [0, 2, 3])
    return out


def half_steps(cache: CausalCache, role: str, ref: torch.Tensor, cells: np.ndarray):
    """Per-element error bound [n, H, D] of the rows stored in ``cells`` (the exact rows:
    ``ref``): half the step of the range the codec quantizes them over, which its metadata
    says (which rows form a KIVI group, which centre a sequence's keys use)."""
    name = (cache.key_codec if role == "key" else cache.value_codec).name.split(":")[0]
    x = ref.half().float()
    fp16 = x.abs().amax(-1, keepdim=True) * FP16 * 2 + 1e-6  # rows go through fp16
    if name in ("fp16",):
        return fp16
    if name == "int8":
        return x.abs().amax(-1, keepdim=True) / 127 * 0.5 * 1.01 + fp16
    buf = buffer(cache, role)
    windows = buf.windows
    open_ = torch.from_numpy(windows.slot_of[cells] >= 0)[:, None, None]
    meta = windows.meta_of[cells]
    if name.startswith("kivi") and role == "key":
        # a group's channel ranges span its 64 rows, some of which a remove may have freed:
        # the step is the one stored (test_kivi_keys_per_channel... checks it against data)
        step = buf.scale[torch.from_numpy(np.maximum(meta, 0)).long()].float()
        return torch.where(open_, fp16, 0.5 * step * 1.01 + x.abs() * FP16 + 1e-4)
    group, levels = (64, 15 if name == "kivi4" else 3) if name.startswith("kivi") else (32, 15)
    if role == "key":  # int4 keys: each row minus its sequence's centre
        centre = buf.centre[torch.from_numpy(np.maximum(meta, 0)).long()].float()
        x = x - torch.where(open_, 0.0, centre)
    bound = group_step(x, group, levels) + ref.abs() * FP16 * 2 + 1e-4
    return torch.where(open_, fp16, bound)


@pytest.mark.parametrize("spec", ["fp16", "int8", "int4", "kivi4", "kivi2", "int4:recent=0"])
def test_compressed_cache_keeps_float_semantics_beyond_the_windows(spec):
    """Every visible row after every forward, in the form the codec stores (keys before RoPE
    for kivi): within half its step, rows re-encoded by a remove's re-rotation within 3."""
    got_cache = CausalCache(700, max_sequences=4, shift=rope_like, codec=spec)
    ref_cache = CausalCache(700, max_sequences=4, shift=rope_like, key_rope=got_cache.key_rope)
    ref, got = run_scenario(ref_cache), run_scenario(got_cache)
    held = np.concatenate([got_cache.cells_of(s) for s in got_cache.sequences()])
    held = np.unique(held)
    rows_r = ref_cache.storage.read(0, torch.from_numpy(held))
    rows_g = got_cache.storage.read(0, torch.from_numpy(held))
    moved = np.isin(held, MOVED) & (got_cache.key_rope == "post")
    coded = 0
    for i, role in enumerate(("key", "value")):
        bound = half_steps(got_cache, role, rows_r[i], held)
        if role == "key":  # re-rotated after a decode: two encodings and a rotation
            bound[torch.from_numpy(moved)] *= 6
        err = (rows_g[i] - rows_r[i]).abs()
        assert (err <= bound).all(), f"{role}: worst {(err / bound).max():.2f} of the bound"
        coded += int((err > rows_r[i].abs() * FP16 * 2 + 1e-5).sum())
    assert spec == "fp16" or coded > 20_000  # the rows beyond the windows really are codes
    for (mask_r, hist_r), (mask_g, hist_g) in zip(ref, got, strict=True):
        assert mask_r == mask_g and hist_r == hist_g


@pytest.mark.parametrize("shift", ["plain", "rotary"])
@pytest.mark.parametrize("spec", ["turbo4", "turbo3"])
def test_turbo_keeps_float_semantics_beyond_the_windows(spec, shift):
    """A plain shift function: keys stored before RoPE; a rotary one (a Rope): keys stored
    after RoPE, centred in its frame, re-encoded by the middle remove."""
    fn = rope_like if shift == "plain" else Rope(D, 10000.0)
    got_cache = CausalCache(700, max_sequences=4, shift=fn, codec=spec)
    assert got_cache.key_rope == ("pre" if shift == "plain" else "post")
    assert (got_cache.storage.frame is None) == (shift == "plain")
    ref_cache = CausalCache(700, max_sequences=4, shift=fn, key_rope=got_cache.key_rope)
    ref, got = run_scenario(ref_cache), run_scenario(got_cache)
    for (mask_r, hist_r), (mask_g, hist_g) in zip(ref, got, strict=True):
        assert mask_r == mask_g and hist_r == hist_g
    held = torch.from_numpy(np.unique(np.concatenate([got_cache.cells_of(s) for s in (0, 2, 3)])))
    cosine = {"turbo4": (0.995, 0.97), "turbo3": (0.98, 0.90)}[spec]
    for i in range(2):  # keys (5 / 4 bits), values (3 / 2 bits)
        a = ref_cache.storage.read(0, held)[i].reshape(-1, D)
        b = got_cache.storage.read(0, held)[i].reshape(-1, D)
        cos = torch.nn.functional.cosine_similarity(a, b)
        assert cos.mean() > cosine[i] and cos.min() > cosine[i] - 0.1
        assert (cos < 0.9999).sum() > 200  # quantized rows


@pytest.mark.parametrize("name", ["int8", "int4", "kivi4", "kivi2", "turbo4", "turbo3"])
def test_window_eviction_with_codec_matches_float(name):
    def run(codec):
        cache = CausalCache(1024, window=200, max_batch=64, codec=codec)
        masks = []
        for start in range(0, 600, 40):
            cache.start_forward(Batch.single(0, start, 40))
            _, _, mask = cache.update(0, torch.randn(40, H, D), torch.randn(40, H, D))
            masks.append(render(mask))
        return masks, cache.positions(0)

    assert run(None) == run(name)


# ---- names, options, formulas ------------------------------------------------------------
def test_unknown_codec_is_a_typed_error():
    with pytest.raises(InvalidConfigError, match="one of"):
        CausalCache(8, codec="int3")
    with pytest.raises(InvalidConfigError, match="key_codec"):
        CausalCache(8, key_codec="nope")
    assert set(CODECS) >= {"fp32", "fp16", "bf16", "int8", "int4"}


def test_key_and_value_codecs_may_differ():
    cache = CausalCache(64, key_codec="int8", value_codec="fp16")
    cache.start_forward(Batch.single(0, 0, 32))  # int8 seals rows 32 at a time
    x = outlier_rows(32)
    keys, values, _ = cache.update(0, x, x)
    assert keys.dtype == values.dtype == torch.float32
    int8_rows = cache.storage.layers[0].keys.rows  # codes allocated for the sealed rows only
    maps = 64 * 8  # the int8 window's slot and metadata maps
    assert cache.memory_usage_bytes() == int8_rows * (H * D + H * 2) + 64 * H * D * 2 + maps
    assert not torch.equal(keys, values[: len(keys)])


def test_window_options():
    assert make_codec("int4:recent=16", "value").name == "int4:recent=16"
    assert make_codec("int4:recent=16", "value").spec.window == 16
    assert make_codec("kivi4:residual=256", "key").spec.window == 256
    for bad in ("int4:recent=x", "int4:window=3", "fp32:recent=1", "int4:recent=-1"):
        with pytest.raises(InvalidConfigError):
            make_codec(bad)


def test_int4_keys_refit_their_ranges_and_values_keep_min_max():
    """The registry: int4's keys get KEY_REFITS least-squares refits, values none, and
    ``refits=N`` sets them (names keep it: prefix namespaces tell the variants apart); a
    refitted key cache decodes its rows closer than a min/max one."""
    assert make_codec("int4", "key").refits == KEY_REFITS > 0
    assert make_codec("int4g64", "key").refits == KEY_REFITS
    assert make_codec("int4", "value").refits == 0
    assert make_codec("kivi4", "value").refits == 0
    zero = make_codec("int4:refits=0", "key")
    assert zero.refits == 0 and zero.name == "int4:refits=0"
    assert make_codec("int4:refits=2", "value").refits == 2
    for bad in ("int4:refits=-1", f"int4:refits={MAX_REFITS + 1}", "int8:refits=1"):
        with pytest.raises(InvalidConfigError):
            make_codec(bad)
    x = outlier_rows(256)
    err = {
        spec: (roundtrip(spec, x) - x).norm()
        for spec in ("int4:recent=0", "int4:recent=0,refits=0")
    }
    assert err["int4:recent=0"] < 0.95 * err["int4:recent=0,refits=0"]


def test_fast_unpack_and_int4_decode_equal_the_plain_formulas():
    b = torch.randint(0, 256, (37, 3, 32), dtype=torch.uint8)
    assert torch.equal(unpack4(b), unpack(b, 4))
    x = outlier_rows(64)  # sealed 32 rows at a time: all of them
    cache = one_sequence("int4:recent=0", x, "value")
    buf = buffer(cache, "value")
    q = unpack(buf.codes[:64], 4).float().reshape(64, H, 2, 32)
    plain = torch.addcmul(buf.low[:64].float()[..., None], q, buf.scale[:64].float()[..., None])
    assert torch.equal(cache.storage.read(0, slice(0, 64))[1], plain.reshape(64, H, D))


def test_key_value_spec_and_variant_names():
    assert make_codec("int8/int4", "key").name == "int8"
    assert make_codec("int8/int4", "value").name == "int4"
    cache = CausalCache(8, codec="int8/kivi4")
    assert (cache.key_codec.name, cache.value_codec.name) == ("int8", "kivi4")
    # variants get their own names: prefix-cache namespaces must tell them apart
    assert make_codec("int4:recent=0").name == "int4:recent=0"
    assert make_codec("turbo3:key_bits=3,value_bits=3").name == "turbo3:key_bits=3,value_bits=3"
    with pytest.raises(InvalidConfigError):
        make_codec("int8/nope", "value")


def test_a_rotary_frame_reuses_its_tables_only_for_the_same_positions() -> None:
    """RotaryFrame keeps the tables of the last positions it rotated by (a seal rotates the
    same rows' centres in every layer); positions moved in place (a remove's shift), another
    sign or another dtype get their own."""
    from kvcache.codecs.base import RotaryFrame

    rope = Rope(64, 100000.0)
    positions = np.arange(100, dtype=np.int64)
    frame = RotaryFrame(positions, rope)
    x = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(13))
    cells = np.array([3, 4, 5, 9])

    def fresh(pos: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return rope.rotate(x.to(dtype), *rope.tables(torch.from_numpy(pos), dtype))

    assert torch.equal(frame.rotate(x, cells), fresh(positions[cells]))
    assert torch.equal(frame.rotate(x, cells), fresh(positions[cells]))  # from the memo
    positions[cells] -= 2  # the cache shifts positions in place
    assert torch.equal(frame.rotate(x, cells), fresh(positions[cells]))
    assert torch.equal(frame.rotate(x, cells, -1), fresh(-positions[cells]))
    half = frame.rotate(x.half(), cells, -1)
    assert half.dtype == torch.float16
    assert torch.equal(half, fresh(-positions[cells], torch.float16))

"""Keys stored before RoPE (``key_rope="pre"``): what callers see is unchanged, what is stored
is the un-rotated key, and a middle remove only moves positions."""

from __future__ import annotations

import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.errors import InvalidArgumentError, InvalidConfigError
from kvcache.models.rope import Rope
from support import render
from test_codecs import D, H, outlier_rows, rope_like


def scenario(cache: CausalCache) -> list[tuple[list[str], torch.Tensor]]:
    """Two sequences, sharing, removal with shifting: (mask, keys) after each forward."""
    out = []

    def fwd(positions, seqs):
        cache.start_forward(Batch(positions, seqs))
        g = torch.Generator().manual_seed(sum(positions) + 7 * len(seqs))
        x = torch.randn(len(positions), H, D, generator=g)
        k, _, mask = cache.update(0, x, x)
        out.append((render(mask), k.clone()))

    fwd(list(range(6)), [0] * 6)
    cache.copy_prefix(0, 1, 4)
    fwd([6, 4, 5], [0, 1, 1])
    cache.remove(1, 0)
    cache.remove(0, 2, 4)  # moves positions 4..6 of seq 0 down by 2 (re-rotated keys)
    fwd([5, 6], [0, 0])
    return out


def test_pre_rope_fp32_gives_the_same_keys_and_masks_as_post():
    post = scenario(CausalCache(32, max_sequences=2, shift=rope_like, key_rope="post"))
    pre_cache = CausalCache(32, max_sequences=2, shift=rope_like, key_rope="pre")
    pre = scenario(pre_cache)
    assert pre_cache.key_rope == "pre"
    for (mask_a, k_a), (mask_b, k_b) in zip(post, pre, strict=True):
        assert mask_a == mask_b
        visible = [r != "x" for r in mask_a[-1].split()]
        assert torch.allclose(k_a[visible], k_b[visible], atol=1e-5)


@pytest.mark.parametrize("name, tol", [("kivi4", 0.6), ("turbo4", 1.5), ("int4", 0.6)])
def test_quantized_pre_rope_keeps_float_semantics(name, tol):
    # windows off: the 7 rows would all stay in fp16 (test_codecs runs long histories)
    spec = {"kivi4": "kivi4:residual=64", "turbo4": "turbo4:recent=0"}.get(name, "int4:recent=0")
    ref = scenario(CausalCache(32, max_sequences=2, shift=rope_like))
    got = scenario(CausalCache(32, max_sequences=2, shift=rope_like, codec=spec, key_rope="pre"))
    for (mask_r, k_r), (mask_g, k_g) in zip(ref, got, strict=True):
        assert mask_r == mask_g
        visible = [r != "x" for r in mask_r[-1].split()]
        assert (k_r[visible] - k_g[visible]).abs().max() < tol


def test_storage_holds_unrotated_keys_and_remove_only_moves_positions():
    cache = CausalCache(16, shift=rope_like, key_rope="pre")
    x = outlier_rows(6)
    cache.start_forward(Batch.single(0, 0, 6))
    cache.update(0, x, x)
    raw = cache.storage.read(0, slice(0, 6))[0]
    assert torch.allclose(raw, rope_like(0, x, -torch.arange(6)), atol=1e-5)
    cache.remove(0, 1, 3)  # positions 3..5 move to 1..3
    assert torch.equal(cache.storage.read(0, slice(0, 6))[0], raw)
    assert cache.positions(0) == [0, 1, 2, 3]
    cells = torch.tensor([0, 3, 4, 5])
    keys, values = cache.read(0, cells)
    # the moved keys read back rotated for their new positions, as a post-RoPE shift gives
    expected = rope_like(0, x[[0, 3, 4, 5]], torch.tensor([0, -2, -2, -2]))
    assert torch.allclose(keys, expected, atol=1e-5)
    assert torch.equal(values, x[[0, 3, 4, 5]])
    assert torch.equal(cache.read_keys(0, cells), keys)  # rotated as read's, values untouched
    assert torch.equal(cache.read_values(0, cells), values)


def test_read_matches_get_and_checks_its_input():
    cache = CausalCache(16, shift=rope_like, codec="kivi4")
    x = outlier_rows(5)
    cache.start_forward(Batch.single(0, 0, 5))
    keys, values, _ = cache.update(0, x, x)
    got_k, got_v = cache.read(0, torch.tensor([4, 1]))
    assert torch.equal(got_k, keys[[4, 1]]) and torch.equal(got_v, values[[4, 1]])
    assert torch.equal(cache.read_keys(0, slice(1, 5)), keys[1:5])
    assert torch.equal(cache.read_values(0, slice(1, 5)), values[1:5])
    for read in (cache.read, cache.read_keys, cache.read_values):
        with pytest.raises(InvalidArgumentError, match="cells"):
            read(0, torch.tensor([16]))
        with pytest.raises(InvalidArgumentError, match="cells"):
            read(0, slice(2, 17))
        with pytest.raises(InvalidArgumentError, match="layer"):
            read(3, torch.tensor([0]))


def test_key_rope_choice_and_errors():
    assert CausalCache(8, shift=rope_like, codec="kivi4").key_rope == "pre"
    assert CausalCache(8, shift=rope_like, codec="turbo4").key_rope == "pre"
    rope = Rope(D, 10000.0)  # a rotary shift: turbo centres keys after RoPE in its frame
    assert CausalCache(8, shift=rope, codec="turbo4").key_rope == "post"
    assert CausalCache(8, shift=rope, codec="turbo4").storage.frame is not None
    assert CausalCache(8, shift=rope, codec="kivi4").key_rope == "pre"
    assert CausalCache(8, shift=rope, codec="turbo4", key_rope="pre").storage.frame is None
    assert CausalCache(8, shift=rope, codec="int4").storage.frame is None
    assert CausalCache(8, shift=rope_like, codec="int4").key_rope == "post"
    assert CausalCache(8, codec="kivi4").key_rope == "post"  # no shift: cannot un-rotate
    assert CausalCache(8, shift=rope_like, codec="kivi4", key_rope="post").key_rope == "post"
    with pytest.raises(InvalidConfigError, match="key_rope"):
        CausalCache(8, codec="kivi4", key_rope="pre")
    with pytest.raises(InvalidConfigError, match="key_rope"):
        CausalCache(8, shift=rope_like, key_rope="sideways")


def test_turbo_keys_after_rope_are_centred_in_the_rotary_frame():
    """With a Rope, turbo keys are stored after RoPE minus their sequence's centre (the mean
    of the un-rotated keys) rotated to each row's position: the centre and the coded rows'
    norms are those keys stored before RoPE give, not those of a rotated offset."""
    n, g = 200, torch.Generator().manual_seed(0)
    rope = Rope(D, 10000.0)
    base = 4.0 * torch.randn(H, D, generator=g)  # what every key shares before RoPE
    unrotated = base + 0.3 * torch.randn(n, H, D, generator=g)
    keys = rope.shift(0, unrotated, torch.arange(n))
    held = {}
    for mode in ("post", "pre"):
        cache = CausalCache(n, shift=rope, codec="turbo4:recent=0", key_rope=mode)
        cache.start_forward(Batch.single(0, 0, n))
        cache.put(0, keys, keys)
        buf = cache.storage.layers[0].keys
        assert (buf.frame is not None) == (mode == "post")
        torch.testing.assert_close(buf.centre[0].float(), unrotated.mean(0), atol=2e-3, rtol=1e-3)
        sealed = int((buf.windows.slot_of[:n] < 0).sum())  # sealed 32 at a time: the first
        assert sealed >= 160
        held[mode] = buf.scale[:sealed, :, 0].float()  # the coded rows' norms
        decoded = cache.read(0, torch.arange(n))[0]
        assert (decoded - keys).abs().max() < 0.25  # 5-bit codes of rows of norm ~2.4
    spread = (unrotated - unrotated.mean(0)).norm(dim=-1)[:sealed]  # [sealed, H]
    assert (held["post"] < 1.1 * spread).all() and (held["post"] > 0.9 * spread).all()
    assert (held["pre"] < 1.1 * spread).all() and (held["pre"] > 0.9 * spread).all()
    assert spread.max() < 0.2 * base.norm(dim=-1).min()  # a centre left unrotated would not do


def test_a_rope_passed_as_its_bound_shift_is_the_rotary_shift():
    """``shift=rope.shift`` is the Rope itself (its tables reach the kernels: keys stored
    before RoPE are rotated there, not on the plain-torch path); other callables stay."""
    from kvcache.models.rope import Rope
    from kvcache.protocol import RotaryShift

    rope = Rope(D, 10000.0)
    for shift in (rope, rope.shift, rope.__call__):
        cache = CausalCache(16, shift=shift, codec="kivi4")
        assert cache.shift is rope and isinstance(cache.shift, RotaryShift)
    assert CausalCache(16, shift=rope_like).shift is rope_like
    other = Rope(D, 500.0)
    assert CausalCache(16, shift=other.tables).shift == other.tables  # not a shift: as given


def _forward_raw_keys(cache: CausalCache, x: torch.Tensor, rotated: bool) -> torch.Tensor:
    """Prefill 40 rows of x [n, H, D] (given before RoPE), then decode the rest one at a
    time, each through ``attention`` with keys rotated by the caller or not; the outputs."""
    rope = Rope(D, 10000.0)
    q = 0.5 * torch.flip(x, dims=(0,)).repeat(1, 2, 1)  # [n, 2H, D]: two query heads a KV head
    outs = []
    for lo, hi in [(0, 40)] + [(p, p + 1) for p in range(40, x.shape[0])]:
        cache.start_forward(Batch.single(0, lo, hi - lo))
        pos = torch.arange(lo, hi)
        k = rope.shift(0, x[lo:hi], pos) if rotated else x[lo:hi]
        qr = rope.shift(0, q[lo:hi], pos)
        outs.append(cache.attention(0, qr, k, x[lo:hi], keys_rotated=rotated))
    return torch.cat(outs)


@pytest.mark.parametrize("spec, key_rope", [("fp32", "pre"), ("fp32", "post"), ("kivi4", "pre")])
def test_keys_given_before_rope_are_stored_and_attended_as_rotated_ones(spec, key_rope):
    """``keys_rotated=False`` (a model asking ``key_rope == "pre"`` skips rotating keys the
    cache would rotate back): a cache storing keys before RoPE holds them exactly as given, one
    storing them after RoPE rotates them itself, and attention equals that of rotated keys."""
    rope, x = Rope(D, 10000.0), outlier_rows(300)  # kivi4: beyond its 128-row window

    def cache() -> CausalCache:
        return CausalCache(320, shift=rope, codec=spec, key_rope=key_rope)

    raw, rotated = cache(), cache()
    got, want = _forward_raw_keys(raw, x, False), _forward_raw_keys(rotated, x, True)
    cells = torch.arange(300)
    stored = raw.storage.read(0, cells)[0]
    if spec == "fp32":
        expected = x if key_rope == "pre" else rope.shift(0, x, cells)
        assert torch.equal(stored, expected)
        # the rotated keys' round trip through the pre cache moves them by ~1e-7 relative
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    else:  # kivi: the same codes but where a rotation round trip moved a row across a level
        assert (stored - rotated.storage.read(0, cells)[0]).abs().max() < 0.05
        assert (got - want).abs().max() < 0.02
    assert raw.memory_usage_bytes() == rotated.memory_usage_bytes()


def test_keys_given_before_rope_need_a_shift_and_a_bool():
    x = outlier_rows(3)
    cache = CausalCache(8)
    cache.start_forward(Batch.single(0, 0, 3))
    with pytest.raises(InvalidArgumentError, match="keys_rotated"):
        cache.attention(0, x, x, x, keys_rotated=False)
    with pytest.raises(InvalidArgumentError, match="keys_rotated"):
        cache.put(0, x, x, keys_rotated=1)  # type: ignore[arg-type]
    assert 0 not in cache.storage.layers  # nothing stored by the refused calls
    cache.put(0, x, x)
    assert torch.equal(cache.get(0)[0], x)

"""The Llama forward through the cell cache equals a no-cache full forward: prefill + decode,
several sequences in one batch, middle removal (RoPE shift), copy_prefix forks, sliding
windows, and the forward's argument errors. The scenarios run on a tiny float64 model
(exact: the plain-torch reference attention) and on a tiny float32 model through the
attention kernels, both their decode kernel and their prompt tile path."""

from __future__ import annotations

import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.errors import DimensionMismatchError, InvalidArgumentError
from kvcache.models.llama import Llama, LlamaConfig
from kvcache.models.rope import Rope

ATOL = 1e-9
KERNEL_ATOL = 2e-5  # float32 logits of O(1): the kernels sum in another order


def tokens(n: int, seed: int, vocab: int = 97) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a - b).abs().max().item()
    assert diff <= atol, f"max abs diff {diff} > {atol}"


def test_prefill_then_decode_equals_full_forward(tiny: Llama):
    ids = tokens(14, seed=1)
    cache = tiny.new_cache(32)
    parts = [tiny.forward(ids[:6], Batch.single(0, 0, 6), cache)]
    for p in range(6, 14):
        parts.append(tiny.forward(ids[p : p + 1], Batch.single(0, p, 1), cache))
    assert_close(torch.cat(parts), tiny.forward_full(ids))


@pytest.mark.parametrize("key_rope", ["pre", "post"])
def test_a_cache_storing_keys_before_rope_is_given_them_so(
    tiny: Llama, key_rope: str, monkeypatch: pytest.MonkeyPatch
):
    """Keys go to a cache that stores them before RoPE unrotated (``keys_rotated=False``: no
    rotation here undone there), to any other rotated; the logits are the no-cache forward's."""
    flags: list[bool] = []
    put = CausalCache.put

    def spy(self, layer, key, value, *, keys_rotated=True):  # type: ignore[no-untyped-def]
        flags.append(keys_rotated)
        put(self, layer, key, value, keys_rotated=keys_rotated)

    monkeypatch.setattr(CausalCache, "put", spy)
    ids = tokens(10, seed=11)
    cache = CausalCache(16, shift=tiny.rope, dtype=torch.float64, key_rope=key_rope)
    parts = [tiny.forward(ids[:7], Batch.single(0, 0, 7), cache)]
    parts += [tiny.forward(ids[p : p + 1], Batch.single(0, p, 1), cache) for p in range(7, 10)]
    assert_close(torch.cat(parts), tiny.forward_full(ids))
    assert flags == [key_rope == "post"] * (4 * tiny.config.num_layers)


def test_chunked_prefill_and_outputs_rows(tiny: Llama):
    ids = tokens(20, seed=2)
    full = tiny.forward_full(ids)
    cache = tiny.new_cache(32)
    a = tiny.forward(ids[:7], Batch.single(0, 0, 7), cache, outputs=[6, 0])
    b = tiny.forward(ids[7:], Batch.single(0, 7, 13), cache, outputs=[12])
    assert_close(a, full[[6, 0]])
    assert_close(b, full[[19]])
    c = tiny.forward([1, 2], Batch.single(0, 20, 2), cache, outputs=[])
    assert c.shape == (0, tiny.config.vocab_size)


@pytest.fixture(params=["exact", "kernel", "tiles"])
def model(
    request: pytest.FixtureRequest, tiny: Llama, tiny_kernel: Llama, monkeypatch: pytest.MonkeyPatch
) -> tuple[Llama, float]:
    """(model, atol): float64 through the reference attention; float32 through the kernels,
    every segment in the C++ kernel ("kernel") or in the prompt tile path ("tiles")."""
    import kvcache.kernels.plan as plan_module

    if request.param == "exact":
        return tiny, ATOL
    monkeypatch.setattr(plan_module, "TILE_ROWS", 10**9 if request.param == "kernel" else 0)
    return tiny_kernel, KERNEL_ATOL


def test_a_decode_step_runs_its_small_ops_inside_the_linear_calls(
    tiny_kernel: Llama, monkeypatch: pytest.MonkeyPatch
):
    """A float32 decode step makes one kernel call a product, with the norms, the residuals
    and the SwiGLU inside them (2 norms, 2 residuals, 1 glu a layer; the LM head's norm):
    none of them falls back to a separate call or torch op, and the logits are the no-cache
    forward's."""
    import kvcache.kernels.linear as linear_module

    ext = linear_module.extension()
    calls: list[tuple[bool, bool, bool]] = []

    class Counting:
        def linear_rows(self, x, w, bias, residual, norm, eps, glu):  # type: ignore[no-untyped-def]
            calls.append((norm.numel() > 0, residual.numel() > 0, glu))
            return ext.linear_rows(x, w, bias, residual, norm, eps, glu)

        def rms_norm_rows(self, *args):  # type: ignore[no-untyped-def]
            raise AssertionError("a norm outside the linear calls")

    ids = tokens(9, seed=21)
    full = tiny_kernel.forward_full(ids)[-1:]
    cache = tiny_kernel.new_cache(16)
    tiny_kernel.forward(ids[:8], Batch.single(0, 0, 8), cache)
    monkeypatch.setattr(linear_module, "extension", lambda: Counting())
    step = tiny_kernel.forward(ids[8:], Batch.single(0, 8, 1), cache)
    layers = tiny_kernel.config.num_layers
    assert sorted(calls) == sorted(
        [(True, False, False)] * (2 * layers + 1)  # qkv and gate_up of each layer; LM head
        + [(False, True, False)] * layers  # wo + residual
        + [(False, True, True)] * layers  # w_down of silu(gate) * up + residual
    )
    assert_close(step, full, KERNEL_ATOL)


def test_every_path_equals_full_forward(model: tuple[Llama, float]):
    m, atol = model
    ids = tokens(80, seed=15)
    cache = m.new_cache(96)
    a = m.forward(ids[:40], Batch.single(0, 0, 40), cache)
    b = m.forward(ids[40:77], Batch.single(0, 40, 37), cache)
    c = [m.forward(ids[p : p + 1], Batch.single(0, p, 1), cache) for p in range(77, 80)]
    assert_close(torch.cat([a, b, *c]), m.forward_full(ids), atol)


def test_three_sequences_batched_together(model: tuple[Llama, float]):
    tiny, atol = model
    seqs = {0: tokens(5, seed=3), 1: tokens(9, seed=4), 2: tokens(3, seed=5)}
    n_decode = 4
    cache = tiny.new_cache(16, max_sequences=3)
    # one forward prefills all three, interleaving their rows
    order = [(s, p) for p in range(9) for s in (2, 0, 1) if p < len(seqs[s])]
    logits = tiny.forward(
        [seqs[s][p] for s, p in order], Batch([p for _, p in order], [s for s, _ in order]), cache
    )
    got: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    for row, (s, _) in enumerate(order):
        got[s].append(logits[row])
    grown = {s: list(t) for s, t in seqs.items()}
    for step in range(n_decode):
        batch_seqs = [1, 2, 0]
        nxt = [tokens(1, seed=100 + 10 * step + s)[0] for s in batch_seqs]
        positions = [len(grown[s]) for s in batch_seqs]
        logits = tiny.forward(nxt, Batch(positions, batch_seqs), cache)
        for row, s in enumerate(batch_seqs):
            grown[s].append(nxt[row])
            got[s].append(logits[row])
    for s, ids in grown.items():
        assert_close(torch.stack(got[s]), tiny.forward_full(ids), atol)


def test_prefill_and_decode_mixed_in_one_forward(model: tuple[Llama, float]):
    tiny, atol = model
    a, b = tokens(8, seed=6), tokens(6, seed=7)
    cache = tiny.new_cache(16, max_sequences=2)
    tiny.forward(a[:7], Batch.single(0, 0, 7), cache)
    # seq 0 decodes its 8th token while seq 1 prefills all of its prompt
    logits = tiny.forward([a[7], *b], Batch([7, *range(6)], [0] + [1] * 6), cache)
    assert_close(logits[0], tiny.forward_full(a)[7], atol)
    assert_close(logits[1:], tiny.forward_full(b), atol)


def test_remove_middle_then_next_logits_equal_shortened_sequence(tiny_one_layer: Llama):
    # One layer: a token's K/V depend only on the token and its position, so after a middle
    # remove the re-rotated cache is exactly the shortened sequence's cache. (With more layers
    # the later tokens' deeper K/V still carry what they attended to -- llama.cpp's context
    # shift has the same property; the next test checks the rotation itself in every layer.)
    one_layer = tiny_one_layer
    ids = tokens(12, seed=8)
    cache = one_layer.new_cache(32)
    one_layer.forward(ids, Batch.single(0, 0, 12), cache)
    cache.remove(0, 3, 7)  # positions 7..11 move to 3..7, keys re-rotated by Rope.shift
    assert cache.positions(0) == list(range(8))
    short = ids[:3] + ids[7:]
    nxt = tokens(3, seed=9)
    for i, t in enumerate(nxt):
        logits = one_layer.forward([t], Batch.single(0, 8 + i, 1), cache)
        assert_close(logits[0], one_layer.forward_full(short + nxt[: i + 1])[-1])


def test_remove_middle_rerotates_keys_of_every_layer(tiny: Llama):
    ids = tokens(12, seed=14)
    cache = tiny.new_cache(32)
    tiny.forward(ids, Batch.single(0, 0, 12), cache)
    layers = range(tiny.config.num_layers)

    def stored(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = cache.read(layer, slice(0, 12))  # cell c was filled with position c
        return k.clone(), v.clone()

    before = {i: stored(i) for i in layers}
    cache.remove(0, 2, 5)
    moved = torch.arange(5, 12)  # cells of old positions 5..11, now 2..8
    for i in layers:
        keys, values = stored(i)
        # undo each key's RoPE at its position: the content must be unchanged
        old = tiny.rope.shift(i, before[i][0][moved], -moved)
        new = tiny.rope.shift(i, keys[moved], -(moved - 3))
        assert_close(new, old, atol=1e-12)
        assert torch.equal(values[moved], before[i][1][moved])  # values carry no position
    # layer 0 keys depend on nothing else: they equal the shortened sequence's exactly
    ref = tiny.new_cache(32)
    short = ids[:2] + ids[5:]
    tiny.forward(short, Batch.single(0, 0, len(short)), ref)
    assert_close(stored(0)[0][moved], ref.read(0, slice(2, 9))[0], atol=1e-12)


def test_copy_prefix_forks_equal_independent_sequences(model: tuple[Llama, float]):
    tiny, atol = model
    prefix = tokens(6, seed=10)
    tails = {1: tokens(3, seed=11), 2: tokens(5, seed=12)}
    cache = tiny.new_cache(16, max_sequences=3)
    tiny.forward(prefix, Batch.single(0, 0, 6), cache)
    cache.copy_prefix(0, 1, 6)
    cache.copy_prefix(0, 2, 4)  # a shorter fork: seq 2 continues from position 4
    starts = {1: 6, 2: 4}
    rows = [(s, starts[s] + i, t) for s in (1, 2) for i, t in enumerate(tails[s])]
    logits = tiny.forward(
        [t for *_, t in rows], Batch([p for _, p, _ in rows], [s for s, _, _ in rows]), cache
    )
    assert_close(logits[:3], tiny.forward_full(prefix + tails[1])[6:], atol)
    assert_close(logits[3:], tiny.forward_full(prefix[:4] + tails[2])[4:], atol)
    # the source sequence is untouched by its forks
    more = tiny.forward([5], Batch.single(0, 6, 1), cache)
    assert_close(more[0], tiny.forward_full([*prefix, 5])[-1], atol)
    # all three decode together: the shared prefix is one segment read for every row
    rows = [(0, 7, 3), (1, 9, 4), (2, 9, 6)]
    logits = tiny.forward(
        [t for *_, t in rows], Batch([p for _, p, _ in rows], [s for s, _, _ in rows]), cache
    )
    assert_close(logits[0], tiny.forward_full([*prefix, 5, 3])[-1], atol)
    assert_close(logits[1], tiny.forward_full(prefix + tails[1] + [4])[-1], atol)
    assert_close(logits[2], tiny.forward_full(prefix[:4] + tails[2] + [6])[-1], atol)


@pytest.mark.parametrize("window", [3, 5])
def test_sliding_window_cache_equals_windowed_full_forward(model: tuple[Llama, float], window: int):
    tiny, atol = model
    ids = tokens(16, seed=13)
    cache = tiny.new_cache(8, window=window, max_batch=4)
    parts = [tiny.forward(ids[:4], Batch.single(0, 0, 4), cache)]
    for p in range(4, 16):
        parts.append(tiny.forward(ids[p : p + 1], Batch.single(0, p, 1), cache))
    assert_close(torch.cat(parts), tiny.forward_full(ids, window=window), atol)
    assert len(cache.positions(0)) <= window + 1  # older cells were given back


def test_rope_shift_composes_rotations():
    rope = Rope(16, 10000.0)
    x = torch.randn(5, 3, 16, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 100, 4000])
    offsets = torch.tensor([3, -1, -7, 25, -3999])
    cos, sin = rope.tables(pos, torch.float64)
    moved = rope.shift(0, rope.rotate(x, cos, sin), offsets)
    cos2, sin2 = rope.tables(pos + offsets, torch.float64)
    assert_close(moved, rope.rotate(x, cos2, sin2), atol=1e-12)
    # rotation preserves norms and position 0 is the identity
    assert_close(moved.norm(dim=-1), x.norm(dim=-1), atol=1e-12)
    c0, s0 = rope.tables(torch.zeros(1, dtype=torch.int64), torch.float64)
    assert_close(rope.rotate(x[:1], c0, s0), x[:1], atol=0.0)


def test_forward_argument_errors(tiny: Llama):
    cache = tiny.new_cache(8)
    with pytest.raises(DimensionMismatchError):
        tiny.forward([1, 2], Batch.single(0, 0, 3), cache)
    with pytest.raises(InvalidArgumentError, match="tokens"):
        tiny.forward([1, 97], Batch.single(0, 0, 2), cache)
    with pytest.raises(InvalidArgumentError, match="outputs"):
        tiny.forward([1, 2], Batch.single(0, 0, 2), cache, outputs=[2])
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        LlamaConfig(10, 8, 8, 1, num_heads=4, num_kv_heads=3, head_dim=2)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        Llama.random(LlamaConfig(10, 8, 8, 1, 2, 1, 4), dtype=torch.int32)
    # failed forwards left nothing behind: the cache still starts at position 0
    tiny.forward([1, 2], Batch.single(0, 0, 2), cache)
    assert cache.positions(0) == [0, 1]

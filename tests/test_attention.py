"""``CausalCache.attention``: the kernels against the plain reference (float64 softmax over the
cache's own mask and decoded K/V) for every codec and every policy, with histories beyond
every fp16 window; batch rows against each sequence alone; the plan's segments; errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import kvcache.causal as causal_module
import kvcache.kernels.attend as attend_module
import kvcache.kernels.plan as plan_module
import kvcache.kernels.route as route
from kvcache import Batch, CausalCache
from kvcache.cells import Cells
from kvcache.errors import DimensionMismatchError, InvalidArgumentError
from kvcache.kernels import AttentionPlan, RowBounds, grouped_attention
from kvcache.models.rope import Rope
from support import scoring_query

H, G, D = 3, 3, 64
ROPE = Rope(D, 10000.0)
# turbo4:key_bits=6: the float-level key path, beside turbo_keys16's int16 one (2-5 bits)
CODECS = [
    "fp32", "fp16", "bf16", "int8", "int4", "int4:recent=0", "kivi4", "kivi2",
    "turbo4", "turbo3", "turbo4:key_bits=6", "int8/int4",
]  # fmt: skip
POLICIES = {
    "causal": {},
    "window": {"window": 150},
    "window+memory": {"window": 150, "memory": 260},
    "chunk": {"chunk": 96},
}
REL = 1e-5  # the kernels compute in float32 from the same codes the reference decodes
ROUNDING = 5e-4  # what int16 query steps (int4, int8 keys) may move the output (relative)


def kernel_error(cache: CausalCache, q, out, keys, values, mask, scale: float) -> float:
    """Largest |out - reference| over the largest |reference|, the reference a float64 softmax
    over the cache's own mask and decoded K/V, of the query the cache scores with (with 4-bit
    affine and int8 keys rounded to int16 steps: ``scoring_query``), which must stay within
    ROUNDING of the query as given."""
    exact = grouped_attention(q.double(), keys.double(), values.double(), mask, scale)
    rounded = scoring_query(cache, q, scale)
    if rounded is q:
        return ((out.double() - exact).abs().max() / exact.abs().max()).item()
    ref = grouped_attention(rounded.double(), keys.double(), values.double(), mask, scale)
    moved = ((ref - exact).abs().max() / exact.abs().max()).item()
    assert 0 < moved < ROUNDING, f"the int16 steps moved the output by {moved:.2e}"
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


class Recorder:
    """Runs forwards on a cache and checks every layer's attention against the reference."""

    def __init__(self, cache: CausalCache, layers: int = 2, seed: int = 0) -> None:
        self.cache, self.layers = cache, layers
        self.g = torch.Generator().manual_seed(seed)
        self.worst = 0.0
        self.calls = 0

    def forward(self, positions: list[int], seqs: list[int], exempt: list[int] = ()) -> None:
        self.cache.start_forward(Batch(positions, seqs))
        if exempt:
            self.cache.set_causal(exempt)
        t = len(positions)
        for layer in range(self.layers):
            q = torch.randn(t, H * G, D, generator=self.g)
            k = torch.randn(t, H, D, generator=self.g)
            k[..., 3] += 5.0  # an offset channel, as real keys have
            v = torch.randn(t, H, D, generator=self.g)
            out = self.cache.attention(layer, q, k, v)
            keys, values, mask = self.cache.get(layer)
            err = kernel_error(self.cache, q, out, keys, values, mask, D**-0.5)
            self.worst = max(self.worst, err)
            self.calls += 1


def workload(rec: Recorder, decode_steps: int = 4) -> None:
    """Prompt chunks (the tile path), a fork, a finished sequence, a set_causal exemption,
    then decode steps of every sequence together, all beyond the 128-row windows."""
    rec.forward(list(range(200)), [0] * 200)
    rec.forward(list(range(200, 420)), [0] * 220)
    rec.forward(list(range(300)), [1] * 300)
    rec.cache.copy_prefix(0, 2, 350)
    rec.forward(list(range(350, 360)) + [420], [2] * 10 + [0])  # a short chunk: the kernel
    rec.forward(list(range(40)), [3] * 40, exempt=[5, 6])
    rec.cache.remove(1, 0)
    rec.forward(list(range(260)), [1] * 260)  # reuses the freed cells
    for step in range(decode_steps):
        rec.forward([421 + step, 360 + step, 40 + step, 260 + step], [0, 2, 3, 1])


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("codec", CODECS)
def test_kernel_equals_the_reference(codec: str, policy: str, monkeypatch: pytest.MonkeyPatch):
    calls = []
    real = causal_module.attend
    monkeypatch.setattr(causal_module, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = CausalCache(
        1024, max_sequences=4, max_batch=512, shift=ROPE, codec=codec, **POLICIES[policy]
    )
    rec = Recorder(cache)
    workload(rec)
    assert len(calls) == rec.calls  # every attention ran in the kernels
    assert rec.worst < REL, f"{codec} / {policy}: relative error {rec.worst:.2e}"


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "kivi4", "turbo4", "int8/int4"])
def test_cells_almost_in_a_run_equal_the_reference(codec: str):
    """The kernel reads runs of consecutive cells as spans (window slots, codes, scale
    records): a history whose cells by position span a consecutive range but swap a pair in
    every 16 (the first and last of each 16 and of each tile where a run would have them)
    must be read cell by cell."""
    perm = np.arange(320)
    for k in range(0, 320, 16):
        perm[[k + 5, k + 6]] = perm[[k + 6, k + 5]]
    rec = Recorder(CausalCache(1024, max_sequences=2, shift=ROPE, codec=codec))
    rec.forward(perm.tolist(), [0] * 320)  # cell i holds position perm[i]
    order = rec.cache.cells_of(0)
    assert order[-1] - order[0] == 319 and not np.array_equal(order, np.sort(order))
    for step in range(3):
        rec.forward([320 + step], [0])
    assert rec.worst < REL, f"{codec}: relative error {rec.worst:.2e}"


@pytest.mark.parametrize("codec", ["kivi4", "kivi2", "int4", "turbo4"])
def test_a_window_from_an_odd_position_equals_the_reference(codec: str):
    """The kernels score cells in blocks (pairs, fours) from a row's first visible cell: a
    window that starts at an odd position puts blocks across two KIVI records (64 positions
    each, ranges loaded once where a block shares one) and across the sequence's tiles."""
    rec = Recorder(CausalCache(1024, max_sequences=1, shift=ROPE, codec=codec, window=500))
    rec.forward(list(range(300)), [0] * 300)
    rec.forward(list(range(300, 600)), [0] * 300)
    for step in range(2):  # first visible positions 101, then 102
        rec.forward([600 + step], [0])
    assert rec.worst < REL, f"{codec}: relative error {rec.worst:.2e}"


@pytest.mark.parametrize("codec", ["turbo4", "turbo3"])
def test_turbo_keys_centred_without_a_rotary_frame_equal_the_reference(codec: str):
    """Without a shift turbo keys are stored after RoPE with a centre as it is: the kernel
    adds the centre's dot (add_centre_scores) to the scores from the codes."""
    cache = CausalCache(1024, max_sequences=4, codec=codec)
    assert cache.key_rope == "post" and cache.storage.frame is None
    rec = Recorder(cache)
    workload(rec)
    assert rec.worst < REL, f"{codec} without a shift: relative error {rec.worst:.2e}"


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "kivi4", "turbo4"])
def test_every_segment_through_the_tile_path_or_the_kernel(
    codec: str, monkeypatch: pytest.MonkeyPatch
):
    for rows in (0, 10**9):  # all prompt tiles / everything in the C++ kernel
        monkeypatch.setattr(plan_module, "TILE_ROWS", rows)
        rec = Recorder(CausalCache(1024, max_sequences=4, shift=ROPE, codec=codec))
        workload(rec, decode_steps=2)
        assert rec.worst < REL, f"{codec}, TILE_ROWS={rows}: {rec.worst:.2e}"


def test_prompt_chunks_over_a_causal_history_split_into_unmasked_and_causal_parts(
    monkeypatch: pytest.MonkeyPatch,
):
    """A fresh prompt is all diagonal, a later chunk sees its history unmasked first; windows
    and chunks keep their masks; every output equals the reference either way."""
    splits: list[int | None] = []
    real = attend_module._causal_split
    monkeypatch.setattr(
        attend_module, "_causal_split", lambda *a: splits.append(real(*a)) or splits[-1]
    )
    rec = Recorder(CausalCache(1024, shift=ROPE), layers=1)
    rec.forward(list(range(200)), [0] * 200)
    rec.forward(list(range(200, 420)), [0] * 220)
    assert splits == [0, 200]
    for policy in ("window", "chunk"):
        splits.clear()
        rec.cache = CausalCache(1024, shift=ROPE, **POLICIES[policy])
        rec.forward(list(range(300)), [0] * 300)
        assert splits == [None], policy
    assert rec.worst < REL


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "kivi4", "turbo4"])
def test_each_row_of_a_16_sequence_batch_equals_that_sequence_alone(codec: str):
    """Distinct histories; the batched decode step against one step per sequence, on two
    caches given the same K/V (codes are per sequence: placement does not change them)."""
    n, g = 16, torch.Generator().manual_seed(3)
    prompts = [int(x) for x in torch.randint(150, 400, (n,), generator=g)]
    rows = {s: (torch.randn(p, H, D, generator=g), torch.randn(p, H, D, generator=g))
            for s, p in enumerate(prompts)}  # fmt: skip
    q = torch.randn(n, H * G, D, generator=g)
    k_new, v_new = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    caches = [CausalCache(512, max_sequences=n, shift=ROPE, codec=codec) for _ in range(2)]
    for cache in caches:
        for s, (k, v) in rows.items():
            cache.start_forward(Batch.single(s, 0, len(k)))
            cache.put(0, k, v)
    together = caches[0]
    together.start_forward(Batch(prompts, list(range(n))))
    batched = together.attention(0, q, k_new, v_new)
    alone = caches[1]
    for s in range(n):
        alone.start_forward(Batch.single(s, prompts[s], 1))
        out = alone.attention(0, q[s : s + 1], k_new[s : s + 1], v_new[s : s + 1])
        scale = out.abs().max()
        assert (out[0] - batched[s]).abs().max() <= 1e-6 * scale, f"sequence {s}"


GROUP_CASES = [
    (group, dim, codec)
    for group, dim in [(1, 64), (2, 64), (4, 64), (5, 64), (3, 48)]
    for codec in ["fp32", "int8", "int4", "kivi4", "int8/int4"]
    if dim % 32 == 0 or "int4" not in codec  # int4's groups are 32 channels
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("group", "dim", "codec"), GROUP_CASES)
def test_kernel_for_every_query_group_and_thread_count(
    group: int, dim: int, codec: str, threads: int
):
    """Query heads per KV head 1..5 (the score and value loops block 1-3 rows by 4 cells and
    4+ rows by 2; a head_dim of 48 leaves a 16-column rest), histories that are no multiple
    of a block, decode rows of 5 sequences with 1 or 2 threads taking the work items, int8
    and 4-bit rows read as codes by the tile math: each equals the float64 reference."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = CausalCache(2048, max_sequences=5, shift=Rope(dim, 10000.0), codec=codec)
        g = torch.Generator().manual_seed(group)
        lengths = [1, 3, 130, 301, 777]
        for s, n in enumerate(lengths):
            cache.start_forward(Batch.single(s, 0, n))
            cache.put(0, torch.randn(n, H, dim, generator=g), torch.randn(n, H, dim, generator=g))
        cache.start_forward(Batch(lengths, list(range(5))))
        q = torch.randn(5, H * group, dim, generator=g)
        k, v = torch.randn(2, 5, H, dim, generator=g)
        out = cache.attention(0, q, k, v)
        keys, values, mask = cache.get(0)
        assert kernel_error(cache, q, out, keys, values, mask, dim**-0.5) < REL
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("codec", ["turbo4", "turbo3", "turbo4:recent=0"])
def test_turbo_values_of_head_dim_256_are_read_by_the_kernels(codec: str):
    """Gemma 3's head_dim: the value sums' rotation back (a Hadamard of 256, past the one-GEMM
    size) is a dense matrix the kernels take; before, the route sent every such layer to the
    reference, which decodes every cell. Equal to the float64 reference, one KV head, 4
    query heads, history of codes and window rows."""
    dim = 256
    cache = CausalCache(2048, shift=Rope(dim, 10000.0), codec=codec)
    g = torch.Generator().manual_seed(3)
    cache.start_forward(Batch.single(0, 0, 900))
    cache.put(0, torch.randn(900, 1, dim, generator=g), torch.randn(900, 1, dim, generator=g))
    cache.start_forward(Batch.single(0, 900, 3))
    q = torch.randn(3, 4, dim, generator=g)
    k, v = torch.randn(2, 3, 1, dim, generator=g)
    out = cache.attention(0, q, k, v)
    assert route.layer_reason(q, v, *cache.storage.layouts(0)) is None
    keys, values, mask = cache.get(0)
    assert kernel_error(cache, q, out, keys, values, mask, dim**-0.5) < REL


# (codec, key_rope): the paths of a tile of encoded rows and of a tile of window rows
TILE_PATHS = [
    ("fp32", "post", ("decoded", "decoded"), ("decoded", "decoded")),
    ("fp16", "post", ("fp16", "fp16"), ("fp16", "fp16")),
    ("bf16", "post", ("decoded", "decoded"), ("decoded", "decoded")),
    ("int8", "post", ("int8", "int8"), ("fp16", "fp16")),
    ("int4", "post", ("affine4", "affine4"), ("fp16", "fp16")),
    ("kivi4", "pre", ("kivi4 before RoPE", "affine4"), ("fp16 before RoPE", "fp16")),
    ("kivi2", "pre", ("decoded", "decoded"), ("fp16 before RoPE", "fp16")),
    ("turbo4", "post", ("turbo", "turbo"), ("fp16", "fp16")),
    ("int8", "pre", ("decoded", "int8"), ("fp16 before RoPE", "fp16")),
    ("int8/int4", "post", ("int8", "affine4"), ("fp16", "fp16")),
]


@pytest.mark.parametrize(("codec", "key_rope", "codes", "window"), TILE_PATHS)
def test_each_codec_reads_its_tiles_by_its_own_path(
    codec: str, key_rope: str, codes: tuple[str, str], window: tuple[str, str]
):
    """The path tables (csrc/paths.h) send a tile of encoded rows to its codec's own path and
    a tile of fp16 window rows to the fp16 one: a row that fits too early or too late would
    keep outputs within the bounds above and cost the speed the path exists for. Plain loops
    (no AVX2) decode every tile."""
    cache = CausalCache(1024, shift=ROPE, codec=codec, key_rope=key_rope)
    cache.start_forward(Batch.single(0, 0, 400))
    cache.put(0, torch.randn(400, H, D), torch.randn(400, H, D))
    cells = torch.from_numpy(cache.cells_of(0))
    keys, values = cache.storage.layouts(0)
    pre = key_rope == "pre"
    got = [
        attend_module.tile_paths(tile, keys, values, kv_heads=H, dim=D, pre_rope=pre)
        for tile in (cells[:64], cells[-8:])
    ]
    if not attend_module.vector_kernels():
        codes = window = ("decoded", "decoded")
    assert got == [codes, window]


def test_the_kernels_run_on_torchs_threads():
    """Built without OpenMP, at::parallel_for in the extension runs everything on one thread
    (it did until this test existed): the kernels must use as many as torch is given."""
    from kvcache.kernels.build import extension

    previous = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert extension().parallel_threads(8) == n
    finally:
        torch.set_num_threads(previous)


def test_the_kernel_rounds_queries_to_int16_steps_as_the_reference_does():
    """With 4-bit keys the kernel scores an int16-rounded query and the reference (and the
    tests' bounds) assume ``int16_steps``' rounding: the two must agree on every channel, ties
    (half to even) included, or a score moves by a step's worth (the state machine once caught
    that at random, when the kernel multiplied by the step's inverse instead of dividing)."""
    from kvcache.kernels.attend import int16_steps
    from kvcache.kernels.build import extension

    g = torch.Generator().manual_seed(0)
    q = torch.randn(4096, 2 * D, generator=g) * torch.logspace(-4, 4, 4096)[:, None]
    ties = torch.zeros(4, 2 * D)  # step 2**-10 exactly: halves of a step are exact ties
    ties[:, 0] = 32767 * 2.0**-10
    ties[:, 1:8] = torch.tensor([0.5, 1.5, 2.5, -2.5, 3.5, 100.5, -32766.5]) * 2.0**-10
    q = torch.cat([q, ties])
    rounded, q16, step = extension().query_steps16(q)
    assert torch.equal(rounded, int16_steps(q[:, None], 1.0)[:, 0])
    assert torch.equal(step[-4:], torch.full((4,), 2.0**-10))
    # q16 holds the same steps in the kernel's layout: [b*64 + k*16 + L*8 + w] = channel
    # b*64 + 32 L + 4 w + k
    channel = torch.tensor(
        [
            b + 32 * L + 4 * w + k
            for b in (0, 64)
            for k in range(4)
            for L in (0, 1)
            for w in range(8)
        ]
    )
    assert torch.equal(q16.float() * step[:, None], rounded[:, channel])
    half_even = torch.tensor([0, 2, 2, -2, 4, 100, -32766], dtype=torch.int16)
    assert torch.equal(
        q16[-1, (channel[:, None] == torch.arange(1, 8)).float().argmax(0)], half_even
    )
    # int8 keys read the same steps in channel order (qk8_rows), D a multiple of 16
    rounded8, q8, step8 = extension().query_steps16(q[:, :80], nibble_order=False)
    assert torch.equal(rounded8, int16_steps(q[:, None, :80], 1.0)[:, 0])
    assert torch.equal(q8.float() * step8[:, None], rounded8)
    assert torch.equal(q8[-1, 1:8], half_even)


@pytest.mark.parametrize("dim", [64, 128])
def test_turbo_keys_score_the_query_the_reference_rounds(dim: int):
    """Turbo keys of 2-5 bits meet the query in int16 steps of the codes' rotated domain
    (turbo_query16): ``turbo_steps`` (the prompt tiles' query and the tests' reference) must
    give the very query the kernel scores with, bit for bit, and the kernel's int16 steps
    must be the rotated query's, rounded."""
    from kvcache.codecs.rotation import hadamard
    from kvcache.kernels.attend import turbo_steps
    from kvcache.kernels.build import extension

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2048, dim, generator=g) * torch.logspace(-4, 4, 2048)[:, None]
    signs = torch.randint(0, 2, (dim,), generator=g).float() * 2 - 1
    rounded, q16, step = extension().turbo_steps16(q, signs)
    assert torch.equal(rounded, turbo_steps(q[:, None], 1.0, signs[None])[:, 0])
    h = hadamard(dim, torch.device("cpu")).double() / dim**0.5  # Sylvester order
    y = (q.double() * signs.double()) @ h  # the codes' domain
    assert torch.all(q16.abs().amax(dim=1) == 32767)
    off = (q16.double() * step[:, None].double() - y).abs()
    assert torch.all(off <= step[:, None] * 0.5 + 1e-6 * y.abs().amax(dim=1, keepdim=True))
    assert not torch.equal(rounded, q)


def test_the_prompt_tiles_round_turbo_queries_by_the_kernel_as_the_reference_does():
    """The prompt tiles take turbo's rounded query from the kernel (turbo_steps_kernel: one
    turbo_steps16 call per KV head, the rows scaled first): bit for bit ``turbo_steps``, each
    query head against its own KV head's signs."""
    from kvcache.kernels.attend import turbo_steps, turbo_steps_kernel

    g = torch.Generator().manual_seed(2)
    q = torch.randn(300, 9, 64, generator=g) * torch.logspace(-3, 3, 300)[:, None, None]
    signs = torch.randint(0, 2, (3, 64), generator=g).float() * 2 - 1
    scale = 128**-0.5  # as a head of 128 channels scales (not a power of two)
    got = turbo_steps_kernel(q, scale, signs)
    assert torch.equal(got, turbo_steps(q, scale, signs))
    assert not torch.equal(got, q)


def test_another_cpu_gets_its_own_kernel_build(monkeypatch: pytest.MonkeyPatch):
    """The kernels are built with -march=native: a build folder shared by two machines (one
    home on both) must not load one CPU's instructions on the other, so the CPU names it."""
    from kvcache.kernels import build

    here = build.build_dir()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux: the feature flags -march=native compiles for are named
        flags = next(x for x in cpuinfo.read_text().splitlines() if x.startswith(("flags", "Feat")))
        assert flags.partition(":")[2].strip() in build._cpu_identity()
    monkeypatch.setattr(build, "_cpu_identity", lambda: "another CPU")
    assert build.build_dir() != here and build.build_dir().parent == here.parent


def test_a_kernel_build_says_so_and_a_built_one_loads_quietly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """Compiling takes minutes: the user is told on stderr, once, and not when the build of
    these sources is already there (torch's loader stands in: nothing is compiled here)."""
    import torch.utils.cpp_extension as cpp

    from kvcache.kernels import build

    loads: list[str] = []
    monkeypatch.setattr(cpp, "load", lambda name, **kw: loads.append(name) or name)
    monkeypatch.setenv("KVCACHE_KERNEL_DIR", str(tmp_path))
    where = build.build_dir()
    assert build.extension.__wrapped__() == where.name
    assert "compiling the C++ kernels" in capsys.readouterr().err
    (where / f"{where.name}.so").write_bytes(b"")  # what torch's loader leaves behind
    assert build.extension.__wrapped__() == where.name
    assert capsys.readouterr().err == "" and loads == [where.name] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_cpu_cache_loads_the_kernels_when_it_is_made(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
):
    """The kernels (built on first use, minutes on a fresh machine or after a source change)
    are loaded when a CPU cache is made, so that the first forward, which generation times,
    never includes the build; a float64 cache (the reference path) does not need them."""
    from kvcache.kernels import build

    calls: list[int] = []
    real = build.extension
    monkeypatch.setattr(build, "extension", lambda: calls.append(1) or real())
    CausalCache(64, shift=Rope(16, 10000.0), dtype=dtype)
    assert len(calls) == (dtype != torch.float64)


def test_reserve_forward_allocates_and_returns_zeros():
    cache = CausalCache(64, codec="int4")
    cache.start_forward(Batch.single(0, 0, 3), reserve=True)
    out = cache.attention(0, torch.randn(3, H * G, D), torch.randn(3, H, D), torch.randn(3, H, D))
    assert out.shape == (3, H * G, D) and not out.any()
    assert 0 in cache.storage.layers and cache.used_cells() == 0


def test_attention_errors_change_nothing():
    cache = CausalCache(64)
    cache.start_forward(Batch.single(0, 0, 2))
    k = v = torch.randn(2, H, D)
    with pytest.raises(DimensionMismatchError, match="q heads"):
        cache.attention(0, torch.randn(2, 4, D), k, v)
    with pytest.raises(DimensionMismatchError, match="head_dim"):
        cache.attention(0, torch.randn(2, H * G, D // 2), k, v)
    with pytest.raises(DimensionMismatchError, match="q tokens"):
        cache.attention(0, torch.randn(3, H * G, D), k, v)
    with pytest.raises(InvalidArgumentError, match="q="):
        cache.attention(0, torch.ones(2, H * G, D, dtype=torch.int64), k, v)
    assert not cache.storage.layers  # nothing was stored
    out = cache.attention(0, torch.randn(2, H * G, D), k, v)
    assert out.shape == (2, H * G, D)


def test_reference_path_for_float64_and_the_environment(monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(causal_module, "attend", lambda *a, **k: calls.append(1))
    for dtype, env, why in (
        (torch.float64, "", "float64"),
        (torch.float32, "reference", "KVCACHE_ATTENTION=reference"),
    ):
        monkeypatch.setenv(route.ATTENTION_ENV, env)
        cache = CausalCache(64, dtype=dtype)
        assert why in (cache.kernel_reason() or "")
        cache.start_forward(Batch.single(0, 0, 4))
        q, k, v = (torch.randn(4, h, D, dtype=dtype) for h in (H * G, H, H))
        out = cache.attention(0, q, k, v)
        causal = torch.ones(4, 4, dtype=torch.bool).tril()
        assert torch.allclose(out, grouped_attention(q, k, v, causal), atol=1e-6)
    assert not calls
    monkeypatch.setenv(route.ATTENTION_ENV, "")
    assert CausalCache(64).kernel_reason() is None


@pytest.mark.parametrize(
    ("codec", "dim", "value_dim", "why"),
    [
        ("fp32", 40, 40, "head_dim 40"),
        ("fp32", 272, 272, "head_dim 272"),
        ("fp32", 64, 32, "value head_dim 32"),
        ("turbo4:recent=0", 48, 48, "turbo codes of head_dim 48"),
    ],
)
def test_a_layer_the_kernels_do_not_take_says_why_and_equals_the_reference(
    codec: str, dim: int, value_dim: int, why: str, monkeypatch: pytest.MonkeyPatch
):
    """Shapes and codes the kernels do not take go to the reference (a turbo cache of
    head_dim 48 raised inside the kernel before), and the route says why."""
    calls = []
    monkeypatch.setattr(causal_module, "attend", lambda *a, **k: calls.append(1))
    cache = CausalCache(64, shift=Rope(dim, 10000.0), codec=codec)
    cache.start_forward(Batch.single(0, 0, 4))
    q, k = torch.randn(4, H * G, dim), torch.randn(4, H, dim)
    v = torch.randn(4, H, value_dim)
    out = cache.attention(0, q, k, v)
    keys_l, values_l = cache.storage.layouts(0)
    assert why in (route.layer_reason(q, v, keys_l, values_l) or "")
    keys, values, mask = cache.get(0)
    assert torch.allclose(out, grouped_attention(q, keys, values, mask), atol=1e-5)
    assert not calls


def test_grouped_attention_equals_repeated_heads():
    """The reference itself, against per-head softmax with K/V repeated (HF's repeat_kv)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 6, 8, generator=g), torch.randn(7, 2, 8, generator=g), None
    v = torch.randn(7, 2, 8, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[2] = False  # a row that sees nothing: zeros
    out = grouped_attention(q.double(), k.double(), v.double(), mask, 0.3)
    kr, vr = k.repeat_interleave(3, dim=1).double(), v.repeat_interleave(3, dim=1).double()
    for h in range(6):
        s = (q[:, h].double() @ kr[:, h].T) * 0.3
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
        assert torch.allclose(out[:, h], p @ vr[:, h], atol=1e-12)
    assert not out[2].any()


# ---- the plan ----------------------------------------------------------------------------
def cells_with(layout: dict[int, list[int]], shared: dict[int, tuple[int, int]] = ()) -> Cells:
    """Cells holding ``layout[seq]`` = cells in position order; ``shared[dst] = (src, n)``."""
    c = Cells(64)
    for seq, cells in layout.items():
        c.occupy(np.array(cells), np.arange(len(cells)), np.full(len(cells), seq))
    for dst, (src, n) in dict(shared).items():
        c.share(dst, c.ordered(src)[:n])
    return c


def bounds(seqs: list[int], pos: list[int], lo: int | None = None) -> RowBounds:
    p = np.array(pos)
    return RowBounds(np.array(seqs), np.full(len(p), -(10**9) if lo is None else lo), p)


def test_plan_reads_each_sequence_in_position_order():
    c = cells_with({0: [5, 1, 3], 1: [2, 4]})
    plan = AttentionPlan.build(c, bounds([0, 1], [2, 1]), kv_heads=3, threads=1)
    assert plan.cells.tolist() == [5, 1, 3, 2, 4] and plan.pos.tolist() == [0, 1, 2, 0, 1]
    assert plan.segs.tolist() == [[0, 3, 0, 1], [3, 5, 1, 2]]
    assert plan.entries[:, 0].tolist() == [0, 1] and not plan.tiles


def test_plan_reads_a_shared_prefix_once_for_every_fork():
    c = cells_with({0: [0, 1, 2, 3, 4]}, shared={1: (0, 4), 2: (0, 3)})
    c.occupy(np.array([7, 8]), np.array([4, 3]), np.array([1, 2]))  # each fork's own token
    plan = AttentionPlan.build(c, bounds([0, 1, 2], [4, 4, 3]), kv_heads=3, threads=1)
    segs = plan.segs.tolist()
    assert segs[0] == [0, 3, 0, 3]  # cells 0..2: one segment, one entry per row
    assert plan.cells.tolist()[:3] == [0, 1, 2]
    assert sorted(plan.entries[:, 0].tolist()) == [0, 0, 1, 1, 2, 2]  # each row: prefix + own


def test_plan_narrows_to_the_visible_positions_and_splits_long_segments():
    c = cells_with({0: list(range(60))})
    plan = AttentionPlan.build(c, bounds([0], [59], lo=40), kv_heads=1, threads=1)
    assert plan.pos.tolist() == list(range(40, 60))  # a window: older cells are not read
    big = Cells(5000)
    big.occupy(np.arange(5000), np.arange(5000), np.zeros(5000, dtype=np.int64))
    plan = AttentionPlan.build(big, bounds([0], [4999]), kv_heads=3, threads=2)
    assert plan.segs[:, 1].tolist() == list(range(625, 5001, 625))  # 8 pieces: 4 per thread
    rows = AttentionPlan.build(big, bounds([0] * 20, list(range(4980, 5000))), 3, 2)
    assert len(rows.tiles) == 1 and not len(rows.segs)  # a prompt chunk: the tile path

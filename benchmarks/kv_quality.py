"""KV codec quality on real SmolLM2-135M: perplexity, KL and top-1 vs the fp32 cache, bytes
per token, decode speed at 2k, and attention-output cosine per layer on real K/V.

Protocol (issue 5): the Debian license texts (/usr/share/common-licenses, regular files
concatenated in sorted name order), first 8192 tokens, no BOS, in 4 fresh windows of 2048.
Each window is a 1024-token prefill followed by 64-token cached chunks, and only tokens
1024..2047 of each window are scored (4096 tokens), so every scored token reads the codec's
stored K/V. Writes benchmarks/results/kv_quality.json and kv_quality.png.

    python benchmarks/kv_quality.py                 # every codec
    python benchmarks/kv_quality.py --quick         # 1 window, fewer codecs
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, table, write_json  # noqa: E402
from kvcache import Batch, CausalCache  # noqa: E402
from kvcache.codecs import make_codec  # noqa: E402
from kvcache.models.llama import Llama  # noqa: E402
from kvcache.text.tokenizer import Tokenizer  # noqa: E402

CODECS = ["fp32", "fp16", "bf16", "int8", "int4", "kivi4", "turbo4", "kivi2", "turbo3"]
LICENSES = Path("/usr/share/common-licenses")
WINDOW, PREFILL, CHUNK = 2048, 1024, 64


def license_tokens(tokenizer: Tokenizer, count: int) -> list[int]:
    files = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())
    text = "".join(p.read_text(errors="replace") for p in files)
    ids = tokenizer.encode(text, add_bos=False)
    if len(ids) < count:
        raise SystemExit(f"only {len(ids)} tokens in {LICENSES}, need {count}")
    return ids[:count]


def window_logprobs(model: Llama, codec: str, tokens: list[int]) -> torch.Tensor:
    """Log-probabilities [1024, V] predicting tokens 1024..2047 of one window."""
    cache = CausalCache(WINDOW, max_batch=PREFILL, shift=model.rope.shift, codec=codec)
    out = [
        model.forward(tokens[:PREFILL], Batch.single(0, 0, PREFILL), cache, outputs=[PREFILL - 1])
    ]
    for start in range(PREFILL, WINDOW - 1, CHUNK):
        n = min(CHUNK, WINDOW - 1 - start)
        out.append(model.forward(tokens[start : start + n], Batch.single(0, start, n), cache))
    cache.close()
    return torch.log_softmax(torch.cat(out).double(), dim=-1)  # rows predict 1024..2047


def decode_speed(model: Llama, codec: str, tokens: list[int], steps: int = 16) -> float:
    cache = CausalCache(WINDOW + steps, max_batch=PREFILL, shift=model.rope.shift, codec=codec)
    for start in range(0, WINDOW, PREFILL):
        model.forward(
            tokens[start : start + PREFILL],
            Batch.single(0, start, PREFILL),
            cache,
            outputs=[PREFILL - 1],
        )
    t0 = time.perf_counter()
    for i in range(steps):
        model.forward([tokens[i]], Batch.single(0, WINDOW + i, 1), cache)
    return steps / (time.perf_counter() - t0)


def bytes_per_token(model: Llama, codec: str) -> tuple[float, float]:
    """(asymptotic bytes per token, all layers K+V; bytes per token held at a 2k context)."""
    c = model.config
    k, v = make_codec(codec, "key"), make_codec(codec, "value")
    per_row = k.bytes_per_row(c.num_kv_heads, c.head_dim) + v.bytes_per_row(
        c.num_kv_heads, c.head_dim
    )
    big = 1 << 16
    kb = k.allocate(big, c.num_kv_heads, c.head_dim, torch.device("cpu")).nbytes()
    vb = v.allocate(big, c.num_kv_heads, c.head_dim, torch.device("cpu")).nbytes()
    at2k = k.allocate(WINDOW, c.num_kv_heads, c.head_dim, torch.device("cpu")).nbytes()
    at2k += v.allocate(WINDOW, c.num_kv_heads, c.head_dim, torch.device("cpu")).nbytes()
    asym = min(per_row, (kb + vb) / big)
    return asym * c.num_layers, at2k / WINDOW * c.num_layers


class Recorder:
    """Records each layer's queries and exact K/V of one forward (fp32 cache)."""

    def __init__(self, model: Llama) -> None:
        self.q: list[torch.Tensor] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        original = model._qkv

        def qkv(layer, x, cos, sin):  # type: ignore[no-untyped-def]
            q, k, v = original(layer, x, cos, sin)
            self.q.append(q.clone())
            self.kv.append((k.clone(), v.clone()))
            return q, k, v

        self.model, self.original = model, original
        model._qkv = qkv  # type: ignore[method-assign]

    def close(self) -> None:
        self.model._qkv = self.original  # type: ignore[method-assign]


def attention_cosines(model: Llama, tokens: list[int], codecs: list[str]) -> dict[str, list[float]]:
    """Per layer: cosine of causal GQA attention output, codec K/V vs exact, 512 tokens."""
    rec = Recorder(model)
    try:
        model.forward(tokens[:512], Batch.single(0, 0, 512), CausalCache(512), outputs=[511])
    finally:
        rec.close()
    c = model.config
    out: dict[str, list[float]] = {}
    mask = torch.ones(512, 512, dtype=torch.bool).tril()
    for codec in codecs:
        cos = []
        for q, (k, v) in zip(rec.q, rec.kv, strict=True):
            kb = make_codec(codec, "key").allocate(
                512, c.num_kv_heads, c.head_dim, torch.device("cpu")
            )
            vb = make_codec(codec, "value").allocate(
                512, c.num_kv_heads, c.head_dim, torch.device("cpu")
            )
            kb.write(slice(0, 512), k)
            vb.write(slice(0, 512), v)
            exact = _attend(q, k, v, mask, c.num_kv_heads)
            approx = _attend(
                q,
                kb.read(0, 512, torch.float32),
                vb.read(0, 512, torch.float32),
                mask,
                c.num_kv_heads,
            )
            cos.append(float(torch.nn.functional.cosine_similarity(exact, approx, dim=-1).mean()))
        out[codec] = cos
    return out


def _attend(q, k, v, mask, kv_heads):  # type: ignore[no-untyped-def]
    g = q.shape[1] // kv_heads
    kf = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, T, D]
    vf = v.repeat_interleave(g, dim=1).transpose(0, 1)
    s = q.transpose(0, 1) @ kf.transpose(1, 2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(0, 1)  # [T, Hq, D]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 window; fp32, int8, int4, turbo4")
    parser.add_argument("--codecs", nargs="*", default=None, help=f"subset of {CODECS}")
    parser.add_argument("--windows", type=int, default=None, help="windows of 2048 (default 4)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    codecs = args.codecs or (["fp32", "int8", "int4", "turbo4"] if args.quick else CODECS)
    if codecs[0] != "fp32":
        codecs = ["fp32", *[c for c in codecs if c != "fp32"]]
    windows = args.windows or (1 if args.quick else 4)
    model = Llama.from_gguf()
    tokenizer = Tokenizer.from_gguf()
    tokens = license_tokens(tokenizer, windows * WINDOW)
    base: list[torch.Tensor] = []
    rows = []
    with torch.inference_mode():
        for codec in tqdm(codecs, desc="kv_quality", unit="codec"):
            nll, kl, agree = 0.0, 0.0, 0
            for w in range(windows):
                win = tokens[w * WINDOW : (w + 1) * WINDOW]
                lp = window_logprobs(model, codec, win)
                target = torch.tensor(win[PREFILL:WINDOW])
                nll -= float(lp.gather(1, target[:, None]).sum())
                if codec == "fp32":
                    base.append(lp)
                ref = base[w]
                kl += float((ref.exp() * (ref - lp)).sum())
                agree += int((ref.argmax(-1) == lp.argmax(-1)).sum())
            n = windows * (WINDOW - PREFILL)
            asym, at2k = bytes_per_token(model, codec)
            rows.append(
                {
                    "codec": codec,
                    "ppl": math.exp(nll / n),
                    "kl": kl / n,
                    "top1": agree / n,
                    "bytes_per_token": asym,
                    "bytes_per_token_2k": at2k,
                    "decode_tok_s_2k": decode_speed(model, codec, tokens),
                }
            )
        cosines = attention_cosines(model, tokens, codecs)
    fp32, fp16_bytes = rows[0], 30 * 2 * 3 * 64 * 2
    for r in rows:
        r["dppl_pct"] = 100 * (r["ppl"] / fp32["ppl"] - 1)
        r["vs_fp16_bytes"] = fp16_bytes / r["bytes_per_token"]
        r["decode_vs_fp32"] = r["decode_tok_s_2k"] / fp32["decode_tok_s_2k"]
        r["attn_cos_min"] = min(cosines[r["codec"]])
        r["attn_cos_mean"] = sum(cosines[r["codec"]]) / len(cosines[r["codec"]])
    cols = [
        "codec",
        "ppl",
        "dppl_pct",
        "kl",
        "top1",
        "bytes_per_token",
        "bytes_per_token_2k",
        "vs_fp16_bytes",
        "decode_tok_s_2k",
        "decode_vs_fp32",
        "attn_cos_mean",
        "attn_cos_min",
    ]
    print(table(rows, cols))
    path = write_json(
        "kv_quality",
        {
            "windows": windows,
            "scored_tokens": windows * 1024,
            "rows": rows,
            "attention_cosine_per_layer": cosines,
        },
    )
    print(f"wrote {path}")
    _plot(rows)
    return 0


def _plot(rows: list[dict[str, float | str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        x, y = float(r["bytes_per_token"]) * 8 / (30 * 2 * 3 * 64), max(float(r["dppl_pct"]), 1e-3)
        ax.scatter(x, y)
        ax.annotate(f"{r['codec']} ({float(r['decode_tok_s_2k']):.1f} tok/s)", (x, y), fontsize=8)
    ax.set(
        xlabel="bits per stored value (all metadata)",
        ylabel="ΔPPL vs fp32 cache (%)",
        yscale="log",
        title="SmolLM2-135M KV codecs: size vs quality (labels: decode @2k)",
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "kv_quality.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())

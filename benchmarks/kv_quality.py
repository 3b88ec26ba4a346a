"""KV codec quality on real SmolLM2-135M (or Gemma 3 270M): perplexity, KL and top-1 vs the
fp32 cache, bytes per token, decode speed at 2k, and attention-output cosine per layer on real
K/V.

Protocol: the Debian license texts (/usr/share/common-licenses, regular files
concatenated in sorted name order), first 8192 tokens, no BOS, in 4 fresh windows of 2048.
Each window is a 1024-token prefill followed by 64-token cached chunks, and only tokens
1024..2047 of each window are scored (4096 tokens), so every scored token reads the codec's
stored K/V. Writes benchmarks/results/OUT.json and OUT.png (``--out``, default kv_quality);
with ``--press-decode`` the pressed rows' ΔPPL and total compression go to OUT_press.png
(to OUT.png when fp32 is the only codec).

    python benchmarks/kv_quality.py                 # every codec
    python benchmarks/kv_quality.py --quick         # 1 window, fewer codecs
    python benchmarks/kv_quality.py --codecs kivi4 kivi4@post int8/int4
    python benchmarks/kv_quality.py --codecs fp32 kivi4 turbo4 --spread   # ΔPPL's rounding spread
    python benchmarks/kv_quality.py --codecs fp32 kivi4 --press-decode tova:0.5 snapkv:0.5 \
        --cap 0.25 --out kv_quality_press
    python benchmarks/kv_quality.py --codecs fp32 --windows 2 --window 8192 \
        --press-decode snapout:0.5 --cap 0.25 --out kv_quality_press_8k   # SmolLM2's context
    python benchmarks/kv_quality.py --model gemma3 --out kv_quality_gemma3

``--model gemma3``: the bundled Gemma 3 270M on its wrapper cache (15 sliding layers of 512,
3 global; each window starts with BOS, which Gemma needs), every scored token past the
sliding window; 2 windows by default (its 262k-token vocabulary makes the rows 5x larger).
Codecs are single names there (one codec for K and V in both parts), bytes per token are the
codec's nominal bytes per stored position in every layer (the wrapper keeps fewer:
benchmarks/gemma_long.py), and the attention cosines and press rows are SmolLM2's alone.

Decode-time pressing (``--press-decode SPEC [SPEC ...]``, needs ``kvcache.press``): each
window's prefill and its scored tokens run under the press, the scored tokens one per
decode step; after the first scored step and every ``--every`` steps after it,
``press.during_decode(max_cells=CAP * history)`` evicts the cache back to CAP of the
tokens seen so far (the cap follows the history, so the prefill is pressed to CAP too).
Each codec listed gets a pressed row, judged against the fp32 cache without a press;
``held_fraction`` is the mean share of the history the cache held over the scored tokens
(CAP to CAP + every / history), ``total_compression`` the mean of the total
compression over them (``kvcache.press.total_compression``: fp16 bytes of the history so far
/ the bytes the cache's cells hold, codes, scales and fp16 windows included): a press and a
codec multiply, less the codec's fixed fp16 window of recent rows.

``--window N`` makes each window N tokens (up to SmolLM2's 8192): the last 1024 are scored
as above, after a prefill of the other N - 1024 (decode-time pressing then caps a longer
history). The decode speed and the bytes at 2k stay measured at 2048.

``--spread`` runs each codec twice more with every key moved by one float32 ulp before the
cache stores it (up, then down): the rounding difference numerically equivalent computations
make. ``dppl_lo`` / ``dppl_hi`` span the three ΔPPLs: a 4-bit codec's moves by tenths of a
point or more with rounding alone, so two runs whose ΔPPLs differ inside that span do not
show a change.

A codec spec is a registry name (both K and V), ``KEY/VALUE`` for different key and value
codecs, and ``@pre`` / ``@post`` to force where keys are quantized (default: the codec's
choice, see ``kvcache.storage``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from common import license_tokens
from harness import plot, table, write_json
from kvcache import Batch, CausalCache
from kvcache.codecs import make_codec
from kvcache.models.gemma3 import Gemma3
from kvcache.models.llama import Llama
from kvcache.text.tokenizer import Tokenizer
from kvcache.weights.bundled import gemma3_path

if TYPE_CHECKING:  # kvcache.press is optional here (see --press-decode)
    from kvcache.press.base import Press

CODECS = [
    "fp32",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "int4:recent=0",  # without the fp16 window of the newest 128 rows
    "int4g64",
    "kivi4",
    "kivi4@post",  # keys quantized after RoPE
    "turbo4",
    "turbo4:key_bits=4,value_bits=4",  # the even split of the bits
    "int8/int4",  # int8 keys, int4 values (llama.cpp's q8_0 K + q4_0 V)
    "kivi2",
    "turbo3",
    "turbo3:key_bits=3,value_bits=3",
]
GEMMA_CODECS = ["fp32", "fp16", "bf16", "int8", "int4", "kivi4", "turbo4", "kivi2", "turbo3"]
KV = ("key", "value")
WINDOW, PREFILL, CHUNK = 2048, 1024, 64
SCORED = WINDOW - PREFILL  # the scored tokens at the end of each window, whatever --window
QUALITY_COLS = ["ppl", "dppl_pct", "kl", "top1"]
DECODE_PRESS_GOAL = 5.0  # the goal: ΔPPL in % with the cache capped at 1/4 of the history
DECODE_PRESS_CAP = 0.25  # ... the goal's cap: a looser cap gets no verdict


def parse(spec: str) -> dict[str, str | None]:
    """``"int8/int4@post"`` -> CausalCache keywords key_codec, value_codec, key_rope."""
    names, _, rope = spec.partition("@")
    key, _, value = names.partition("/")
    return {"key_codec": key, "value_codec": value or key, "key_rope": rope or None}


def make_cache(model: Any, spec: str, capacity: int, max_batch: int = PREFILL) -> Any:
    """SmolLM2's CausalCache of ``spec``, or Gemma 3's wrapper cache of its single codec."""
    if isinstance(model, Gemma3):
        return model.new_cache(capacity, max_batch=max_batch, codec=spec)
    return CausalCache(capacity, max_batch=max_batch, shift=model.rope, **parse(spec))


def fp16_bytes_per_token(model: Any) -> int:
    """K and V of one position in every layer at 2 bytes a value."""
    c = model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2


def nudge_keys(cache: CausalCache, direction: str) -> None:
    """Move every key the model hands ``cache.attention`` by one float32 ulp, toward +inf
    ("up") or -inf ("down"), before the cache stores it: the size of rounding difference
    that numerically equivalent computations make (another summation order in a layer before),
    to show how far a codec's figures move with rounding alone (``--spread``)."""
    if direction not in ("up", "down"):
        raise ValueError(f"nudge direction {direction!r}: expected 'up' or 'down'")
    attend = cache.attention
    bound = math.inf if direction == "up" else -math.inf

    def nudged(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        return attend(layer, q, torch.nextafter(k, torch.full_like(k, bound)), v, **kw)

    cache.attention = nudged  # type: ignore[method-assign]  # Llama looks it up on the cache


def window_logprobs(
    model: Any, codec: str, tokens: list[int], nudge: str | None = None
) -> torch.Tensor:
    """Log-probabilities [SCORED, V] predicting the last SCORED tokens of one window (1024..2047
    of a 2048-token window) after a prefill of the others (with ``nudge``, the keys moved by one
    ulp that way: :func:`nudge_keys`)."""
    window = len(tokens)
    prefill = window - SCORED
    cache = make_cache(model, codec, window, max_batch=prefill)
    if nudge is not None:
        nudge_keys(cache, nudge)
    out = [
        model.forward(tokens[:prefill], Batch.single(0, 0, prefill), cache, outputs=[prefill - 1])
    ]
    for start in range(prefill, window - 1, CHUNK):
        n = min(CHUNK, window - 1 - start)
        out.append(model.forward(tokens[start : start + n], Batch.single(0, start, n), cache))
    cache.close()
    return torch.log_softmax(torch.cat(out).double(), dim=-1)  # rows predict prefill..window-1


def pressed_logprobs(
    model: Llama, codec: str, tokens: list[int], spec: str | Press, cap: float, every: int
) -> tuple[torch.Tensor, float, float]:
    """Log-probabilities [SCORED, V] of one window (its last SCORED tokens) decoded one token per
    step with the cache capped by a decode-time press (a spec, or a press object), the mean
    share of the history the cache held and its mean total compression (fp16
    bytes of the history / the bytes its cells hold, codes and windows included), both over
    the scored steps."""
    from kvcache.press import make_press, total_compression

    press = make_press(spec) if isinstance(spec, str) else spec
    if press.needs_model:  # snapout reads the output projections
        press.bind(model)
    window = len(tokens)
    prefill = window - SCORED
    cache = make_cache(model, codec, window, max_batch=prefill)
    held = compression = 0.0
    with press.observe(cache):
        batch = Batch.single(0, 0, prefill)
        out = [model.forward(tokens[:prefill], batch, cache, outputs=[prefill - 1])]
        for i in range(prefill, window - 1):
            pos = cache.next_position(0)  # a press that compacts moves the next position
            out.append(model.forward([tokens[i]], Batch.single(0, pos, 1), cache))
            if (i - prefill) % every == 0:  # the cap follows the history: i + 1 tokens
                press.during_decode(max_cells=int(cap * (i + 1)), every=1).step(cache, 0)
            held += len(cache.cells_of(0)) / (i + 1)
            compression += total_compression(cache, 0, i + 1)
    cache.close()
    steps = window - 1 - prefill
    return torch.log_softmax(torch.cat(out).double(), dim=-1), held / steps, compression / steps


def quality(
    lps: list[torch.Tensor], windows: list[list[int]], base: list[torch.Tensor]
) -> dict[str, float]:
    """Perplexity of the scored tokens, KL(fp32 || this) and top-1 agreement with fp32."""
    nll, kl, agree = 0.0, 0.0, 0
    for lp, win, ref in zip(lps, windows, base, strict=True):
        target = torch.tensor(win[len(win) - SCORED :])
        nll -= float(lp.gather(1, target[:, None]).sum())
        kl += float((ref.exp() * (ref - lp)).sum())
        agree += int((ref.argmax(-1) == lp.argmax(-1)).sum())
    n = len(lps) * SCORED
    return {"ppl": math.exp(nll / n), "kl": kl / n, "top1": agree / n}


def window_ppl(
    lps: list[torch.Tensor], windows: list[list[int]], base: list[torch.Tensor]
) -> list[float]:
    """Each window's perplexity alone (runs of different ``--window`` score the same tokens
    in some windows: a 4096-token window w scores what 2048-token window 2w + 1 does)."""
    return [quality([lp], [w], [b])["ppl"] for lp, w, b in zip(lps, windows, base, strict=True)]


def decode_pressing(
    args: argparse.Namespace,
    model: Llama,
    codecs: list[str],
    wins: list[list[int]],
    base: list[torch.Tensor],
) -> list[dict[str, Any]]:
    """One row per codec: every window under ``--press-decode`` (see the module docstring)."""
    rows = []
    for spec in args.press_decode:
        for codec in tqdm(codecs, desc=f"decode press {spec}", unit="codec"):
            runs = [pressed_logprobs(model, codec, win, spec, args.cap, args.every) for win in wins]
            rows.append(
                {
                    "codec": codec,
                    "press": spec,
                    "cap": args.cap,
                    "every": args.every,
                    "held_fraction": statistics.fmean(h for _, h, _ in runs),
                    "total_compression": statistics.fmean(c for _, _, c in runs),
                    **quality([lp for lp, _, _ in runs], wins, base),
                    "window_ppl": window_ppl([lp for lp, _, _ in runs], wins, base),
                }
            )
    return rows


def decode_speed(model: Any, codec: str, tokens: list[int], steps: int = 24) -> float:
    """Decode tokens/s after a 2048-token prefill: the median step of ``steps`` (after 3
    warm-up steps), so one slow step on a shared machine does not decide it."""
    cache = make_cache(model, codec, WINDOW + steps + 3)
    for start in range(0, WINDOW, PREFILL):
        model.forward(
            tokens[start : start + PREFILL],
            Batch.single(0, start, PREFILL),
            cache,
            outputs=[PREFILL - 1],
        )
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        model.forward([tokens[i]], Batch.single(0, WINDOW + i, 1), cache)
        times.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(times[3:])


def held_bytes(model: Llama, spec: str, n: int) -> int:
    """Bytes a cache of ``spec`` holds for one sequence of ``n`` tokens, all layers, K+V:
    codes, per-row metadata, the fp16 window of the newest rows, key centres. Measured on a
    real cache sized for it (random rows: the bytes do not depend on the values)."""
    c = model.config
    cache = CausalCache(n, max_batch=n, shift=model.rope, **parse(spec))
    cache.start_forward(Batch.single(0, 0, n))
    g = torch.Generator().manual_seed(0)
    for layer in range(c.num_layers):
        k, v = torch.randn(2, n, c.num_kv_heads, c.head_dim, generator=g)  # [n, H, D] each
        cache.put(layer, k, v)
    held = cache.memory_usage_bytes()
    cache.close()
    return held


def bytes_per_token(model: Any, spec: str) -> tuple[float, float | None]:
    """Bytes per token, all layers, K+V: (each further token's, i.e. codes and per-row
    metadata; everything held at a 2k context divided by 2048, fixed parts included: the
    fp16 window of the newest rows, key centres). Gemma 3: the codec's row bytes, None."""
    if isinstance(model, Gemma3):
        c = model.config
        row = sum(make_codec(spec, r).bytes_per_row(c.num_kv_heads, c.head_dim) for r in KV)
        return row * c.num_layers, None
    step = held_bytes(model, spec, 8192) - held_bytes(model, spec, 4096)  # fixed parts cancel
    return step / 4096, held_bytes(model, spec, WINDOW) / WINDOW


class Recorder:
    """Records each layer's queries and exact K/V of one forward (fp32 cache)."""

    def __init__(self, model: Llama) -> None:
        self.q: list[torch.Tensor] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        original = model._split_qkv  # every forward's q, k, v pass through it

        def split(qkv, cos, sin, rotate_keys=True):  # type: ignore[no-untyped-def]
            q, k, v = original(qkv, cos, sin, rotate_keys)
            assert rotate_keys, "the recording forward's fp32 cache takes keys after RoPE"
            self.q.append(q.clone())
            self.kv.append((k.clone(), v.clone()))
            return q, k, v

        self.model, self.original = model, original
        model._split_qkv = split  # type: ignore[method-assign]

    def close(self) -> None:
        self.model._split_qkv = self.original  # type: ignore[method-assign]


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
        cache = make_cache(model, codec, 512)  # pre- or post-RoPE storage like the cache's
        cache.start_forward(Batch.single(0, 0, 512))
        for layer, (q, (k, v)) in enumerate(zip(rec.q, rec.kv, strict=True)):
            cache.put(layer, k, v)  # read back as the codec gives it, keys rotated
            kq, vq = cache.read(layer, torch.from_numpy(cache.cells_of(0)))
            exact = _attend(q, k, v, mask, c.num_kv_heads)
            approx = _attend(q, kq, vq, mask, c.num_kv_heads)
            cos.append(float(torch.nn.functional.cosine_similarity(exact, approx, dim=-1).mean()))
        cache.close()
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
    parser.add_argument(
        "--model", choices=("smollm2", "gemma3"), default="smollm2", help="bundled model"
    )
    parser.add_argument("--codecs", nargs="*", default=None, help=f"subset of {CODECS}")
    parser.add_argument("--windows", type=int, default=None, help="windows (default 4; gemma3 2)")
    parser.add_argument(
        "--window",
        type=int,
        default=WINDOW,
        help=f"tokens per window (default {WINDOW}; up to SmolLM2's 8192): the last {SCORED} "
        "are scored, after a prefill of the others",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--press-decode",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="also run each codec with each of these kvcache.press specs capping the cache "
        "during decode",
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="also run each codec with the keys moved one float32 ulp up and down (3x the "
        "time): dppl_lo and dppl_hi show how far rounding alone moves its ΔPPL",
    )
    parser.add_argument(
        "--out",
        default="kv_quality",
        help="results name: benchmarks/results/OUT.json and OUT.png (default kv_quality)",
    )
    parser.add_argument(
        "--cap",
        type=float,
        default=0.25,
        help="with --press-decode: cells held / tokens seen (default 0.25)",
    )
    parser.add_argument(
        "--every",
        type=int,
        default=16,
        help="with --press-decode: decode steps between presses (default 16)",
    )
    args = parser.parse_args(argv)
    if args.press_decode and not 0 < args.cap < 1:
        parser.error(f"--cap {args.cap}: expected a fraction in (0, 1)")
    if args.press_decode and importlib.util.find_spec("kvcache.press") is None:
        parser.error("--press-decode needs kvcache.press, not in this checkout")
    gemma = args.model == "gemma3"
    if gemma and args.press_decode:
        parser.error("--press-decode: SmolLM2's (the presses run on its CausalCache)")
    model: Any = (
        Gemma3.from_gguf(gemma3_path(), weights="fp32")
        if gemma
        else Llama.from_gguf(weights="fp32")
    )
    if not WINDOW <= args.window <= model.config.context_length:
        parser.error(f"--window {args.window}: expected {WINDOW}..{model.config.context_length}")
    torch.set_num_threads(args.threads)
    codecs = args.codecs or (
        ["fp32", "int8", "int4", "turbo4"] if args.quick else GEMMA_CODECS if gemma else CODECS
    )
    if gemma and any(c != c.partition("@")[0].partition("/")[0] for c in codecs):
        parser.error("--codecs: single codec names on gemma3 (no KEY/VALUE, no @pre/@post)")
    if codecs[0] != "fp32":
        codecs = ["fp32", *[c for c in codecs if c != "fp32"]]
    windows, window = args.windows or (1 if args.quick else 2 if gemma else 4), args.window
    tokenizer = Tokenizer.from_gguf(gemma3_path() if gemma else None)
    if gemma:  # each window opens with BOS, as Gemma's prompts do
        body = window - 1
        tokens = license_tokens(tokenizer, windows * window)  # decode_speed reads 2048+
        wins = [[tokenizer.bos_id, *tokens[w * body : (w + 1) * body]] for w in range(windows)]
    else:
        tokens = license_tokens(tokenizer, windows * window)
        wins = [tokens[w * window : (w + 1) * window] for w in range(windows)]
    base: list[torch.Tensor] = []
    rows = []
    with torch.inference_mode():
        for codec in tqdm(codecs, desc="kv_quality", unit="codec"):
            lps = [window_logprobs(model, codec, win) for win in wins]
            if gemma:  # 262k-token vocabulary: float32 keeps two codecs' rows in memory
                lps = [lp.float() for lp in lps]
            base = base or lps  # fp32 comes first
            asym, at2k = bytes_per_token(model, codec)
            nudged: list[float] = []  # perplexities with the keys one ulp up and down
            if args.spread and codec != "fp32":
                for d in ("up", "down"):
                    nlps = [window_logprobs(model, codec, win, nudge=d) for win in wins]
                    nudged.append(quality(nlps, wins, base)["ppl"])
            rows.append(
                {
                    "codec": codec,
                    **quality(lps, wins, base),
                    "window_ppl": window_ppl(lps, wins, base),
                    "ppl_nudged": nudged,
                    "bytes_per_token": asym,
                    "bytes_per_token_2k": at2k,
                    "decode_tok_s_2k": decode_speed(model, codec, tokens),
                }
            )
        pressed = decode_pressing(args, model, codecs, wins, base) if args.press_decode else []
        cosines = {} if gemma else attention_cosines(model, tokens, codecs)
    fp32, fp16_bytes = rows[0], fp16_bytes_per_token(model)
    for r in rows:
        r["dppl_pct"] = 100 * (r["ppl"] / fp32["ppl"] - 1)
        spread = [100 * (p / fp32["ppl"] - 1) for p in r["ppl_nudged"]] + [r["dppl_pct"]]
        r["dppl_lo"], r["dppl_hi"] = min(spread), max(spread)
        r["vs_fp16_bytes"] = fp16_bytes / r["bytes_per_token"]
        at2k = r["bytes_per_token_2k"]
        r["vs_fp16_bytes_2k"] = None if at2k is None else fp16_bytes / at2k
        r["decode_vs_fp32"] = r["decode_tok_s_2k"] / fp32["decode_tok_s_2k"]
        layers = cosines.get(r["codec"])
        r["attn_cos_min"] = min(layers) if layers else None
        r["attn_cos_mean"] = sum(layers) / len(layers) if layers else None
    cols = [
        "codec",
        *QUALITY_COLS[:2],
        *(["dppl_lo", "dppl_hi"] if args.spread else []),
        *QUALITY_COLS[2:],
        "bytes_per_token",
        "vs_fp16_bytes",
        "bytes_per_token_2k",
        "vs_fp16_bytes_2k",
        "decode_tok_s_2k",
        "decode_vs_fp32",
        "attn_cos_mean",
        "attn_cos_min",
    ]
    print(table(rows, cols))
    for r in pressed:
        r["dppl_pct"] = 100 * (r["ppl"] / fp32["ppl"] - 1)
    if pressed:
        cols = ["codec", "press", "cap", "every", "held_fraction", "total_compression"]
        print(table(pressed, [*cols, *QUALITY_COLS]))
        for r in pressed:
            met = "met" if r["dppl_pct"] <= DECODE_PRESS_GOAL else "missed"
            if r["cap"] > DECODE_PRESS_CAP:  # more of the history held than the goal allows
                met = "no verdict"
            print(
                f"[{met}] {r['codec']} + {r['press']} capped at {r['cap']:g} of the history "
                f"({r['total_compression']:.2f}x total compression): ΔPPL {r['dppl_pct']:+.2f}% "
                f"(goal: <= {DECODE_PRESS_GOAL:g}% at 1/4)"
            )
    write_json(
        args.out,
        {
            "windows": windows,
            "model": args.model,
            "window": window,
            "scored_tokens": windows * SCORED,
            "rows": rows,
            "attention_cosine_per_layer": cosines,
            "decode_pressing": pressed,
        },
    )
    if len(rows) > 1 or not pressed:
        title = "Gemma 3 270M" if gemma else "SmolLM2-135M"
        plot(
            args.out,
            lambda fig, ax: _draw(ax, rows, windows, title, fp16_bytes),
            figsize=(8, 5),
            dpi=120,
        )
    if pressed:  # beside the codecs' plot, or instead of it (the fp32 row alone shows nothing)
        name = f"{args.out}_press" if len(rows) > 1 else args.out
        ppl = float(fp32["ppl"])
        plot(name, lambda fig, ax: _draw_pressed(ax, pressed, ppl, window), figsize=(8, 5), dpi=120)
    return 0


def _draw_pressed(ax: Any, pressed: list[dict[str, Any]], ppl: float, window: int) -> None:
    """ΔPPL of each codec + decode-time press, bars labelled with their total compression,
    with the issue's goal as a line."""
    ranked = sorted(pressed, key=lambda r: float(r["dppl_pct"]))
    labels = [f"{r['press']}\n{r['codec']}" for r in ranked]
    bars = ax.bar(labels, [float(r["dppl_pct"]) for r in ranked], color="tab:blue")
    ax.bar_label(bars, [f"{float(r['total_compression']):.2f}x" for r in ranked], fontsize=7)
    ax.axhline(DECODE_PRESS_GOAL, color="black", ls="--", lw=1, label="goal (at 1/4)")
    cap = float(ranked[0]["cap"]) if ranked else 0.0
    ax.set(
        ylabel=f"ΔPPL % vs the unpressed cache (PPL {ppl:.1f})",
        title=f"SmolLM2-135M, decode-time pressing to {cap:g} of the history\n"
        f"({window}-token windows, the last {SCORED} scored; labels: total compression)",
    )
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    ax.grid(alpha=0.3, axis="y")


def _label(codec: str) -> str:
    return (
        codec.replace(":key_bits=4,value_bits=4", " even")
        .replace(":key_bits=3,value_bits=3", " even")
        .replace(":recent=0", " no-window")
    )


def _draw(ax: Any, rows: list[dict[str, Any]], windows: int, title: str, fp16: int) -> None:
    """KL vs fp32 (log) against stored bits per value; labels give ΔPPL and decode speed."""
    points = [r for r in rows if r["codec"] != "fp32"]
    for i, r in enumerate(sorted(points, key=lambda r: float(r["kl"]))):
        x, y = float(r["bytes_per_token"]) * 16 / fp16, float(r["kl"])
        ax.scatter(x, y, s=18)
        text = f"{_label(str(r['codec']))}: {float(r['dppl_pct']):+.2f}%, "
        text += f"{float(r['decode_tok_s_2k']):.1f} tok/s"
        ax.annotate(
            text, (x, y), xytext=(6, -8 if i % 2 else 4), textcoords="offset points", fontsize=7
        )
    ax.set(
        xlabel="bits per stored value (codes + per-row metadata)",
        ylabel=f"KL(fp32 || codec), next-token, mean over {windows * 1024} tokens",
        yscale="log",
        xlim=(1.5, 20),
        title=f"{title} K/V codecs (labels: ΔPPL vs fp32 cache, decode tok/s at 2k)",
    )
    ax.grid(alpha=0.3)


if __name__ == "__main__":
    sys.exit(main())

"""Gemma 3 270M up to its full 32k context: K/V bytes held against a full-size sliding-window
cache, and decode speed, per context length.

One sequence per length (the Debian license texts as the prompt, BOS first; a length past
the context less ``--decode`` is cut to it, so 32768 fills the model's whole context),
prefilled in chunks of ``--chunk`` as ``kvcache generate --model gemma3`` does, then
``--decode`` greedy tokens, on the model's wrapper cache: its 15 sliding layers keep a
window (512) plus a chunk, its 3 global layers every position. Reported per length and codec:

- bytes the cache holds (``held_bytes``, both parts) and allocates (``memory_usage_bytes``);
- the same codec in a full-size sliding-window cache (every layer holds every position:
  what llama.cpp keeps by default, "using full-size SWA cache"), computed from the global
  part's bytes per layer and position; and llama.cpp's f16 full-size figure
  (layers x positions x (K + V) x head_dim x 2 bytes);
- prefill seconds and decode tokens/s (the median step's).

    python benchmarks/gemma_long.py                          # 1k 4k 8k 16k 32k, fp16 K/V
    python benchmarks/gemma_long.py --lengths 1024 4096 --codecs fp16 kivi4

Goal: at the longest length, bytes held <= 1/3 of the full-size cache's. Writes
benchmarks/results/gemma_long.json and gemma_long.png (bytes and tok/s against context).
Run it on a quiet machine: 32k takes a few minutes of prefill.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import torch

from common import license_tokens
from harness import plot, table, write_json
from kvcache.generate import DecodeStats, GenerationConfig, load_model, stream_tokens

LENGTHS = (1024, 4096, 8192, 16384, 32768)
HELD_GOAL = 1 / 3  # bytes held / a full-size sliding-window cache's, at the longest length
MIB = 2**20


def measure(model: Any, prompt: list[int], codec: str, args: argparse.Namespace) -> dict:
    n = len(prompt)
    cache = model.new_cache(n + args.decode, codec=codec, max_batch=args.chunk)
    try:
        stats, ends = DecodeStats(), []  # ends: when each forward finished

        def ended(batch: Any) -> None:
            ends.append(time.perf_counter())

        config = GenerationConfig(max_new_tokens=args.decode, ignore_eos=True)
        run = stream_tokens(
            model, cache, prompt, config, chunk=args.chunk, stats=stats, on_forward=ended
        )
        tokens = list(run)
        assert len(tokens) == args.decode, len(tokens)
        steps = [b - a for a, b in itertools.pairwise(ends[-args.decode :])]  # decode forwards
        local, full = cache.local, cache.full
        held_local, held_full = local.held_bytes(0), full.held_bytes(0)
        positions = len(full.cells_of(0))
        layers = model.config.num_layers
        global_layers = len(full.storage.layers)
        full_size = held_full / global_layers * layers  # every layer holding every position
        c = model.config
        llama_f16 = layers * positions * c.num_kv_heads * c.head_dim * 2 * 2  # K and V, f16
        return {
            "tokens": n,
            "codec": codec,
            "positions": positions,
            "local_cells": len(local.cells_of(0)),
            "held_mib": (held_local + held_full) / MIB,
            "allocated_mib": cache.memory_usage_bytes() / MIB,
            "full_size_mib": full_size / MIB,
            "llama_f16_full_mib": llama_f16 / MIB,
            "held_vs_full_size": (held_local + held_full) / full_size,
            "prefill_s": stats.prefill_seconds,
            "decode_tok_s": 1 / statistics.median(steps),  # one slow step does not decide it
        }
    finally:
        cache.close()


def draw(fig: Any, axes: Any, rows: list[dict[str, Any]]) -> None:
    """Left: MiB held and allocated, and the full-size cache's; right: decode tok/s."""
    bytes_ax, rate_ax = axes
    for codec in dict.fromkeys(r["codec"] for r in rows):
        mine = [r for r in rows if r["codec"] == codec]
        x = [r["tokens"] for r in mine]
        bytes_ax.plot(x, [r["held_mib"] for r in mine], "o-", label=f"{codec}: held")
        bytes_ax.plot(x, [r["allocated_mib"] for r in mine], "x:", label=f"{codec}: allocated")
        bytes_ax.plot(x, [r["full_size_mib"] for r in mine], "s--", label=f"{codec}: full-size")
        rate_ax.plot(x, [r["decode_tok_s"] for r in mine], "o-", label=codec)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.legend()
    bytes_ax.set_yscale("log")
    bytes_ax.set_ylabel("K/V MiB")
    bytes_ax.set_title("Gemma 3 270M: K/V bytes against context")
    rate_ax.set_ylabel("decode tokens/s")
    rate_ax.set_title("decode speed")
    fig.suptitle("sliding layers keep a window; a full-size cache keeps every position")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--codecs", nargs="+", default=["fp16"], help="K/V codecs (fp16)")
    parser.add_argument("--decode", type=int, default=32, help="greedy tokens decoded (32)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens (512)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    parser.add_argument("--weights", default="native", help="native | fp32 | bf16 (native)")
    parser.add_argument("--name", default="gemma_long", help="result name (gemma_long)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("gemma3", weights=args.weights)
    room = model.config.context_length - args.decode  # 32k: the prompt leaves room to decode
    if min(args.lengths) < 1 or args.decode < 1 or room < 1:
        parser.error("--lengths and --decode: positive, within the model's context")
    args.lengths = sorted({min(n, room) for n in args.lengths})
    longest = max(args.lengths)
    ids = [tokenizer.bos_id, *license_tokens(tokenizer, longest - 1)]
    rows = []
    for n in args.lengths:
        for codec in args.codecs:
            rows.append(measure(model, ids[:n], codec, args))
            print(f"{codec} {n}: {rows[-1]['decode_tok_s']:.1f} tok/s", flush=True)
    columns = [
        "tokens",
        "codec",
        "local_cells",
        "held_mib",
        "allocated_mib",
        "full_size_mib",
        "llama_f16_full_mib",
        "held_vs_full_size",
        "prefill_s",
        "decode_tok_s",
    ]
    print(table(rows, columns))
    last = [r for r in rows if r["tokens"] == longest]
    worst = max(r["held_vs_full_size"] for r in last)
    goals = {"held_vs_full_size": {"value": worst, "goal": HELD_GOAL, "met": worst <= HELD_GOAL}}
    print(f"held / full-size at {longest}: {worst:.3f} (goal <= {HELD_GOAL:.3f}) "
          f"{'met' if worst <= HELD_GOAL else 'NOT met'}")  # fmt: skip
    write_json(args.name, {"args": vars(args), "rows": rows, "goals": goals})
    if not args.no_plot:
        plot(args.name, lambda fig, ax: draw(fig, ax, rows), figsize=(12.0, 4.5), ncols=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

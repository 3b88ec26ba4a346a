"""What sealing costs a decode step: sequences of staggered lengths, per codec, side by side.

A quantizing codec keeps each sequence's newest rows in fp16 and encodes ("seals") 32 of a
sequence's rows at once (``kvcache.recent``). When the batch's sequences have the same length
they all seal on one step in 32; under continuous batching their lengths differ, and some
sequence seals on most steps: each of those steps pays one encode per layer and K/V. This
benchmark times ``CausalCache.attention`` decode steps (SmolLM2-135M's 30 layers, 3 KV heads
of 64, 9 query heads; random K/V; store + attend, the cache's whole share of a step) for B
sequences of C tokens, lengths aligned (all C) or staggered (C + i for sequence i), with the
codecs' encoders in C++ (``kvcache.kernels.encode``) and, in turn every 2 steps in the same
process, with their torch expressions (``KVCACHE_ENCODE=reference``); the codecs' caches
take one step each in turn. Reports the mean step (every step counts: the seal steps are the
point) and each codec's ratio to fp32 over the same rounds, then writes
benchmarks/results/seal_cost.json and seal_cost.png.

    python benchmarks/seal_cost.py                       # 16 x 1024, fp32 int8 int4 kivi4 turbo4
    python benchmarks/seal_cost.py --codecs fp32 int4 --batch 4 --context 256 --steps 32

Run it on a quiet machine; the ratios come from one process, the milliseconds do not travel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import harness
from harness import plot, table, take_turns, write_json
from kvcache import Batch, CausalCache
from kvcache.kernels.encode import ENCODE_ENV
from kvcache.models.rope import Rope

LAYERS, KV_HEADS, Q_HEADS, DIM = 30, 3, 9, 64
MODES = ("kernel", "reference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--codecs", nargs="+", default=["fp32", "int8", "int4", "kivi4", "turbo4"])
    p.add_argument("--batch", type=int, default=16, help="sequences decoding together")
    p.add_argument("--context", type=int, default=1024, help="tokens of the shortest prompt")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per layout")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=None, help="folder of the json and png (results/)")
    return p.parse_args(argv)


def new_cache(codec: str, lengths: list[int], steps: int) -> CausalCache:
    """A cache holding ``lengths`` prompts of random K/V, room for ``steps`` + 2 more rows
    per sequence."""
    b = len(lengths)
    cache = CausalCache(
        sum(lengths) + b * (steps + 8),
        max_sequences=b,
        max_batch=max(lengths),
        shift=Rope(DIM, 100000.0),
        codec=codec,
    )
    g = torch.Generator().manual_seed(0)
    for s, n in enumerate(lengths):
        cache.start_forward(Batch.single(s, 0, n))
        for layer in range(LAYERS):
            cache.put(layer, *torch.randn(2, n, KV_HEADS, DIM, generator=g))
    return cache


def step_times(
    codecs: list[str], lengths: list[int], steps: int
) -> dict[str, dict[str, list[float]]]:
    """Seconds of each decode step of ``lengths`` sequences, per codec and encoder mode: the
    codecs step in turn, and the modes take turns every 2 steps, so all of them see the same
    seals and the same minutes of the machine."""
    b = len(lengths)
    caches = {c: new_cache(c, lengths, steps) for c in codecs}
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, Q_HEADS, DIM, generator=g)
    k, v = torch.randn(2, b, KV_HEADS, DIM, generator=g)
    step = [0]  # the round now (its positions), from before_round

    def set_round(i: int) -> None:
        step[0] = i
        os.environ[ENCODE_ENV] = MODES[(i // 2) % 2]  # the modes take turns every 2 steps

    def decode_step(cache: CausalCache) -> Callable[[], float]:
        def seconds() -> float:
            cache.start_forward(Batch([n + step[0] for n in lengths], list(range(b))))
            start = time.perf_counter()
            for layer in range(LAYERS):
                cache.attention(layer, q, k, v)
            return time.perf_counter() - start

        return seconds

    before = os.environ.get(ENCODE_ENV)
    try:  # the codecs step in turn, in the same order every step; the first 2: warm-up
        contenders = {c: decode_step(cache) for c, cache in caches.items()}
        steps_of = take_turns(contenders, steps, warm=2, rotate=False, before_round=set_round)
    finally:
        if before is None:
            os.environ.pop(ENCODE_ENV, None)
        else:
            os.environ[ENCODE_ENV] = before
        for cache in caches.values():
            cache.close()
    modes = [MODES[(i // 2) % 2] for i in range(2, steps + 2)]
    return {
        c: {m: [t for t, mode in zip(ts, modes, strict=True) if mode == m] for m in MODES}
        for c, ts in steps_of.items()
    }


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    torch.set_num_threads(args.threads)
    layouts = {
        "aligned": [args.context] * args.batch,
        "staggered": [args.context + i for i in range(args.batch)],
    }
    rows: list[dict[str, object]] = []
    for layout in tqdm(layouts, desc="layouts", unit="layout"):
        t = step_times(args.codecs, layouts[layout], args.steps)
        for codec in args.codecs:
            row: dict[str, object] = {"layout": layout, "codec": codec}
            for m in MODES:
                row[f"{m}_ms"] = statistics.mean(t[codec][m]) * 1e3
            row["kernel_vs_reference"] = float(row["kernel_ms"]) / float(row["reference_ms"])  # type: ignore[arg-type]
            if "fp32" in t:  # against fp32's steps of the same rounds (kernel encoders)
                row["vs_fp32"] = statistics.mean(t["fp32"]["kernel"]) / statistics.mean(
                    t[codec]["kernel"]
                )
            rows.append(row)
    return rows


def draw(ax: Any, rows: list[dict[str, object]]) -> None:
    codecs = list(dict.fromkeys(str(r["codec"]) for r in rows))
    width = 0.2
    bars = [("aligned", "kernel"), ("staggered", "kernel"), ("staggered", "reference")]
    for i, (layout, mode) in enumerate(bars):
        ys = [
            next((float(r[f"{mode}_ms"]) for r in rows  # type: ignore[arg-type]
                  if r["codec"] == c and r["layout"] == layout), 0.0)
            for c in codecs
        ]  # fmt: skip
        xs = [j + (i - 1) * width for j in range(len(codecs))]
        ax.bar(xs, ys, width, label=f"{layout}, {mode} encoders")
    ax.set_xticks(range(len(codecs)), codecs)
    ax.set_ylabel("mean decode step, ms (store + attention, 30 layers)")
    ax.set_title("Sealing cost per decode step")
    ax.legend()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run(args)
    cols = ["layout", "codec", "kernel_ms", "reference_ms", "kernel_vs_reference", "vs_fp32"]
    print(table(rows, cols))
    out = args.out or harness.RESULTS
    payload = {"batch": args.batch, "context": args.context, "steps": args.steps, "rows": rows}
    write_json(out / "seal_cost.json", payload)
    plot(out / "seal_cost.png", lambda fig, ax: draw(ax, rows), figsize=(7, 4), dpi=120)


if __name__ == "__main__":
    main()

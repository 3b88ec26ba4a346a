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
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, table  # noqa: E402
from kvcache import Batch, CausalCache  # noqa: E402
from kvcache.kernels.encode import ENCODE_ENV  # noqa: E402
from kvcache.models.rope import Rope  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, DIM = 30, 3, 9, 64
MODES = ("kernel", "reference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--codecs", nargs="+", default=["fp32", "int8", "int4", "kivi4", "turbo4"])
    p.add_argument("--batch", type=int, default=16, help="sequences decoding together")
    p.add_argument("--context", type=int, default=1024, help="tokens of the shortest prompt")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per layout")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=RESULTS, help="folder of the json and png")
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
    times: dict[str, dict[str, list[float]]] = {c: {m: [] for m in MODES} for c in codecs}
    before = os.environ.get(ENCODE_ENV)
    try:
        for i in range(steps + 2):  # the first 2: warm-up
            mode = MODES[(i // 2) % 2]
            os.environ[ENCODE_ENV] = mode
            for codec, cache in caches.items():
                cache.start_forward(Batch([n + i for n in lengths], list(range(b))))
                start = time.perf_counter()
                for layer in range(LAYERS):
                    cache.attention(layer, q, k, v)
                if i >= 2:
                    times[codec][mode].append(time.perf_counter() - start)
    finally:
        if before is None:
            os.environ.pop(ENCODE_ENV, None)
        else:
            os.environ[ENCODE_ENV] = before
        for cache in caches.values():
            cache.close()
    return times


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


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = list(dict.fromkeys(str(r["codec"]) for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run(args)
    cols = ["layout", "codec", "kernel_ms", "reference_ms", "kernel_vs_reference", "vs_fp32"]
    print(table(rows, cols))
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "batch": args.batch, "context": args.context,
               "steps": args.steps, "rows": rows}  # fmt: skip
    (args.out / "seal_cost.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(rows, args.out / "seal_cost.png")


if __name__ == "__main__":
    main()

"""Cost of one decode step's cache work: ours vs transformers' DynamicCache, side by side.

One step = start_forward + put + get for every layer of a 30-layer, 3-kv-head, 64-dim
model (SmolLM2-135M's shape), one new token per sequence, after a history of H tokens per
sequence. DynamicCache's step = ``update`` for every layer (it concatenates the history)
plus building the boolean causal mask the attention reads. Both run in this process, one
after the other, on the same thread count. Prints a table, writes
benchmarks/results/cache_step.json and, with matplotlib, cache_step.png.

    python benchmarks/cache_step.py            # histories 128, 1k, 4k, 16k; 1 and 8 seqs
    python benchmarks/cache_step.py --quick    # histories 128, 1k
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

import torch
from tqdm import tqdm

from harness import median_seconds, plot, table, write_json
from kvcache import Batch, CausalCache

LAYERS, HEADS, DIM = 30, 3, 64


def ours_step_seconds(history: int, seqs: int, repeats: int) -> tuple[float, bool]:
    """Median step time of our cache; also whether storage stayed in place (no copy)."""
    cache = CausalCache(history + repeats + 8, max_sequences=seqs, max_batch=history)
    kv = torch.randn(history, HEADS, DIM)  # one prefill chunk reused for every layer
    for s in range(seqs):
        cache.start_forward(Batch.single(s, 0, history))
        for layer in range(LAYERS):
            cache.put(layer, kv, kv)
    new = torch.randn(seqs, HEADS, DIM)  # new: [S, H, D], one token per sequence
    pos = [history]
    ptr = cache.storage.layers[0].keys.data.data_ptr()

    def step() -> None:
        cache.start_forward(Batch([pos[0]] * seqs, list(range(seqs))))
        for layer in range(LAYERS):
            cache.update(layer, new, new)
        pos[0] += 1

    t = median_seconds(step, repeats)
    in_place = cache.storage.layers[0].keys.data.data_ptr() == ptr
    cache.close()
    return t, in_place


def dynamic_step_seconds(history: int, seqs: int, repeats: int) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    kv = torch.randn(seqs, HEADS, history, DIM)  # HF layout [B, H, T, D]
    for layer in range(LAYERS):
        cache.update(kv, kv, layer)
    new = torch.randn(seqs, HEADS, 1, DIM)
    pos = [history]

    def step() -> None:
        for layer in range(LAYERS):
            k, _ = cache.update(new, new, layer)
        keys = torch.arange(k.shape[2])
        _ = (keys[None, :] <= torch.tensor([pos[0]])[:, None])[None, None].expand(seqs, 1, 1, -1)
        pos[0] += 1

    return median_seconds(step, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="histories 128 and 1k only")
    parser.add_argument("--repeats", type=int, default=20, help="measured steps per point")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    histories = [128, 1024] if args.quick else [128, 1024, 4096, 16384]
    rows = []
    points = [(h, s) for s in (1, 8) for h in histories]
    for history, seqs in tqdm(points, desc="cache_step", unit="point"):
        repeats = max(3, args.repeats // (4 if history * seqs >= 32768 else 1))
        ours, in_place = ours_step_seconds(history, seqs, repeats)
        gc.collect()
        dyn = dynamic_step_seconds(history, seqs, repeats)
        gc.collect()
        row_bytes = LAYERS * 2 * HEADS * DIM * 4
        rows.append(
            {
                "history": history,
                "seqs": seqs,
                "ours_ms": ours * 1e3,
                "dynamic_ms": dyn * 1e3,
                "speedup": dyn / ours,
                "ours_bytes_written": seqs * row_bytes,
                "dynamic_bytes_copied": seqs * (history + 1) * row_bytes,
                "storage_in_place": in_place,
            }
        )
    cols = [
        "history",
        "seqs",
        "ours_ms",
        "dynamic_ms",
        "speedup",
        "ours_bytes_written",
        "dynamic_bytes_copied",
        "storage_in_place",
    ]
    print(table(rows, cols))
    write_json("cache_step", {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "rows": rows})
    plot("cache_step", lambda fig, ax: _draw(ax, rows), figsize=(6, 4), dpi=120)
    return 0


def _draw(ax: Any, rows: list[dict[str, object]]) -> None:
    for seqs, style in ((1, "-"), (8, "--")):
        sel = [r for r in rows if r["seqs"] == seqs]
        hs = [r["history"] for r in sel]
        ax.plot(hs, [r["ours_ms"] for r in sel], "o" + style, label=f"kvcache, {seqs} seq")
        ax.plot(hs, [r["dynamic_ms"] for r in sel], "s" + style, label=f"DynamicCache, {seqs} seq")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="history tokens per sequence",
        ylabel="ms per decode step (30 layers)",
        title="Cache work per decode step",
    )
    ax.legend()


if __name__ == "__main__":
    sys.exit(main())

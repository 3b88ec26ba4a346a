"""Sequence snapshots on SmolLM2-135M: restoring a prompt's K/V from a file vs computing it.

One run measures side by side, per prompt length and codec (bundled SmolLM2-135M, weights as
stored as ``kvcache generate`` loads them, ``--threads`` torch threads; prompt = the first N
tokens of the Debian license texts):

1. recompute: the prompt's prefill into an empty cache, in chunks of ``--chunk`` tokens
   (what ``kvcache generate`` and the engine do), median of ``--repeats``.
2. restore, warm: ``Snapshot.load(file)`` (SHA-256 checked) + ``cache.restore`` into an empty
   cache, the file in the page cache; median of ``--repeats``.
3. restore, cold: the same after ``os.posix_fadvise(DONTNEED)`` dropped the file's pages
   (after an fsync), so the bytes come from the disk; median of ``--repeats``.
4. exactness: one decode step after the restore gives the same logits (torch.equal) as one
   after the recompute.
5. size: the file's bytes against (a) what the cache stores for the sequence (encoded rows at
   the codec's bytes per row, the fp16 recent-window rows, metadata records) and (b) the
   codec's bytes per token times the tokens (every row encoded: what a long sequence tends to).

Goals: restore >= 20x faster than recompute at 4k (warm); file within 1 % of the
codec's bytes (a: the stored bytes; b is reported, the fp16 window makes it larger at 1k).

    python benchmarks/snapshots.py             # 1k and 4k; fp32 int8 int4 kivi4 turbo4
    python benchmarks/snapshots.py --quick     # 256 and 512 tokens, fp32 and turbo4, 1 repeat

Run it on a quiet machine. Writes benchmarks/results/snapshots.json (``--quick``:
snapshots_quick.json) and the PNG beside it: seconds per prompt, recompute vs restore.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common import license_tokens
from harness import plot, table, write_json
from kvcache import Batch, CausalCache
from kvcache.models.llama import Llama
from kvcache.snapshot import Snapshot
from kvcache.text.tokenizer import Tokenizer

CODECS = ("fp32", "int8", "int4", "kivi4", "turbo4")
RESTORE_GOAL = 20.0  # restore (warm) vs recompute at the longest prompt
SIZE_GOAL = 0.01  # |file / stored bytes - 1|
PRESETS: dict[str, dict[str, Any]] = {
    "full": {"lengths": (1024, 4096), "codecs": CODECS, "repeats": 3},
    "quick": {"lengths": (256, 512), "codecs": ("fp32", "turbo4"), "repeats": 1},
}


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median seconds of ``fn`` over ``repeats`` runs, and its last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def prefill(model: Llama, codec: str, prompt: list[int], chunk: int) -> CausalCache:
    cache = model.new_cache(len(prompt) + 8, codec=codec, max_batch=chunk)
    for start in range(0, len(prompt), chunk):
        part = prompt[start : start + chunk]
        last = [len(part) - 1] if start + chunk >= len(prompt) else []
        model.forward(part, Batch.single(0, start, len(part)), cache, outputs=last)
    return cache


def restore(model: Llama, codec: str, path: Path, n: int) -> CausalCache:
    cache = model.new_cache(n + 8, codec=codec)
    cache.restore(Snapshot.load(path), 0, model_id=model.model_id)
    return cache


def drop_pages(path: Path) -> None:
    """Make the next read of ``path`` come from the disk (its dirty pages written first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def stored_bytes(cache: CausalCache) -> int:
    """Bytes the cache holds for sequence 0, from its buffers' row formats: encoded rows,
    fp16 window rows and the metadata records its rows use (every layer, K and V)."""
    cells = cache.cells_of(0)
    total = 0
    for st in cache.storage.layers.values():
        for codec, buf in ((cache.key_codec, st.keys), (cache.value_codec, st.values)):
            windows = cache.storage.windows_of(codec)
            opened = 0 if windows is None else int(windows.open[cells].sum())
            metas = set() if windows is None else set(windows.meta_of[cells].tolist()) - {-1}
            if windows is not None and 0 in windows.seq_meta:
                metas.add(windows.seq_meta[0])
            formats = buf.row_formats(len(cells) - opened, opened, len(metas))
            for dtype, shape in formats.values():
                total += math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return total


def measure(
    model: Llama, prompt: list[int], codec: str, args: argparse.Namespace, folder: Path
) -> dict[str, Any]:
    n = len(prompt)
    recompute_s, source = timed(lambda: prefill(model, codec, prompt, args.chunk), args.repeats)
    assert isinstance(source, CausalCache)
    path = folder / f"{codec}-{n}.safetensors"
    source.snapshot(0, model_id=model.model_id, tokens=prompt).save(path)
    restore(model, codec, path, n)  # warm the page cache and the code paths
    warm_s, target = timed(lambda: restore(model, codec, path, n), args.repeats)
    assert isinstance(target, CausalCache)

    def cold() -> CausalCache:
        drop_pages(path)
        return restore(model, codec, path, n)

    cold_s, _ = timed(cold, args.repeats)
    stored = stored_bytes(target)  # before the probe below adds a cell
    probe = [prompt[-1]]
    same = torch.equal(
        model.forward(probe, Batch.single(0, n, 1), source),
        model.forward(probe, Batch.single(0, n, 1), target),
    )
    size = path.stat().st_size
    k_row = source.key_codec.bytes_per_row(*source.storage.layers[0].key_shape)
    v_row = source.value_codec.bytes_per_row(*source.storage.layers[0].value_shape)
    per_token = (k_row + v_row) * len(source.storage.layers)
    return {
        "tokens": n,
        "codec": codec,
        "recompute_s": recompute_s,
        "restore_warm_s": warm_s,
        "restore_cold_s": cold_s,
        "speedup_warm": recompute_s / warm_s,
        "speedup_cold": recompute_s / cold_s,
        "same_logits": same,
        "file_bytes": size,
        "stored_bytes": stored,
        "file_vs_stored": size / stored,
        "codec_bytes": int(per_token * n),
        "file_vs_codec": size / (per_token * n),
    }


def draw(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Seconds per prompt: recompute, restore from the page cache, restore from the disk."""
    labels = [f"{r['codec']}\n{r['tokens']}" for r in rows]
    x = range(len(rows))
    width = 0.27
    for i, (key, name) in enumerate(
        (("recompute_s", "recompute"), ("restore_warm_s", "restore (page cache)"),
         ("restore_cold_s", "restore (cold read)"))
    ):  # fmt: skip
        ax.bar([j + (i - 1) * width for j in x], [r[key] for r in rows], width, label=name)
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per prompt")
    ax.set_title("SmolLM2-135M: restoring a prompt's K/V vs computing it")
    ax.legend()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="256 and 512 tokens, 2 codecs")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt tokens")
    parser.add_argument("--codecs", nargs="+", default=None, help=f"codecs ({' '.join(CODECS)})")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs each (3; quick 1)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens (512)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    args.lengths = args.lengths or preset["lengths"]
    args.codecs = args.codecs or preset["codecs"]
    args.repeats = args.repeats or preset["repeats"]
    torch.set_num_threads(args.threads)
    model = Llama.from_gguf()
    ids = license_tokens(Tokenizer.from_gguf(), max(args.lengths))
    rows = []
    here = Path(__file__).resolve().parent  # on the disk: /tmp may be RAM, never read cold
    with tempfile.TemporaryDirectory(prefix="snapshots-", dir=here) as tmp:
        for n in args.lengths:
            for codec in args.codecs:
                rows.append(measure(model, ids[:n], codec, args, Path(tmp)))
                print(f"{codec} {n}: done", flush=True)
    columns = [
        "tokens",
        "codec",
        "recompute_s",
        "restore_warm_s",
        "restore_cold_s",
        "speedup_warm",
        "speedup_cold",
        "same_logits",
        "file_vs_stored",
        "file_vs_codec",
    ]
    print(table(rows, columns))
    longest = [r for r in rows if r["tokens"] == max(args.lengths)]
    goals = {
        "restore_speedup": {
            "value": min(r["speedup_warm"] for r in longest),
            "goal": RESTORE_GOAL,
            "met": all(r["speedup_warm"] >= RESTORE_GOAL for r in longest),
        },
        "file_size": {
            "value": max(abs(r["file_vs_stored"] - 1) for r in rows),
            "goal": SIZE_GOAL,
            "met": all(abs(r["file_vs_stored"] - 1) <= SIZE_GOAL for r in rows),
        },
        "exact": {"value": all(r["same_logits"] for r in rows), "goal": True, "met": True},
    }
    goals["exact"]["met"] = goals["exact"]["value"]
    for name, g in goals.items():
        print(f"{name}: {g['value']} (goal {g['goal']}) {'met' if g['met'] else 'NOT met'}")
    name = "snapshots_quick" if args.quick else "snapshots"
    write_json(name, {"args": vars(args), "rows": rows, "goals": goals})
    if not args.no_plot:
        plot(name, lambda fig, ax: draw(ax, rows), figsize=(max(6, len(rows) * 0.9), 4))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

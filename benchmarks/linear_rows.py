"""Decode-sized linear layers: ``kvcache.kernels.linear`` against ``F.linear``, side by side.

Every weight shape of a SmolLM2-135M and a Whisper tiny.en decode step, at 1 to 64 input rows
(one row per sequence decoded together), timed in one process, interleaved call by call. It
reports milliseconds, the kernel's speedup over torch (the median of per-round ratios), the
weight read rate against the machine's read bandwidth (a plain sum over 400 MB, same run),
and which rows ``linear`` sends to the kernel (``MAX_ROWS``): the crossover this table shows
is where that constant comes from.

    python benchmarks/linear_rows.py            # median of 20 calls per cell, PNG beside
    python benchmarks/linear_rows.py --quick
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import torch.nn.functional as F

from harness import paired_ratio, plot, read_bandwidth, table, take_turns, timed, write_json
from kvcache.kernels.build import extension
from kvcache.kernels.linear import MAX_ROWS

# (model, weight, out features, in features)
SHAPES = [
    ("smollm2", "lm_head", 49152, 576),
    ("smollm2", "w_gate_up", 3072, 576),
    ("smollm2", "w_down", 576, 1536),
    ("smollm2", "wqkv", 960, 576),
    ("smollm2", "wo", 576, 576),
    ("whisper", "token_emb (LM head)", 51864, 384),
    ("whisper", "qkv", 1152, 384),
    ("whisper", "fc1", 1536, 384),
    ("whisper", "fc2", 384, 1536),
]
ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
COLUMNS = ["model", "weight", "shape", "rows", "kernel_ms", "torch_ms", "speedup", "kernel_bw"]


def rows_for(
    model: str, name: str, n: int, k: int, rows: tuple[int, ...], repeats: int, bandwidth: float
) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    empty = torch.empty(0)
    ext = extension()
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=g)
        kernel = timed(lambda x=x: ext.linear_rows(x, w, empty, empty, empty, 0.0, False))
        t = take_turns(
            {"kernel": kernel, "torch": timed(lambda x=x: F.linear(x, w))}, repeats, warm=2
        )
        t_kernel, t_torch = statistics.median(t["kernel"]), statistics.median(t["torch"])
        out.append(
            {
                "model": model,
                "weight": name,
                "shape": f"{n}x{k}",
                "rows": m,
                "kernel_ms": t_kernel * 1e3,
                "torch_ms": t_torch * 1e3,
                "speedup": paired_ratio(t["torch"], t["kernel"]),
                # the weight's bytes over the kernel's time, as a fraction of the read bandwidth
                "kernel_bw": n * k * 4 / t_kernel / bandwidth,
                "served": m <= MAX_ROWS,
            }
        )
    return out


def draw(ax: Any, rows: list[dict[str, object]]) -> None:
    for model, name, n, k in SHAPES:
        mine = [r for r in rows if r["weight"] == name and r["model"] == model]
        ax.plot(
            [r["rows"] for r in mine],
            [r["speedup"] for r in mine],
            marker="o",
            label=f"{model} {name} [{n}x{k}]",
        )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axvline(MAX_ROWS, color="grey", ls="--", lw=0.8, label=f"MAX_ROWS = {MAX_ROWS}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("input rows (sequences decoded together)")
    ax.set_ylabel("F.linear time / kernel time")
    ax.set_title(f"decode-sized linear layers, {torch.get_num_threads()} threads")
    ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell (20)")
    parser.add_argument("--quick", action="store_true", help="3 calls per cell, fewer rows")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be positive")
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    counts = (1, 8, 32) if args.quick else ROWS
    bandwidth = read_bandwidth()
    rows = [
        r
        for model, name, n, k in SHAPES
        for r in rows_for(model, name, n, k, counts, repeats, bandwidth)
    ]
    print(table(rows, COLUMNS))
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; the kernel serves rows <= {MAX_ROWS}")
    slower = [r for r in rows if r["served"] and float(r["speedup"]) < 1.0]  # type: ignore[arg-type]
    print(
        f"served cells where torch was faster: {len(slower)} of {sum(bool(r['served']) for r in rows)}"
    )
    payload = {"repeats": repeats, "read_bandwidth_gb_s": bandwidth / 1e9, "max_rows": MAX_ROWS}
    write_json("linear_rows", {**payload, "rows": rows})
    if not args.no_plot:
        plot("linear_rows", lambda fig, ax: draw(ax, rows), figsize=(8, 5))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

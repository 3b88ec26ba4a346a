"""GGUF-block decode rows: ``kvcache.kernels.qlinear`` against the float32 ``linear_rows``
kernel on the same weight dequantized, side by side.

Per block type, weight shapes of the bundled models' decode steps (SmolLM2's K = 576 / 1536
for the q8_0 family, Gemma 3's K = 1024 / 2048 for the K-quants) at 1, 4, 16 and 32 input rows,
timed in one process, the two kernels taking turns call by call. It reports milliseconds,
the int8 kernel's speedup over the float32 one (median of per-round ratios) and the weight
read rate of each (bytes as stored over time; float32: 4 bytes a weight).

    python benchmarks/qlinear_rows.py            # median of 20 calls per cell
    python benchmarks/qlinear_rows.py --quick
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from harness import paired_ratio, table, take_turns, timed, write_json
from kvcache.kernels.build import extension
from kvcache.kernels.qlinear import BLOCK_TYPES, QuantizedWeight, WeightPart

# (block type, out features, in features)
SHAPES = [
    *((t, n, k) for t in ("Q4_0", "Q4_1", "Q5_0", "Q8_0") for n, k in ((3072, 576), (576, 1536))),
    *((t, n, k) for t in ("Q4_K", "Q6_K") for n, k in ((2048, 1024), (640, 2048))),
]
ROWS = (1, 4, 16, 32)
COLUMNS = ["type", "shape", "rows", "q_ms", "fp32_ms", "speedup", "q_gb_s", "fp32_gb_s"]
K_SCALES = {"Q4_K": (0, 2), "Q6_K": (208,)}  # byte offsets of the float16 scales in a block


def make_weight(name: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """gguf's quantization of a random weight; K-quants (which gguf-py does not quantize):
    random codes under small float16 scales."""
    t = BLOCK_TYPES[name]
    rng = np.random.default_rng(seed)
    if name in K_SCALES:
        blocks = rng.integers(0, 256, size=(n * k // t.values, t.nbytes), dtype=np.uint8)
        scale = np.full(len(blocks), 1e-3, dtype=np.float16).view(np.uint8).reshape(-1, 2)
        for off in K_SCALES[name]:
            blocks[:, off : off + 2] = scale
        data = blocks.reshape(n, -1)
    else:
        data = quantize(rng.standard_normal((n, k), dtype=np.float32), GGMLQuantizationType(t.ggml))
    return QuantizedWeight((WeightPart(t, torch.from_numpy(np.ascontiguousarray(data))),), k)


def rows_for(name: str, n: int, k: int, repeats: int) -> list[dict[str, object]]:
    w = make_weight(name, n, k, seed=n + k)
    dense = w.dequantize()  # the float32 contender's weight
    kinds, parts = [BLOCK_TYPES[name].ggml], [w.parts[0].data]
    empty = torch.empty(0)
    qext, ext = extension("weights"), extension()
    g = torch.Generator().manual_seed(k)
    out = []
    for m in ROWS:
        x = torch.randn(m, k, generator=g)

        def int8(x: torch.Tensor = x) -> torch.Tensor:
            return qext.qlinear_rows(x, kinds, parts, empty, empty, 0.0, False)

        def fp32(x: torch.Tensor = x) -> torch.Tensor:
            return ext.linear_rows(x, dense, empty, empty, empty, 0.0, False)

        t = take_turns({"q": timed(int8), "fp32": timed(fp32)}, repeats, warm=2)
        tq, tf = statistics.median(t["q"]), statistics.median(t["fp32"])
        out.append(
            {
                "type": name,
                "shape": f"{n}x{k}",
                "rows": m,
                "q_ms": tq * 1e3,
                "fp32_ms": tf * 1e3,
                "speedup": paired_ratio(t["fp32"], t["q"]),
                "q_gb_s": w.nbytes / tq / 1e9,
                "fp32_gb_s": dense.numel() * 4 / tf / 1e9,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell (20)")
    parser.add_argument("--quick", action="store_true", help="5 calls per cell")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be positive")
    torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else args.repeats
    rows = [r for name, n, k in SHAPES for r in rows_for(name, n, k, repeats)]
    print(table(rows, COLUMNS))
    print(f"isa: {extension('weights').isa()}, {args.threads} threads")
    write_json("qlinear_rows", {"repeats": repeats, "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

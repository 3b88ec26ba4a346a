"""Which bit-packing strategy is fastest per width, on the shapes the codecs use?

``kvcache.codecs.pack`` has one layout and several ways to produce it (``candidates(bits)``):
uint8 shifts and ors (``pack_bytes``), k codes added into one exact float word
(``pack_words``), and for unpacking a per-byte table lookup (``unpack_table``), word shifts
(``unpack_words``), shifted copies (``unpack_shifts``) and the int16 trick
(``unpack_int16``). Its ``PACKERS`` / ``UNPACKERS`` tables name one per width; this script
times every candidate side by side in one run and reports each one's time over the chosen
one's (> 1: the choice is faster). The packers the codecs had before they were merged are
among the candidates: int4/kivi's ``pack`` = ``pack_bytes``, ``unpack`` = ``unpack_shifts``,
``unpack4`` = ``unpack_int16``; turbo's ``pack_codes`` / ``unpack_codes`` = ``pack_words`` /
``unpack_words``.

    python benchmarks/pack_speed.py            # median of 50 calls per cell
    python benchmarks/pack_speed.py --quick
"""

from __future__ import annotations

import argparse
import statistics

import torch

from harness import table, take_turns, timed, write_json
from kvcache.codecs.pack import PACKERS, UNPACKERS, candidates, pack

# (what uses it, rows, codes per row, widths): rows x codes is one call's codes
SHAPES = [
    ("int4 decode write [1, 3, 64]", 3, 64, (4,)),
    ("int4 prefill write [512, 3, 64]", 1536, 64, (4,)),
    ("kivi seal / read [64, 3, 64]", 192, 64, (2, 4)),
    ("kivi/int4 read [2048, 3, 64]", 6144, 64, (2, 4)),
    ("turbo decode [3, 64]", 3, 64, tuple(range(1, 9))),
    ("turbo chunk [4096, 128]", 4096, 128, tuple(range(1, 9))),
    ("qjl signs [4096, 64]", 4096, 64, (1,)),
]
COLUMNS = ["shape", "bits", "op", "strategy", "chosen", "us", "vs_chosen"]


def rows_for(label: str, n: int, count: int, bits: int, repeats: int) -> list[dict[str, object]]:
    """Every candidate of one width on one shape, taking turns call by call."""
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (n, count), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    packers, unpackers = candidates(bits)
    calls = {("pack", p.__name__, p is PACKERS[bits]): lambda p=p: p(codes, bits) for p in packers}
    calls |= {
        ("unpack", u.__name__, u is UNPACKERS[bits]): lambda u=u: u(packed, bits, count)
        for u in unpackers
    }
    keys = {f"{op} {name}": (op, name, is_chosen) for op, name, is_chosen in calls}
    seconds = take_turns({k: timed(calls[key]) for k, key in keys.items()}, repeats, warm=3)
    medians = [(*keys[k], statistics.median(t)) for k, t in seconds.items()]
    chosen = {op: s for op, _, is_chosen, s in medians if is_chosen}
    return [
        {
            "shape": label,
            "bits": bits,
            "op": op,
            "strategy": name,
            "chosen": "*" if is_chosen else "",
            "us": s * 1e6,
            "vs_chosen": s / chosen[op],
        }
        for op, name, is_chosen, s in medians
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per cell (50)")
    parser.add_argument("--quick", action="store_true", help="5 calls per cell")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else args.repeats
    rows = [
        row
        for label, n, count, widths in SHAPES
        for bits in widths
        for row in rows_for(label, n, count, bits, repeats)
    ]
    print(table(rows, COLUMNS))
    beaten = [r for r in rows if float(r["vs_chosen"]) < 0.9]  # type: ignore[arg-type]
    print(f"candidates > 10 % faster than the chosen one: {len(beaten)}")
    for r in beaten:
        print(f"  {r['shape']} {r['bits']} bits {r['op']}: {r['strategy']}")
    write_json("pack_speed", {"repeats": repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

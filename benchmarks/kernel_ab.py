"""Two builds of the attention kernels side by side in one process: this checkout's against
another revision's, step by step, so that a slow or noisy machine slows both alike.

A speed change to csrc/ is a few percent; on a shared machine two runs of one build differ
by more. Here both extensions are loaded into one process, the cache
(``cache.attention`` over every layer of a SmolLM2-shaped model, random K/V) is built once,
and the builds take turns every ``--steps`` decode steps for ``--rounds`` rounds. Reported
per codec and shape: each build's median over the rounds of its fastest step, the median
over rounds of the per-round ratio (this checkout / base: below 1 is faster), its 95 %
bootstrap interval (``ratio_lo``, ``ratio_hi``) and a verdict: faster or slower only where
the interval leaves 1 out. Two builds of one source (``--base HEAD`` with csrc/ unchanged)
are the check of the method: their interval must hold 1.
Only the C++ kernels differ between the two: the Python around them is this checkout's.

    python benchmarks/kernel_ab.py                        # this checkout vs HEAD
    python benchmarks/kernel_ab.py --base main~3 --codecs kivi4 int4 --shapes 16x1024
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm import tqdm

import kvcache.kernels.attend as attend
from harness import median_interval, table, take_turns, write_json
from kvcache import Batch, CausalCache
from kvcache.kernels.build import extension
from kvcache.models.rope import Rope

ROOT = Path(__file__).resolve().parents[1]
LAYERS, KV_HEADS, Q_HEADS, DIM, THETA = 30, 3, 9, 64, 100000.0  # SmolLM2-135M


def load_module(path: str) -> ModuleType:
    """A built kernel extension (.so) as a module of its own name."""
    name = Path(path).name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build_base(rev: str) -> str:
    """Build the kernels of revision ``rev`` with this interpreter and return the .so's path.
    The revision is checked out once into a git worktree under ~/.cache/kvcache/kernel_ab/
    named by its commit, and kept: its build is then reused on the next run."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", rev + "^{commit}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    folder = Path.home() / ".cache" / "kvcache" / "kernel_ab" / sha[:12]
    if not (folder / "src").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), sha],
            check=True, capture_output=True,
        )  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "kvcache.kernels"],
        cwd=folder, env={**os.environ, "PYTHONPATH": str(folder / "src")},
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    # one line per unit (python -m kvcache.kernels): the attention unit's is the one compared
    lines = [line for line in out.stdout.splitlines() if "(attention)" in line]
    if not lines:  # a revision from before the units printed their names
        lines = out.stdout.strip().splitlines()[-1:]
    return lines[0].rsplit(" ", 1)[-1]


def compare(
    codec: str, seqs: int, context: int, builds: list[ModuleType], args: argparse.Namespace
) -> dict[str, Any]:
    """Alternate the builds over one cache; per build the fastest step of each round."""
    total = args.rounds * args.steps * len(builds)
    cache = CausalCache(
        context + total + 8, max_sequences=seqs, max_batch=max(context, 2048),
        shift=Rope(DIM, THETA), codec=codec,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for s in range(seqs):
        cache.start_forward(Batch.single(s, 0, context))
        for layer in range(LAYERS):
            k, v = torch.randn(2, context, KV_HEADS, DIM, generator=g)
            cache.put(layer, k, v)
    q = torch.randn(seqs, Q_HEADS, DIM, generator=g)
    k, v = torch.randn(2, seqs, KV_HEADS, DIM, generator=g)
    pos = [context]

    def turn(module: ModuleType) -> Callable[[], float]:
        """One build's turn: ``--steps`` decode steps through it; the fastest."""

        def steps() -> float:
            attend.extension = lambda: module  # type: ignore[assignment]
            times = []
            for _ in range(args.steps):
                cache.start_forward(Batch(positions=[pos[0]] * seqs, sequences=list(range(seqs))))
                pos[0] += 1
                t0 = time.perf_counter()
                for layer in range(LAYERS):
                    cache.attention(layer, q, k, v)
                times.append(time.perf_counter() - t0)
            return min(times)

        return steps

    try:  # in the same order every round, after a warm-up round
        turns = {f"build {i}": turn(m) for i, m in enumerate(builds)}
        fastest = list(take_turns(turns, args.rounds, warm=1, rotate=False).values())
    finally:
        attend.extension = extension  # type: ignore[assignment]
        cache.close()
    ours, base = fastest
    ratios = [a / b for a, b in zip(ours, base, strict=True)]
    lo, hi = median_interval(ratios)
    return {
        "codec": codec,
        "shape": f"{seqs}x{context}",
        "ours_ms": statistics.median(ours) * 1e3,
        "base_ms": statistics.median(base) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_lo": lo,
        "ratio_hi": hi,
        "verdict": verdict(lo, hi),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def verdict(lo: float, hi: float) -> str:
    """Faster or slower only where the interval of the ratio leaves 1 out."""
    return "faster" if hi < 1 else "slower" if lo > 1 else "within noise"


def shape(text: str) -> tuple[int, int]:
    seqs, _, context = text.partition("x")
    try:
        return int(seqs), int(context)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected SEQSxCONTEXT, e.g. 16x1024") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="HEAD", help="git revision to compare against (HEAD)")
    parser.add_argument(
        "--codecs", nargs="+", default=["fp32", "int8", "int4", "kivi4", "turbo4"],
        help="cache codecs (fp32 int8 int4 kivi4 turbo4)",
    )  # fmt: skip
    parser.add_argument(
        "--shapes", nargs="+", type=shape, default=[(16, 1024), (1, 8192)],
        help="SEQSxCONTEXT decode shapes (16x1024 1x8192)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=40, help="turns each build takes (40)")
    parser.add_argument("--steps", type=int, default=4, help="decode steps a turn (4)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    parser.add_argument("--json", default="kernel_ab", help="results/NAME.json (kernel_ab)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ours = extension()
    print(f"building the kernels of {args.base} ...", flush=True)
    base = load_module(build_base(args.base))
    jobs = [(c, s, n) for c in args.codecs for s, n in args.shapes]
    rows = [compare(c, s, n, [ours, base], args) for c, s, n in tqdm(jobs, desc="kernel A/B")]
    cols = ["codec", "shape", "ours_ms", "base_ms", "ratio", "ratio_lo", "ratio_hi", "verdict"]
    print(table(rows, cols))
    write_json(args.json, {"base": args.base, "rows": rows})


if __name__ == "__main__":
    main()

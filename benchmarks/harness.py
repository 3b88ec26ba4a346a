"""The benchmark harness: what every script in benchmarks/ needs besides its question.

Contenders take turns over rounds (``take_turns``, ``timed``, ``paired_ratio``,
``median_interval``), the machine and load record goes into every result (``machine``), the
JSON and the PNG go to benchmarks/results/ (``write_json``, ``plot``), a table is printed
(``table``), and measurements that need a clean process run as workers (``spawn_worker``,
``worker_result``). Scripts are run as ``python benchmarks/NAME.py``: Python puts the script's
folder on ``sys.path``, so ``import harness`` needs no path edit. A script, whole::

    \"\"\"Is a sum faster than a mean over 1M floats?\"\"\"
    import argparse, statistics, torch
    from harness import paired_ratio, plot, table, take_turns, timed, write_json

    def main(argv=None):
        parser = argparse.ArgumentParser(description=__doc__)
        parser.add_argument("--rounds", type=int, default=20)
        args = parser.parse_args(argv)
        x = torch.randn(1_000_000)
        t = take_turns({"sum": timed(x.sum), "mean": timed(x.mean)}, args.rounds, warm=2)
        rows = [{"op": k, "ms": statistics.median(v) * 1e3} for k, v in t.items()]
        rows[0]["vs_mean"] = paired_ratio(t["sum"], t["mean"])  # median of per-round ratios
        print(table(rows, ["op", "ms", "vs_mean"]))
        write_json("sum_vs_mean", {"rounds": args.rounds, "rows": rows})  # + "machine"
        plot("sum_vs_mean", lambda fig, ax: ax.bar([r["op"] for r in rows], [r["ms"] for r in rows]))

A result name (``"sum_vs_mean"``) means benchmarks/results/sum_vs_mean.json / .png (or in
``$KVCACHE_RESULTS`` when set); a ``Path`` is used as given. Both print the path they wrote.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import torch

# KVCACHE_RESULTS: another folder for the results (a smoke run leaves the kept ones alone)
RESULTS = Path(os.environ.get("KVCACHE_RESULTS") or Path(__file__).resolve().parent / "results")
T = TypeVar("T")
# the run starts when its script imports the harness: the load and the clock from then on
_STARTED = (time.perf_counter(), os.getloadavg())


# ---- contenders taking turns -----------------------------------------------------------
def take_turns(
    contenders: Mapping[str, Callable[[], T]],
    rounds: int,
    *,
    warm: int = 0,
    rotate: bool = True,
    before_round: Callable[[int], object] | None = None,
) -> dict[str, list[T]]:
    """Call every contender once a round for ``warm`` + ``rounds`` rounds, the order rotating
    by one each round (``rotate=False``: always the given order), so that a slow minute of a
    shared machine slows every contender of that round alike. ``before_round(r)`` runs before
    round ``r`` (0-based, warm rounds included). Returns each contender's results of the last
    ``rounds`` rounds, in round order."""
    if not contenders:
        raise ValueError("contenders={}: expected at least one")
    if rounds < 1 or warm < 0:
        raise ValueError(f"rounds={rounds}, warm={warm}: expected rounds >= 1 and warm >= 0")
    names = list(contenders)
    out: dict[str, list[T]] = {name: [] for name in names}
    for r in range(warm + rounds):
        if before_round is not None:
            before_round(r)
        k = r % len(names) if rotate else 0
        for name in names[k:] + names[:k]:
            result = contenders[name]()
            if r >= warm:
                out[name].append(result)
    return out


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """``fn`` as a contender whose result is its wall time in seconds."""

    def seconds() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return seconds


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of a[i] / b[i]: contenders compared within each round, where a
    ratio of two medians would compare minutes that were not alike."""
    if len(a) != len(b) or not a:
        raise ValueError(f"rounds: {len(a)} and {len(b)}; expected the same number, at least 1")
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def median_interval(
    ratios: list[float], level: float = 0.95, draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A ``level`` bootstrap interval of the median of per-round ratios (the rounds resampled
    with replacement, a fixed seed): a change means something only where it leaves 1 out."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    cut = int((1 - level) / 2 * draws)
    return medians[cut], medians[draws - 1 - cut]


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` unmeasured ones."""
    return statistics.median(take_turns({"fn": timed(fn)}, repeats, warm=warmup)["fn"])


def read_bandwidth(nbytes: int = 400_000_000, repeats: int = 5) -> float:
    """Bytes/s of a plain torch sum over a float32 buffer of ``nbytes`` (far larger than the
    CPU's caches) with torch's current thread count: the machine's read bandwidth."""
    buffer = torch.ones(nbytes // 4)  # touched once: no page faults in the timed sums
    return buffer.numel() * 4 / median_seconds(buffer.sum, repeats)


# ---- the machine and load record -------------------------------------------------------
def load() -> float:
    """The 1-minute load average now (a shared machine's: how quiet the run was)."""
    return os.getloadavg()[0]


def started_load() -> float:
    """The 1-minute load average when the run started."""
    return _STARTED[1][0]


def minutes() -> float:
    """Minutes since the run started."""
    return (time.perf_counter() - _STARTED[0]) / 60


def machine() -> dict[str, object]:
    """What ran the benchmark and how loaded the machine was, start and end of the run."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "loadavg_start": list(_STARTED[1]),
        "loadavg_end": list(os.getloadavg()),
        "minutes": round(minutes(), 3),
    }


# ---- results: JSON, PNG, table ---------------------------------------------------------
def result_path(target: str | Path, suffix: str) -> Path:
    """``"name"`` -> benchmarks/results/name``suffix``; a Path stays as it is."""
    if isinstance(target, Path):
        return target
    if not target or "/" in target or target.endswith((".json", ".png")):
        raise ValueError(f"result name {target!r}: expected a bare name, or pass a Path")
    return RESULTS / f"{target}{suffix}"


def write_json(target: str | Path, payload: Mapping[str, Any]) -> Path:
    """The result as JSON, the ``machine`` record first; prints and returns its path."""
    if "machine" in payload:
        raise ValueError("payload has a 'machine' key: the harness writes that record")
    path = result_path(target, ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def plot(
    target: str | Path,
    draw: Callable[[Any, Any], object],
    *,
    figsize: tuple[float, float] = (7.0, 4.5),
    ncols: int = 1,
    dpi: int = 110,
) -> Path | None:
    """``draw(fig, ax)`` on a new figure (``ncols`` > 1: ``ax`` is the row of axes), saved as
    a PNG; prints and returns its path. Without matplotlib: says so and returns None."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = result_path(target, ".png")
    fig, ax = plt.subplots(1, ncols, figsize=figsize)
    try:
        draw(fig, ax)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    print(f"wrote {path}")
    return path


def table(rows: list[dict[str, object]], columns: list[str]) -> str:
    """A plain-text table of ``rows`` (dicts) with the given column order."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))
    body = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([line, "-" * len(line), *body])


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


# ---- worker subprocesses (one measurement per process: clean peak RSS) -----------------
def spawn_worker(
    script: str, args: list[str], threads: int, label: str, echo: bool = False
) -> dict[str, Any]:
    """Run ``python script args`` with ``threads`` OpenMP threads; the result its
    ``worker_result`` printed last. Raises RuntimeError with the worker's stderr tail when it
    fails. ``echo``: the worker's stderr goes straight to ours (progress of a long worker)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, script, *args],
        stdout=subprocess.PIPE,
        stderr=None if echo else subprocess.PIPE,
        text=True,
        env=env,
        check=False,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "(its stderr is above)" if echo else proc.stderr[-3000:]
        raise RuntimeError(f"worker {label} failed (exit {proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def worker_result(result: Mapping[str, Any]) -> None:
    """A worker's answer to ``spawn_worker``: one ``RESULT {json}`` line on stdout."""
    print("RESULT " + json.dumps(result), flush=True)

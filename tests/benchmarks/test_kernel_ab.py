"""benchmarks/kernel_ab.py: the in-process A/B of two kernel builds (here one build twice,
so that the test needs no second compile)."""

from __future__ import annotations

import argparse

import pytest

import kernel_ab as ab
import kvcache.kernels.attend as attend
from kvcache.kernels.build import extension


def test_shapes_parse_and_bad_ones_are_refused() -> None:
    assert ab.parse_args(["--shapes", "16x1024", "1x8192"]).shapes == [(16, 1024), (1, 8192)]
    with pytest.raises(argparse.ArgumentTypeError, match="SEQSxCONTEXT"):
        ab.shape("16-1024")


def test_compare_alternates_builds_and_puts_the_kernels_back() -> None:
    calls: list[str] = []
    ext = extension()

    class Counting:  # the build, counting the calls that reach it
        def __init__(self, name: str) -> None:
            self.name = name

        def __getattr__(self, attr: str) -> object:
            if attr == "attend":  # the attention calls (not a one-off query such as isa)
                calls.append(self.name)
            return getattr(ext, attr)

    args = argparse.Namespace(rounds=2, steps=1)
    row = ab.compare("int8", 2, 40, [Counting("ours"), Counting("base")], args)  # type: ignore[list-item]
    assert row["codec"] == "int8" and row["shape"] == "2x40"
    assert row["ours_ms"] > 0 and row["base_ms"] > 0
    assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert row["ratio_lo"] <= row["ratio"] <= row["ratio_hi"]
    assert row["verdict"] == ab.verdict(row["ratio_lo"], row["ratio_hi"])
    # warm-up round + 2 rounds, one step each, every layer's call to each build in turn
    per_turn = ab.LAYERS
    assert calls == (["ours"] * per_turn + ["base"] * per_turn) * 3
    assert attend.extension is extension


def test_the_interval_of_the_median_ratio_decides_the_verdict() -> None:
    # rounds split between two outcomes: the median could be either, or between
    lo, hi = ab.median_interval([0.9] * 20 + [1.1] * 20)
    assert (lo, hi) == (0.9, 1.1) and ab.verdict(lo, hi) == "within noise"
    # every round faster by 5-9 %, one slow outlier: faster, the interval inside the rounds'
    faster = [0.91 + 0.01 * (i % 5) for i in range(39)] + [1.5]
    lo, hi = ab.median_interval(faster)
    assert 0.91 <= lo <= 0.93 <= hi <= 0.95 and ab.verdict(lo, hi) == "faster"
    lo, hi = ab.median_interval([1 / r for r in faster])
    assert lo > 1 and ab.verdict(lo, hi) == "slower"
    assert ab.median_interval([1.02] * 12) == (1.02, 1.02)

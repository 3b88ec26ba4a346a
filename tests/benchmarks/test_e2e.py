"""benchmarks/e2e.py's pure parts: rates from steps, ratios paired by round (or by step in one
worker), the goals' verdicts and the KL rows (the peer itself is built in its setup step)."""

from __future__ import annotations

import argparse
import math

import pytest

import e2e as bench

ARGS = argparse.Namespace(warm=1)
S = "smollm2"


def run(system: str, kv: str, rates: list[float], batch: int = 1, context: int = 64) -> list:
    """One row per round with these decode rates (prefill: 10x them)."""
    return [
        {
            "model": S,
            "system": system,
            "kv": kv,
            "batch": batch,
            "context": context,
            "decode_tok_s": r,
            "prefill_tok_s": 10 * r,
            "step_ms": [],
        }
        for r in rates
    ]


def test_rate_row_drops_the_warm_steps_and_takes_the_median() -> None:
    row = bench.rate_row("ours", "fp16", 4, 100, 2.0, [9.0, 0.1, 0.4, 0.2], ARGS)
    assert row["prefill_tok_s"] == pytest.approx(200.0)  # 4 x 100 tokens in 2 s
    assert row["decode_tok_s"] == pytest.approx(4 / 0.2)  # 4 sequences a 0.2 s step
    assert row["step_ms"] == [100.0, 400.0, 200.0]


def test_ratios_are_medians_of_per_round_ratios() -> None:
    ours_rows, peer_rows = run("ours", "fp16", [10, 40, 12]), run("llama.cpp", "f16", [20, 20, 24])
    runs = bench.by_round([a, b] for a, b in zip(ours_rows, peer_rows, strict=True))
    ours, peer = (S, "ours", "fp16", 1, 64), (S, "llama.cpp", "f16", 1, 64)
    # per round 0.5, 2.0, 0.5 -> 0.5, where the ratio of the medians would be 12 / 20
    assert bench.paired(runs, ours, peer) == pytest.approx(0.5)
    assert bench.paired(runs, ours, peer, "prefill_tok_s") == pytest.approx(0.5)
    assert bench.paired(runs, ours, (S, "llama.cpp", "q8_0", 1, 64)) is None
    (row,) = [r for r in bench.summary(runs) if r["system"] == "ours"]
    assert row["x_f16"] == pytest.approx(0.5) and row["rounds"] == 3
    assert row["x_peer"] == pytest.approx(0.5)  # fp16's counterpart is f16


def test_two_codecs_of_one_worker_pair_step_by_step() -> None:
    a, b = run("ours", "kivi4", [0.0], 16), run("ours", "fp32", [0.0], 16)
    a[0]["step_ms"], b[0]["step_ms"] = [100.0, 400.0, 100.0], [200.0, 200.0, 200.0]
    runs = bench.by_round([a + b])
    # per step 16/0.1 over 16/0.2 = 2, 0.5, 2 -> 2 (the rows' own rates are ignored)
    got = bench.paired(runs, (S, "ours", "kivi4", 16, 64), (S, "ours", "fp32", 16, 64))
    assert got == pytest.approx(2.0)


def test_the_compressed_goal_takes_the_best_type_of_each_side_per_round() -> None:
    rows = [
        run("ours", "int8", [30, 10], context=4096),
        run("ours", "kivi4", [20, 40], context=4096),
        run("llama.cpp", "q8_0", [10, 20], context=4096),
        run("llama.cpp", "q4_0", [20, 10], context=4096),
    ]
    runs = bench.by_round([[r[i] for r in rows] for i in range(2)])
    assert bench.best_of(runs, [(S, "ours", k, 1, 4096) for k in ("int8", "kivi4")]) == [30, 40]
    by = {g["goal"]: g for g in bench.goals(runs, [], (16, 2048))}
    assert by["compressed 4k"]["value"] == pytest.approx(1.75)  # 30/20, 40/20 -> 1.5, 2
    assert by["compressed 4k"]["status"] == "met"
    assert by["decode 4k"]["status"] == "not measured"


def test_goal_verdicts_rss_is_an_upper_bound_the_rest_lower_bounds() -> None:
    assert bench.goal("decode 1k", 1.19, "x")["status"] == "missed"
    assert bench.goal("decode 1k", 1.2, "x")["status"] == "met"
    rss = [
        {"system": "ours", "peak_rss_mib": 700.0},
        {"system": "llama.cpp", "peak_rss_mib": 300.0},
    ]
    by = {g["goal"]: g for g in bench.goals({}, rss, (16, 2048))}
    assert by["rss"]["value"] == pytest.approx(400.0) and by["rss"]["status"] == "missed"
    rss[0]["peak_rss_mib"] = 550.0
    assert {g["goal"]: g for g in bench.goals({}, rss, (16, 2048))}["rss"]["status"] == "met"


def test_kl_rows_average_the_windows() -> None:
    per = {
        "llama.cpp": [
            {"kl": 0.1, "top1": 0.9, "ppl": 4.0},
            {"kl": 0.3, "top1": 0.7, "ppl": 9.0},
        ],
        "ours-native": [],
    }
    (row,) = bench.kl_rows(per)
    assert row["system"] == "llama.cpp" and row["window_kl"] == [0.1, 0.3]
    assert row["kl"] == pytest.approx(0.2) and row["top1"] == pytest.approx(0.8)
    assert row["ppl"] == pytest.approx(math.sqrt(36.0))  # the geometric mean: equal windows

"""benchmarks/routing.py without replicas: the attacker's AUC, each pool's goals, and that one
run covers every pool and policy, probes once and compares the answers of all of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import harness
import routing


def test_auc_reads_faster_as_a_right_guess() -> None:
    assert routing.auc([0.1, 0.2], [0.3, 0.4]) == 1.0
    assert routing.auc([0.3, 0.4], [0.1, 0.2]) == 0.0
    assert routing.auc([0.2, 0.2], [0.2, 0.2]) == 0.5
    assert routing.auc([0.1, 0.3], [0.2]) == 0.5
    low, high = routing.auc_interval([0.1, 0.3, 0.2, 0.5], [0.25, 0.4, 0.35, 0.6])
    assert 0.0 <= low <= routing.auc([0.1, 0.3, 0.2, 0.5], [0.25, 0.4, 0.35, 0.6]) <= high


def run(pool: str, policy: str, p50: float, hit: float) -> dict[str, Any]:
    return {"pool": pool, "policy": policy, "ttft_p50_s": p50, "token_hit_rate": hit}


def test_pool_goals_compare_cache_aware_with_round_robin() -> None:
    goals = routing.pool_goals(
        [run("tight", "round_robin", 3.0, 0.4), run("tight", "cache_aware", 1.0, 0.9)]
    )
    assert goals == {
        "cache_aware_hit_rate_ge_85pct": True,
        "cache_aware_ttft_p50_vs_round_robin": 3.0,
        "cache_aware_ttft_p50_2x_lower": True,
    }
    goals = routing.pool_goals(
        [run("ample", "round_robin", 1.5, 0.8), run("ample", "cache_aware", 1.0, 0.8)]
    )
    assert goals["cache_aware_ttft_p50_2x_lower"] is False
    assert goals["cache_aware_hit_rate_ge_85pct"] is False
    assert routing.pool_goals([run("ample", "round_robin", 1.0, 0.8)]) == {}


def test_one_run_covers_every_pool_and_policy_and_probes_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, str, bool]] = []
    probe = {
        mode: {"auc": a, "auc_95": (a, a), "true_ttft_s": [0.1], "false_ttft_s": [0.3]}
        for mode, a in (("no_salt", 1.0), ("salted", 0.5))
    }

    def fake(name: str, pool: str, trace: Any, logs: Path, probe_it: bool) -> dict[str, Any]:
        calls.append((pool, name, probe_it))
        p50 = 3.0 if (pool, name) == ("tight", "round_robin") else 1.0
        answer = "b" if (pool, name) == ("ample", "round_robin+redis") else "a"
        return {
            **run(pool, name, p50, 0.9),
            "requests": 2,
            "ttft_p90_s": p50,
            "trace_seconds": 1.0,
            "ttft_s": [p50, p50],
            "answers": {"0/0": answer},
            "probe": probe if probe_it else None,
        }

    monkeypatch.setattr(routing, "run_policy", fake)
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    assert routing.main(["--out", "r", "--logs", str(tmp_path / "logs")]) == 0
    assert [(p, n) for p, n, _ in calls] == [
        (p, n) for p in routing.POOLS for n in routing.POLICIES
    ]
    assert [(p, n) for p, n, probed in calls if probed] == [("ample", "cache_aware")]
    goals = json.loads((tmp_path / "r.json").read_text())["goals"]
    assert goals["same_answers_everywhere"] is False  # one run's answer parted
    assert goals["tight"]["cache_aware_ttft_p50_2x_lower"] is True
    assert goals["ample"]["cache_aware_ttft_p50_2x_lower"] is False
    assert goals["probe_auc_no_salt_ge_0.9"] is True
    assert goals["probe_auc_salted_le_0.6"] is True
    assert (tmp_path / "r.png").stat().st_size > 0

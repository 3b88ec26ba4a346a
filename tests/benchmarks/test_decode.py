"""benchmarks/decode.py: contenders decode in turn, and ratios are medians of per-round ratios."""

from __future__ import annotations

import argparse
import itertools

import pytest

import decode as bench
from kvcache.generate import GenerationConfig, Generator
from kvcache.models.llama import Llama


def row(batch: int, steps: list[float], group: str | None) -> dict:
    return {
        "batch": batch,
        "step_ms": steps,
        "decode_tok_s": batch * 1e3 / sorted(steps)[1],
        "group": group,
    }


def test_paired_is_the_median_of_per_round_ratios_within_one_worker() -> None:
    a, b = ("int4", 1, 64), ("fp32", 1, 64)
    # per round a/b: 2.0, 0.5, 2.0 -> 2.0; the ratio of the medians would be 20 / 12
    runs = {a: row(1, [10.0, 40.0, 12.0], "g"), b: row(1, [20.0, 20.0, 24.0], "g")}
    assert bench.paired(runs, a, b) == pytest.approx(2.0)
    # batches count: 4 sequences per 40 ms against 1 per 10 ms is 1x
    runs[a] = row(4, [40.0, 160.0, 48.0], "g")
    assert bench.paired(runs, a, b) == pytest.approx(2.0)
    runs[a] = row(1, [10.0, 40.0, 12.0], "other worker")  # not in turn: medians
    assert bench.paired(runs, a, b) == pytest.approx(20.0 / 12.0)
    assert bench.paired(runs, a, ("kivi4", 1, 64)) is None


def test_the_throughput_table_divides_the_means_over_every_timed_step() -> None:
    """A step that seals rows (turbo: ~60 ms more at 16 x 1k) leaves a median alone; the
    throughput table's rates are tokens / seconds over all the steps, and its ratios the two
    means', where the decode table keeps the paired medians."""
    fp32 = {**row(1, [10.0, 10.0, 10.0], "g"), "codec": "fp32", "context": 64}
    turbo = {**row(1, [10.0, 40.0, 10.0], "g"), "codec": "turbo4", "context": 64}
    for r in (fp32, turbo):
        r["decode_tok_s_mean"] = 1e3 * len(r["step_ms"]) / sum(r["step_ms"])
    by_key = {(r["codec"], 1, 64): r for r in (fp32, turbo)}
    mean = {r["codec"]: r["1x64"] for r in bench.pivot([fp32, turbo], "decode_tok_s_mean", by_key)}
    assert mean == {"fp32": "100.0", "turbo4": "50.0 (0.50x)"}
    median = {r["codec"]: r["1x64"] for r in bench.pivot([fp32, turbo], "decode_tok_s", by_key)}
    assert median == {"fp32": "100.0", "turbo4": "100.0 (1.00x)"}


def test_contenders_take_turns_one_step_each_in_a_rotating_order(
    history_model: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = argparse.Namespace(warm=1, steps=3, max_batch=64)
    monkeypatch.setattr(bench, "warm_up", lambda *a: None)  # the tiny model needs none
    order: list[tuple[str, int]] = []
    step = bench.Contender.step

    def recorded(self: bench.Contender) -> bool:
        order.append((self.codec, self.batch))
        return step(self)

    monkeypatch.setattr(bench.Contender, "step", recorded)
    one, two = [list(range(3, 27))], [list(range(5, 25)), list(range(7, 31))]
    rows = bench.decode_in_turn(history_model, [("fp32", one), ("fp16", two)], args, "g")
    rounds = order[-2 * 4 :]  # warm + steps rounds of 2 contenders (prefills before them)
    a, b = ("fp32", 1), ("fp16", 2)
    assert rounds == [a, b, b, a, a, b, b, a]
    assert [(r["codec"], r["batch"], r["group"], len(r["step_ms"])) for r in rows] == [
        ("fp32", 1, "g", 3),
        ("fp16", 2, "g", 3),
    ]
    # one sequence decodes to its end: its tokens are plain greedy decoding's
    gen = Generator(history_model, capacity=64, max_sequences=1, max_batch=64, codec="fp32")
    new = len(rows[0]["tokens"])
    first = gen.add_many(one, GenerationConfig(max_new_tokens=new, ignore_eos=True))[0]
    for _ in gen.run():
        pass
    assert rows[0]["tokens"] == gen.results[first].tokens


def test_the_attention_goal_is_the_op_against_a_sum_over_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = argparse.Namespace(history=96, warm=1, steps=3)
    assert "of_same_bytes" not in bench.attention_op("int8", args)  # fp32 rows only
    # a clock that moves 1 ms a reading: each layer's call and each step's sums take 1 ms, so
    # step i's 30 calls read its 96 + i + 1 rows in 30 ms and the sums 96 rows in 1 ms
    ticks = itertools.count()
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks) * 1e-3)
    share = bench.attention_op("fp32", args)["of_same_bytes"]
    assert share == pytest.approx((96 + 2 + 1) / 30 / 96)  # the median of steps 1, 2, 3
    goal = bench.goals(
        argparse.Namespace(contexts=[64], batches=[1], long=64, history=96),
        {},
        {"floor_tok_s": 1.0, "fraction": 0.5},
        [{"codec": "fp32", "of_bandwidth": 0.9, "of_same_bytes": 0.6}],
    )[-1]
    assert goal["figure"].endswith("a sum over the same bytes") and goal["value"] == 0.6

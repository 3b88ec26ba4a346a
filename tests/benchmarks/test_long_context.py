"""benchmarks/long_context.py: the harness's prefill + answer path against a no-cache greedy
reference, and its retention and goal bookkeeping."""

from __future__ import annotations

import pytest

import long_context as lc
from greedy_reference import greedy, random_prompt
from ruler_tasks import Sample


def test_chunked_prefill_then_answer_is_the_uncached_greedy(history_model, monkeypatch) -> None:
    monkeypatch.setattr(lc, "CHUNK", 5)  # 17 context tokens: 4 forwards
    context, question = random_prompt(17, seed=3), random_prompt(4, seed=4)
    cache = history_model.new_cache(40, max_batch=8)
    pressed = lc.apply_press("none", history_model, cache, 0, context)
    assert pressed.press_s == 0.0 and pressed.compression is None
    assert cache.next_position(0) == 17
    got = lc.answer(history_model, cache, 0, question, 6, eos=None)
    assert got == greedy(history_model, context + question, 6)


def test_answer_stops_at_eos(history_model) -> None:
    context, question = random_prompt(9, seed=5), random_prompt(3, seed=6)
    first = greedy(history_model, context + question, 1)[0]
    cache = history_model.new_cache(20)
    lc.apply_press("none", history_model, cache, 0, context)
    assert lc.answer(history_model, cache, 0, question, 6, eos=first) == []


def test_kvzip_is_bound_and_sized_by_the_harness(history_model) -> None:
    """apply_press binds kvzip to the harness's repeat prompts and gives it the context;
    repeat_room sizes a cache that holds the repeat (one cell less fails, cache as it was)."""
    from kvcache.errors import CacheFullError
    from kvcache.press.kvzip import Reconstruction

    context = random_prompt(60, seed=7)
    rec = Reconstruction(history_model, [1, 2, 3], [4, 5], [6], skip=2)
    press = lc._make_press("kvzip:0.5", rec)
    room = lc.repeat_room(press, 60)
    assert room == 58 + 3 + 1 and lc.repeat_room(None, 60) == 0  # 58 repeated + the prompt
    cache = history_model.new_cache(60 + room)
    pressed = lc.apply_press("kvzip:0.5", history_model, cache, 0, context, rec)
    assert len(cache.positions(0)) == 30 and cache.free_cells() == cache.num_cells - 30
    assert pressed.compression is not None and pressed.press_s > 0
    small = history_model.new_cache(60 + room - 1)
    with pytest.raises(CacheFullError):
        lc.apply_press("kvzip:0.5", history_model, small, 0, context, rec)
    assert len(small.positions(0)) == 60


def _row(press: str, codec: str, scores: dict[str, float], **kw: float) -> dict[str, object]:
    return {
        "press": press,
        "codec": codec,
        "cells": {c: {"score": s} for c, s in scores.items()},
        **kw,
    }


def test_retention_counts_the_kept_cells_only() -> None:
    base = _row("none", "fp32", {"a@1024": 1.0, "b@1024": 0.8, "c@1024": 0.1})
    row = _row("snapkv:0.5", "fp32", {"a@1024": 0.9, "b@1024": 0.8, "c@1024": 0.5})
    assert lc.retention(row, base, ["a@1024", "b@1024"]) == pytest.approx(1.7 / 1.8)


def _scored(scores: dict[str, list[int]]) -> dict[str, object]:
    cells = {c: {"score": sum(v) / len(v), "scores": v} for c, v in scores.items()}
    return {"press": "p", "codec": "c", "cells": cells}


def test_retention_interval_is_paired_over_the_kept_cells() -> None:
    base = _scored({"a@1024": [1] * 8 + [0] * 2, "b@1024": [1] * 10, "c@1024": [0] * 10})
    kept = ["a@1024", "b@1024"]
    # the same answers: every draw takes the same samples on both sides (unpaired draws of
    # base and row would spread around 1)
    assert lc.retention_interval(base, base, kept) == (1.0, 1.0)
    lost = _scored({"a@1024": [1] * 7 + [0] * 3, "b@1024": [1] * 9 + [0], "c@1024": [1] * 10})
    point = lc.retention(lost, base, kept)
    assert point == pytest.approx(1.6 / 1.8)
    lo, hi = lc.retention_interval(lost, base, kept)
    assert lo < 0.8 < point < hi <= 1.0  # two answers of 18 lost: the interval is wide
    assert hi == pytest.approx(1.0)  # draws that miss both lost samples
    again = lc.retention_interval(lost, base, kept, seed=0)
    assert again == (lo, hi)  # seeded: a rerun of the report gives the same interval
    assert lc.retention_interval(_row("p", "c", {"a@1024": 1.0}), base, ["a@1024"]) is None
    short = _scored({"a@1024": [1] * 9, "b@1024": [1] * 10})
    assert lc.retention_interval(short, base, kept) is None  # not the same samples


class _Ids:
    """A tokenizer for the tiny model: text is its token ids, space separated."""

    eos_id = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def _sample(context: list[int], question: list[int], answer: str) -> Sample:
    words = " ".join(map(str, context))
    return Sample("passkey", len(context), words, " ".join(map(str, question)), (answer,),
                  (), (), words, 6)  # fmt: skip


def _bench(model, samples) -> lc.Bench:  # type: ignore[no-untyped-def]
    return lc.Bench(model, _Ids(), samples, {})  # type: ignore[arg-type]


def test_presses_from_one_prefill_equal_each_press_on_its_own(history_model, monkeypatch) -> None:
    monkeypatch.setattr(lc, "CHUNK", 16)
    monkeypatch.setattr(lc, "make_cache", lambda m, codec, n: m.new_cache(n, max_batch=16))
    presses = ["none", "snapkv:0.5", "streaming:0.5", "tova:0.25", "knorm:0.75"]
    sample = _sample(random_prompt(40, seed=7), random_prompt(4, seed=8), "x")
    bench = _bench(history_model, {})
    together = bench.run_codec("fp32", presses, sample)
    for spec in presses:
        alone = bench.run(lc.Config(spec, "fp32"), sample)
        assert together[spec]["output"] == alone["output"], spec
        assert together[spec]["compression"] == pytest.approx(alone["compression"]), spec
    outputs = {together[p]["output"] for p in presses}
    assert len(outputs) > 1  # the presses change what the model answers: restores are seen
    none = together["none"]["output"].split()
    context, question = sample.context.split(), sample.question.split()
    ids = [int(t) for t in context + question]
    assert [int(t) for t in none] == greedy(history_model, ids, 6)


def test_calibration_stops_a_cell_once_it_cannot_reach_keep(monkeypatch) -> None:
    scores = {"passkey": [1, 0, 0, 0, 0, 1, 1, 1, 1, 1], "vt": [1, 1, 0, 1, 1, 1, 0, 1, 0, 1]}
    samples = {(t, 1024): [_sample([i], [0], t) for i in range(10)] for t in scores}
    ran: list[tuple[str, int]] = []

    def run(self, config, sample):  # type: ignore[no-untyped-def]
        i = int(sample.context)
        ran.append((sample.answers[0], i))
        return {"score": scores[sample.answers[0]][i], "output": "", "prefill_s": 1.0,
                "press_s": 0.0, "compression": 0.5}  # fmt: skip

    monkeypatch.setattr(lc.Bench, "run", run)
    row = lc.calibrate(_bench(None, samples), list(samples))
    # passkey: 4 misses after 5 samples, 7 of 10 out of reach; vt: every sample (7 of 10)
    assert [i for t, i in ran if t == "passkey"] == [0, 1, 2, 3, 4]
    assert [i for t, i in ran if t == "vt"] == list(range(10))
    assert row["cells"]["passkey@1024"]["score"] == pytest.approx(0.2)
    assert row["cells"]["vt@1024"]["score"] == pytest.approx(0.7)
    assert row["cells"]["passkey@1024"]["samples"] == 5


def _summary(press: str, codec: str, compression: float, retention: float):  # type: ignore[no-untyped-def]
    return {"press": press, "codec": codec, "compression": compression, "retention": retention}


def test_goals_met_missed_and_not_measured() -> None:
    rows = [
        _summary("none", "fp32", 0.5, 1.0),
        _summary("none", "kivi4", 3.0, 0.99),
        _summary("streaming:0.5", "kivi4", 6.0, 0.80),
        _summary("snapkv:0.5", "kivi4", 6.0, 0.98),
        _summary("streaming:0.75", "kivi4", 12.0, 0.70),
        _summary("snapkv:0.75", "kivi4", 12.0, 0.70),
    ]
    costs = [
        {"press": "snapkv:0.5", "codec": "kivi4", "press_cost": 0.02},
        {"press": "tova:0.5", "codec": "fp32", "press_cost": 0.20},
    ]
    status = {g["goal"]: (g["status"], g["detail"]) for g in lc.goals(rows, costs)}
    assert status["4x total compression -> retention >= 97%"][0] == "met"
    assert "snapkv:0.5 x kivi4: 98.0%" in status["4x total compression -> retention >= 97%"][1]
    assert status["8x total compression -> retention >= 90%"][0] == "missed"
    beats = status["best press beats StreamingLLM at every ratio >= 0.5"]
    assert beats[0] == "missed" and "streaming:0.75 x kivi4" in beats[1]  # a tie is no win
    assert status["pressing costs <= 10% of the prefill"] == (
        "missed",
        "worst tova:0.5 x fp32: 20.0%",
    )
    none = {g["status"] for g in lc.goals(rows[:2], [])}
    assert none == {"not measured"}


def _full(press: str, codec: str, score: float, compression: float, prefill: float, press_s=0.0):  # type: ignore[no-untyped-def]
    cell = {"score": score, "prefill_s": prefill, "press_s": press_s, "outputs": []}
    drop = {"score": 0.2, "prefill_s": 100.0, "press_s": 0.0, "outputs": []}
    return {
        "press": press,
        "codec": codec,
        "compression": compression,
        "cells": {"passkey@1024": cell, "vt@1024": drop},
    }


def status_of(out: dict) -> dict[str, str]:  # type: ignore[type-arg]
    return {g["goal"]: g["status"] for g in out["goals"]}


def test_report_writes_retention_goals_json_and_png(tmp_path, capsys) -> None:
    import argparse
    import json

    rows = [
        _full("none", "fp32", 1.0, 0.5, 10.0),
        _full("none", "kivi4", 1.0, 3.0, 12.0),
        _full("streaming:0.5", "kivi4", 0.6, 6.0, 12.0, 0.1),
        _full("snapkv:0.5", "kivi4", 0.9, 6.0, 12.6, 0.6),
    ]
    args = argparse.Namespace(
        tasks=["passkey", "vt"], lengths=[1024], samples=1, seed=0,
        json=tmp_path / "lc.json", png=tmp_path / "lc.png",
    )  # fmt: skip
    costs = [{"press": "snapkv:0.5", "codec": "kivi4", "prefill_s": 12.0, "pressed_s": 12.6,
              "press_cost": 0.05}]  # fmt: skip
    lc.report(args, rows, ["passkey@1024"], costs)
    out = json.loads((tmp_path / "lc.json").read_text())
    got = {(r["press"], r["codec"]): r for r in out["rows"]}
    assert got["snapkv:0.5", "kivi4"]["retention"] == pytest.approx(0.9)
    assert out["press_costs"] == costs
    assert status_of(out)["pressing costs <= 10% of the prefill"] == "met"
    assert got["none", "fp32"]["prefill_s"] == 10.0  # the dropped cell's 100 s not counted
    status = status_of(out)
    assert status["best press beats StreamingLLM at every ratio >= 0.5"] == "met"
    assert status["4x total compression -> retention >= 97%"] == "missed"
    assert (tmp_path / "lc.png").stat().st_size > 0
    assert "[met] best press beats StreamingLLM" in capsys.readouterr().out
    assert got["snapkv:0.5", "kivi4"]["retention_lo"] is None  # no per-sample scores


def test_report_gives_each_row_its_interval(tmp_path, capsys) -> None:
    import argparse
    import json

    def full(press: str, codec: str, scores: list[int], compression: float):  # type: ignore[no-untyped-def]
        row = _scored({"passkey@1024": scores})
        row.update(press=press, codec=codec, compression=compression)
        for cell in row["cells"].values():  # type: ignore[attr-defined]
            cell.update(prefill_s=1.0, press_s=0.0, outputs=[])
        return row

    rows = [full("none", "fp32", [1] * 10, 0.5), full("none", "kivi4", [1] * 9 + [0], 4.2)]
    args = argparse.Namespace(
        tasks=["passkey"], lengths=[1024], samples=10, seed=0,
        json=tmp_path / "lc.json", png=tmp_path / "lc.png",
    )  # fmt: skip
    lc.report(args, rows, ["passkey@1024"], [])
    out = json.loads((tmp_path / "lc.json").read_text())
    kivi = out["rows"][1]
    assert kivi["retention"] == pytest.approx(0.9)
    assert kivi["retention_lo"] < 0.9 < kivi["retention_hi"] == pytest.approx(1.0)
    assert out["rows"][0]["retention_lo"] == out["rows"][0]["retention_hi"] == 1.0
    goal = {g["goal"]: g for g in out["goals"]}["4x total compression -> retention >= 97%"]
    assert goal["status"] == "missed" and "95% interval" in goal["detail"]
    assert "95% interval" in capsys.readouterr().out


def test_config_ratio_reads_specs_with_options() -> None:
    assert lc.Config("snapkv:0.5,window=32", "fp32").ratio == 0.5
    assert lc.Config("none", "int8").ratio == 0.0
    assert lc.Config("tova:0.75", "kivi4").press_name == "tova"
    assert (
        lc.Config("chunkkv:0.5,inner=snapkv,chunk=8", "kivi4").family
        == "chunkkv,inner=snapkv,chunk=8"
    )
    assert lc.Config("tova:0.75", "kivi4").family == "tova"

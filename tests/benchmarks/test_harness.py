"""benchmarks/harness.py: rounds alternate contenders, every result carries the machine
record, plots are written; and every script in benchmarks/ runs through it."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

import harness

BENCHMARKS = Path(harness.__file__).resolve().parent
# what a script must leave to the harness: (what it looks like, what the harness gives)
REDONE = {
    "sys.path": "no sys.path edit: `python benchmarks/NAME.py` puts benchmarks/ on it",
    "getloadavg": "harness.load() / machine()",
    "savefig": "harness.plot",
    "matplotlib.use": "harness.plot",
    '"machine"': "harness.write_json writes the machine record",
    'print("RESULT': "harness.worker_result",
}


# being ported by their owners: strict, so the port makes this fail until the name goes
NOT_YET: set[str] = set()


def scripts() -> list[Path]:
    """Every runnable file of benchmarks/ (one with a ``__main__`` block)."""
    return sorted(
        p for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()
    )


def marked(paths: list[Path]) -> list[object]:
    xfail = pytest.mark.xfail(strict=True, reason="not on the harness yet")
    return [pytest.param(p, marks=xfail) if p.name in NOT_YET else p for p in paths]


def test_rounds_alternate_contenders_the_order_rotating_and_warm_rounds_dropped() -> None:
    calls: list[tuple[int, str]] = []
    current = [-1]

    def contender(name: str):  # type: ignore[no-untyped-def]
        def call() -> str:
            calls.append((current[0], name))
            return f"{name}{current[0]}"

        return call

    def before(r: int) -> None:
        current[0] = r

    got = harness.take_turns({n: contender(n) for n in "abc"}, 3, warm=1, before_round=before)
    assert calls == [
        (0, "a"), (0, "b"), (0, "c"),
        (1, "b"), (1, "c"), (1, "a"),
        (2, "c"), (2, "a"), (2, "b"),
        (3, "a"), (3, "b"), (3, "c"),
    ]  # fmt: skip
    assert got == {"a": ["a1", "a2", "a3"], "b": ["b1", "b2", "b3"], "c": ["c1", "c2", "c3"]}
    calls.clear()
    harness.take_turns({n: contender(n) for n in "ab"}, 2, rotate=False)
    assert [n for _, n in calls] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="rounds=0"):
        harness.take_turns({"a": contender("a")}, 0)
    with pytest.raises(ValueError, match="contenders"):
        harness.take_turns({}, 3)


def test_timed_contenders_and_paired_ratios() -> None:
    ticks = iter(range(100))
    clock = harness.time.perf_counter
    harness.time.perf_counter = lambda: float(next(ticks))  # type: ignore[assignment]
    try:
        assert harness.timed(lambda: None)() == 1.0
    finally:
        harness.time.perf_counter = clock  # type: ignore[assignment]
    # per round a/b: 0.5, 2.0, 0.5 -> 0.5, where the ratio of the medians is 12 / 20
    assert harness.paired_ratio([10.0, 40.0, 12.0], [20.0, 20.0, 24.0]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="the same number"):
        harness.paired_ratio([1.0, 2.0], [1.0])
    lo, hi = harness.median_interval([0.9] * 20 + [1.1] * 20)
    assert (lo, hi) == (0.9, 1.1)
    assert harness.median_interval([1.02] * 12) == (1.02, 1.02)


def test_the_json_carries_the_machine_record(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    path = harness.write_json("question", {"rows": [{"x": 1}]})
    assert path == tmp_path / "question.json"
    assert f"wrote {path}" in capsys.readouterr().out
    out = json.loads(path.read_text())
    assert list(out) == ["machine", "rows"] and out["rows"] == [{"x": 1}]
    record = out["machine"]
    for key in ("python", "torch", "threads", "processor", "cpus", "date_utc", "minutes"):
        assert record[key] not in (None, ""), key
    assert len(record["loadavg_start"]) == len(record["loadavg_end"]) == 3
    assert record["minutes"] >= 0 and re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:]{8}Z", record["date_utc"])
    elsewhere = harness.write_json(tmp_path / "sub" / "given.json", {})
    assert json.loads(elsewhere.read_text())["machine"]["python"] == record["python"]
    with pytest.raises(ValueError, match="machine"):
        harness.write_json("question", {"machine": {}})
    with pytest.raises(ValueError, match="bare name"):
        harness.write_json("question.json", {})


def test_the_png_is_written_and_its_figure_closed(tmp_path: Path, monkeypatch, capsys) -> None:
    import matplotlib.pyplot as plt

    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    seen = []

    def draw(fig, axes) -> None:  # type: ignore[no-untyped-def]
        seen.append(len(axes))
        for ax in axes:
            ax.plot([1, 2, 3], [3, 1, 2])

    path = harness.plot("question", draw, ncols=2)
    assert path == tmp_path / "question.png" and seen == [2]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    assert plt.get_fignums() == [] and f"wrote {path}" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    assert harness.plot("other", draw) is None
    assert not (tmp_path / "other.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_the_docstring_example_runs(tmp_path: Path, monkeypatch, capsys) -> None:
    """The module docstring's script, as written, on the harness."""
    doc = harness.__doc__ or ""
    lines = doc.split("::\n", 1)[1].split("\n\n", 1)[0].split("\n")
    lines += doc.split("::\n", 1)[1].split("\n\n")[1].split("\n")
    source = "\n".join(line.removeprefix("    ") for line in lines if line.startswith("    "))
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(source, "harness-docstring", "exec"), namespace)
    namespace["main"](["--rounds", "3"])  # type: ignore[operator]
    out = json.loads((tmp_path / "sum_vs_mean.json").read_text())
    assert [r["op"] for r in out["rows"]] == ["sum", "mean"] and "machine" in out
    assert (tmp_path / "sum_vs_mean.png").stat().st_size > 1000
    assert "vs_mean" in capsys.readouterr().out


@pytest.mark.parametrize("script", marked(scripts()), ids=lambda p: p.name)
def test_every_script_runs_through_the_harness(script: Path) -> None:
    """A script imports the harness and redoes none of it (a new script that writes its own
    JSON, plot or load record, or edits sys.path, fails here)."""
    text = script.read_text()
    tree = ast.parse(text)
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "harness" in imported, f"{script.name} does not import the harness"
    redone = [f"{what} ({instead})" for what, instead in REDONE.items() if what in text]
    assert not redone, f"{script.name} redoes the harness: {redone}"


def test_the_script_list_is_the_benchmarks() -> None:
    names = {p.stem for p in scripts()}
    assert {"decode", "kernel_ab", "seal_cost", "serve_load", "snapshots"} <= names
    assert "harness" not in names and "common" not in names

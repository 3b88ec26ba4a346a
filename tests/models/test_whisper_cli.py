"""`kvcache transcribe` end to end: help, text, timestamps, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcache.cli import main

FIXTURES = Path(__file__).parent.parent / "fixtures" / "audio"
SENTENCES: dict[str, str] = json.loads((FIXTURES / "sentences.json").read_text())


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["transcribe", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("FILE", "--beam-size", "--timestamps", "--model", "examples:"):
        assert option in out


def test_prints_the_transcript(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["transcribe", str(FIXTURES / "library.wav"), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == SENTENCES["library.wav"]


def test_prints_timestamped_segments(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "transcribe",
                str(FIXTURES / "trip.wav"),
                "--timestamps",
                "--beam-size",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines
    pattern = re.compile(r"^\[(\d\d):(\d\d):(\d\d\.\d{3}) --> (\d\d):(\d\d):(\d\d\.\d{3})\] (.+)$")
    matches = [pattern.match(line) for line in lines]
    assert all(matches), lines
    assert " ".join(m.group(7) for m in matches if m) == SENTENCES["trip.wav"]


def test_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["transcribe", str(FIXTURES / "report.wav")]) == 0
    captured = capsys.readouterr()
    assert "windows" in captured.err and "s of audio" in captured.err
    assert "windows" not in captured.out


def test_errors_are_reported(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["transcribe", str(tmp_path / "missing.wav"), "--no-progress"]) == 1
    assert "missing.wav" in capsys.readouterr().err
    assert main(["transcribe", str(FIXTURES / "trip.wav"), "--beam-size", "0"]) == 2
    assert "--beam-size=0" in capsys.readouterr().err

"""`kvcache transcribe` end to end: help, text, timestamps, output files, several files, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import soundfile
import srt
import webvtt

from kvcache.cli import main

FIXTURES = Path(__file__).parent.parent / "fixtures" / "audio"
SENTENCES: dict[str, str] = json.loads((FIXTURES / "sentences.json").read_text())


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["transcribe", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "FILE",
        "--output-format",
        "--output-dir",
        "--beam-size",
        "--temperature",
        "--initial-prompt",
        "--timestamps",
        "--model",
        "examples:",
    ):
        assert option in out


def test_prints_the_transcript(capsys: pytest.CaptureFixture[str]) -> None:
    # a fixture tiny.en hears word for word (on library.wav it says "book" for "books", as
    # faster-whisper does on the same model)
    assert main(["transcribe", str(FIXTURES / "lights.wav"), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == SENTENCES["lights.wav"]


def test_prints_timestamped_segments(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["transcribe", str(FIXTURES / "trip.wav"), "--timestamps", "--beam-size", "2"]
    assert main([*argv, "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines
    pattern = re.compile(r"^\[(\d\d):(\d\d):(\d\d\.\d{3}) --> (\d\d):(\d\d):(\d\d\.\d{3})\] (.+)$")
    matches = [pattern.match(line) for line in lines]
    assert all(matches), lines
    assert " ".join(m.group(7) for m in matches if m) == SENTENCES["trip.wav"]


def test_progress_bar_over_seconds_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["transcribe", str(FIXTURES / "report.wav")]) == 0
    captured = capsys.readouterr()
    seconds = soundfile.info(str(FIXTURES / "report.wav")).duration
    done = re.search(r"transcribing: 100%.*\| (\d+\.\d)/(\d+\.\d) s of audio", captured.err)
    assert done and float(done.group(1)) == float(done.group(2)) == round(seconds, 1), captured.err
    assert "transcribing" not in captured.out


def test_output_files_parse_with_real_libraries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """srt read by `srt` and by webvtt-py, vtt by webvtt-py, json by json: same segments."""
    wav = FIXTURES / "stella.wav"
    argv = ["transcribe", str(wav), "-f", "all", "-o", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["stella.json", "stella.srt", "stella.txt", "stella.vtt"]
    data = json.loads((tmp_path / "stella.json").read_text())
    segs = data["segments"]
    assert segs and data["text"].strip() == capsys.readouterr().out.strip()
    assert {"start", "end", "text", "avg_logprob", "no_speech_prob", "compression_ratio"} <= set(
        segs[0]
    )
    subs = list(srt.parse((tmp_path / "stella.srt").read_text()))
    cues = list(webvtt.read(str(tmp_path / "stella.vtt")))
    from_srt = list(webvtt.from_srt(str(tmp_path / "stella.srt")))
    assert len(subs) == len(cues) == len(from_srt) == len(segs)
    for sub, cue, cue2, seg in zip(subs, cues, from_srt, segs, strict=True):
        assert sub.content == cue.text == cue2.text == seg["text"].strip()
        assert abs(sub.start.total_seconds() - seg["start"]) < 1e-3
        assert abs(sub.end.total_seconds() - seg["end"]) < 1e-3
        assert abs(_seconds(cue.start) - seg["start"]) < 1e-3
        assert abs(_seconds(cue.end) - seg["end"]) < 1e-3
    txt = (tmp_path / "stella.txt").read_text().splitlines()
    assert txt == [s["text"].strip() for s in segs]


def _seconds(clock: str) -> float:
    h, m, s = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def test_several_files_in_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = ["meeting.wav", "lights.wav", "report.wav"]
    argv = ["transcribe", *(str(FIXTURES / n) for n in names), "-f", "srt", "-o", str(tmp_path)]
    assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0::2] == [f"==> {FIXTURES / n} <==" for n in names]
    for name in names:
        subs = list(srt.parse((tmp_path / name.replace(".wav", ".srt")).read_text()))
        assert " ".join(s.content for s in subs) == out[1 + 2 * names.index(name)]


def test_errors_are_reported(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["transcribe", str(tmp_path / "missing.wav"), "--no-progress"]) == 1
    assert "missing.wav" in capsys.readouterr().err
    assert main(["transcribe", str(FIXTURES / "trip.wav"), "--beam-size", "0"]) == 2
    assert "--beam-size=0" in capsys.readouterr().err
    assert main(["transcribe", str(FIXTURES / "trip.wav"), "--temperature", "1.5"]) == 2
    assert "--temperature=1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["transcribe", str(FIXTURES / "trip.wav"), "--output-format", "doc"])


def test_cli_formats_and_fallback_ladder_match_the_library() -> None:
    from kvcache.commands.transcribe import FORMATS
    from kvcache.transcription import TEMPERATURES
    from kvcache.transcription.options import temperature_ladder
    from kvcache.transcription.writers import FORMATS as WRITTEN

    assert FORMATS == WRITTEN
    assert temperature_ladder(0.0, 0.2) == TEMPERATURES  # --temperature 0 (the default)
    assert temperature_ladder(0.5, 0.2) == (0.5, 0.7, 0.9)
    assert temperature_ladder(0.3, 0.0) == (0.3,)  # increment 0: no fallback


def test_batch_size_transcribes_vad_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    """--batch-size N: each file as ``kvcache.transcribe(file, batch_size=N)`` gives it, and
    the progress bar reaches the files' seconds (the silence VAD cut out counts as done)."""
    import kvcache

    files = [str(FIXTURES / "library.wav"), str(FIXTURES / "trip.wav")]
    assert main(["transcribe", *files, "--batch-size", "2"]) == 0
    captured = capsys.readouterr()
    for f in files:
        assert f"==> {f} <==\n{kvcache.transcribe(f, batch_size=2).text}\n" in captured.out
    assert "trip to the mountains next summer" in captured.out
    seconds = sum(soundfile.info(f).duration for f in files)
    done = re.search(r"transcribing: 100%.*\| (\d+\.\d)/(\d+\.\d) s of audio", captured.err)
    assert done and float(done.group(1)) == float(done.group(2)) == round(seconds, 1), captured.err
    assert main(["transcribe", files[0], "--batch-size", "0"]) == 2
    assert "--batch-size=0" in capsys.readouterr().err

"""Transcript files, one writer per format (txt, srt, vtt, json), as the whisper CLIs write them.

SubRip through the ``srt`` library, WebVTT through ``webvtt-py``; json holds the text, the
duration and every segment (start, end, text, tokens, avg_logprob, no_speech_prob,
compression_ratio, temperature).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

from kvcache.errors import InvalidArgumentError
from kvcache.transcription.longform import Transcript


def _txt(t: Transcript) -> str:
    return "".join(s.text.strip() + "\n" for s in t.segments)


def _srt(t: Transcript) -> str:
    import srt

    subs = [
        srt.Subtitle(i, timedelta(seconds=s.start), timedelta(seconds=s.end), s.text.strip())
        for i, s in enumerate(t.segments, start=1)
    ]
    return str(srt.compose(subs, reindex=False))


def _clock(seconds: float) -> str:
    """HH:MM:SS.mmm (WebVTT's cue time)."""
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}.{ms:03d}"


def _vtt(t: Transcript) -> str:
    import webvtt

    doc = webvtt.WebVTT()
    for s in t.segments:
        doc.captions.append(webvtt.Caption(_clock(s.start), _clock(s.end), s.text.strip()))
    return str(doc.content)


def _json(t: Transcript) -> str:
    segments = [asdict(s) for s in t.segments]
    return json.dumps({"text": t.text, "duration": t.duration, "segments": segments}, indent=1)


WRITERS: dict[str, Callable[[Transcript], str]] = {
    "txt": _txt,
    "srt": _srt,
    "vtt": _vtt,
    "json": _json,
}
FORMATS = (*WRITERS, "all")


def render(transcript: Transcript, fmt: str) -> str:
    """The text of ``transcript`` in format ``fmt`` (txt, srt, vtt, json)."""
    if fmt not in WRITERS:
        raise InvalidArgumentError("fmt", fmt, f"one of {sorted(WRITERS)}")
    return WRITERS[fmt](transcript)


def write(transcript: Transcript, out_dir: Path, stem: str, fmt: str) -> list[Path]:
    """Write ``out_dir/stem.<ext>`` for ``fmt`` (or every format for "all"); the paths."""
    if fmt not in FORMATS:
        raise InvalidArgumentError("output_format", fmt, f"one of {list(FORMATS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in WRITERS if fmt == "all" else (fmt,):
        path = out_dir / f"{stem}.{name}"
        path.write_text(render(transcript, name), encoding="utf-8")
        paths.append(path)
    return paths

"""Speech at the very end of a file, after a segment boundary, is transcribed: the ``tail_*``
clips of scripts/make_long_clips.py end with a sentence that starts 2-8 s before the end of
the file, after a pause, in a last window shorter than 30 s (alone, or after a full first
window), in several voices and speeds. Every spoken word is there, and the words are
faster-whisper's on the same model, threads and decode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from whisper_scoring import (
    faster_whisper_model,
    faster_whisper_segments,
    make_clips,
    sentence_recall,
    words,
)

import kvcache
from kvcache.audio.io import load_audio
from kvcache.transcription import Transcript
from kvcache.transcription.longform import LongForm
from kvcache.transcription.options import TranscribeOptions
from kvcache.transcription.transcriber import bundled

TAILS = ["tail_slow", "tail_fast", "tail_late", "tail_long", "tail_long_silence"]
RATE = 16000


@pytest.fixture(scope="module")
def tails(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tail clips, synthesized once for this module by the long-clip script."""
    return make_clips(tmp_path_factory.mktemp("tail-clips"), TAILS)


@pytest.fixture(scope="module")
def fw() -> Any:
    return faster_whisper_model()


def _meta(tails: Path, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((tails / f"{name}.json").read_text())
    return meta


_ours: dict[str, Transcript] = {}


def _transcribe(path: Path) -> Transcript:
    if str(path) not in _ours:
        _ours[str(path)] = kvcache.transcribe(path)  # a path: read as the CLI reads it
    return _ours[str(path)]


@pytest.mark.parametrize("name", TAILS)
def test_tail_layout(tails: Path, name: str) -> None:
    """The clips say what they claim: the last sentence starts 2-8 s before the end, after a
    pause of at least 0.75 s, and the long clips' last window is a short one."""
    meta = _meta(tails, name)
    *_, before, last = meta["sentences"]
    assert 2.0 <= meta["seconds"] - last["start"] <= 8.0
    assert last["start"] - before["end"] >= 0.75
    assert meta["seconds"] % 30.0 < 20.0  # the last window is under 30 s
    assert len({s["voice"] for s in meta["sentences"][-2:]}) == 2


@pytest.mark.parametrize("name", TAILS)
def test_every_word_of_the_tail_and_faster_whispers_words(tails: Path, fw: Any, name: str) -> None:
    meta = _meta(tails, name)
    sentences = [s["text"] for s in meta["sentences"]]
    ours = _transcribe(tails / f"{name}.wav")
    recall = sentence_recall(sentences, ours.text)
    assert recall[-2:] == [1.0, 1.0], (recall, ours.text)  # the last two: every word
    theirs = faster_whisper_segments(fw, load_audio(tails / f"{name}.wav"))
    assert words(ours.text) == words(" ".join(s.text for s in theirs))
    # the last sentence is a segment of its own, stamped where it is spoken
    *_, before, last = meta["sentences"]
    seg = ours.segments[-1]
    assert words(seg.text) == words(last["text"])
    assert before["end"] - 0.5 <= seg.start <= last["start"] + 0.5
    assert seg.end <= meta["seconds"] + 0.02


def test_short_last_window_is_zero_padded() -> None:
    """The last window's features past the audio are zeros (OpenAI's and faster-whisper's
    padding), not the log-mel of silence, which the features hold there."""
    tr = bundled()
    audio = np.zeros(40 * RATE, dtype=np.float32)
    audio[: 35 * RATE] = 0.1 * np.sin(np.arange(35 * RATE) * 0.05)
    job = LongForm(tr.features(audio), tr.tokenizer, TranscribeOptions(), 448)
    job.seek = 3000  # the second window: 10 s of audio
    req = job.request()
    assert req is not None and req.features is not None
    assert req.features.shape == (80, 3000)
    assert bool((req.features[:, :1000] == job.mel[:, 3000:4000]).all())
    assert bool((req.features[:, 1000:] == 0).all())
    assert float(job.mel[:, 4000:].abs().min()) > 0.1  # what the features hold after the audio

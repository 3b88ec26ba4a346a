"""VAD-batched long-form (``transcribe(..., batch_size=N)``): a file's speech regions merged
into chunks of <= 28 s, chunks decoded together. Chunks and the time map against
faster-whisper's ``collect_chunks`` / ``SpeechTimestampsMap``; on real speech: every VAD
region in the output, batch 8 equal to batch 1, WER within 0.02 of sequential long-form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from whisper_scoring import make_clips, sentence_recall, wer

import kvcache
from kvcache.audio.io import load_audio
from kvcache.audio.vad import detect_speech
from kvcache.errors import InvalidArgumentError
from kvcache.transcription import Transcript
from kvcache.transcription.chunks import Chunk, merge_regions
from kvcache.transcription.transcriber import BATCHED_VAD, VAD_CHUNK_SAMPLES

CLIPS = ["long90", "tail_long_silence"]
RATE = 16000


# ---- chunks and the time map (no model) ----------------------------------------------------
@st.composite
def _regions(draw: st.DrawFn) -> list[tuple[int, int]]:
    out, t = [], draw(st.integers(0, 5000))
    for _ in range(draw(st.integers(1, 12))):
        n = draw(st.integers(1, 4 * RATE))
        out.append((t, t + n))
        t += n + draw(st.integers(0, RATE))
    return out


@settings(max_examples=60, deadline=None)
@given(_regions(), st.sampled_from([5 * RATE, 9 * RATE]))
def test_chunks_equal_faster_whispers(regions: list[tuple[int, int]], limit: int) -> None:
    from faster_whisper.vad import collect_chunks

    audio = np.arange(regions[-1][1] + 10, dtype=np.float32)
    chunks = merge_regions(regions, limit)
    their_audio, their_meta = collect_chunks(
        audio, [{"start": a, "end": b} for a, b in regions], max_duration=limit / RATE
    )
    # faster-whisper's first region of a chunk is missing from that chunk's "segments"
    # (its audio is there): compare the audio, and our regions with the audio they cut
    assert len(chunks) == len(their_audio)
    for c, theirs in zip(chunks, their_audio, strict=True):
        np.testing.assert_array_equal(c.audio(audio), theirs)
        assert c.samples <= limit
    assert [r for c in chunks for r in c.regions] == regions  # every region, once, in order


@settings(max_examples=100, deadline=None)
@given(_regions(), st.data())
def test_file_time_equals_faster_whispers_map(regions: list[tuple[int, int]], data: Any) -> None:
    from faster_whisper.vad import SpeechTimestampsMap

    (chunk,) = merge_regions(regions, 10**9)  # one chunk: the map is faster-whisper's
    their = SpeechTimestampsMap([{"start": a, "end": b} for a, b in regions], RATE)
    ends = np.cumsum([b - a for a, b in regions]) / RATE
    t = data.draw(st.one_of(st.floats(0, chunk.samples / RATE), st.sampled_from(list(ends))))
    is_end = data.draw(st.booleans())
    assert chunk.file_time(t, is_end) == pytest.approx(
        their.get_original_time(t, is_end=is_end), abs=0.006
    )  # they round to 0.01 s, we to 0.001 s


def test_time_map_at_region_edges() -> None:
    chunk = Chunk(((16000, 32000), (64000, 80000)))  # 1-2 s and 4-5 s: chunk times 0-1, 1-2
    assert chunk.file_time(0.5) == 1.5
    assert chunk.file_time(1.0) == 4.0  # a start at the edge: the next region's start
    assert chunk.file_time(1.0, is_end=True) == 2.0  # an end there: the first region's end
    assert chunk.file_time(1.5, is_end=True) == 4.5


def test_bad_regions_are_typed_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="regions"):
        merge_regions([(10, 5)], 100)
    with pytest.raises(InvalidArgumentError, match="regions"):
        merge_regions([(0, 50), (40, 60)], 100)  # overlapping
    with pytest.raises(InvalidArgumentError, match="regions"):
        merge_regions([(0, 500)], 100)  # longer than a chunk
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        kvcache.transcribe(np.zeros(RATE, dtype=np.float32), batch_size=0)


# ---- on the real model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clips(tmp_path_factory.mktemp("batched-clips"), CLIPS)


_done: dict[tuple[str, int | None], Transcript] = {}


def _transcribe(clips: Path, name: str, batch_size: int | None) -> Transcript:
    if (name, batch_size) not in _done:
        _done[name, batch_size] = kvcache.transcribe(clips / f"{name}.wav", batch_size=batch_size)
    return _done[name, batch_size]


@pytest.mark.parametrize("name", CLIPS)
def test_every_speech_region_is_in_the_output(clips: Path, name: str) -> None:
    """Each region VAD found is overlapped by a segment (no chunk or chunk tail dropped),
    and the segments lie in order inside the file."""
    audio = load_audio(clips / f"{name}.wav")
    regions = detect_speech(audio, BATCHED_VAD)
    got = _transcribe(clips, name, 8)
    spans = [(s.start, s.end) for s in got.segments]
    for a, b in regions:
        assert any(s < b / RATE and e > a / RATE for s, e in spans), ((a / RATE, b / RATE), spans)
    assert spans == sorted(spans) and all(0 <= s < e <= got.duration + 0.01 for s, e in spans)
    meta = json.loads((clips / f"{name}.json").read_text())
    recall = sentence_recall([s["text"] for s in meta["sentences"]], got.text)
    assert min(recall) >= 0.4 and recall[-1] == 1.0, recall  # the file's last sentence too


def test_batch_of_eight_equals_one_at_a_time(clips: Path) -> None:
    eight, one = _transcribe(clips, "long90", 8), _transcribe(clips, "long90", 1)
    assert [(s.start, s.end, s.text) for s in eight.segments] == [
        (s.start, s.end, s.text) for s in one.segments
    ]
    assert eight.text == one.text and len(eight.segments) > 4


def test_wer_within_two_points_of_sequential_long_form(clips: Path) -> None:
    meta = json.loads((clips / "long90.json").read_text())
    reference = " ".join(s["text"] for s in meta["sentences"])
    batched = _transcribe(clips, "long90", 8)
    sequential = _transcribe(clips, "long90", None)
    assert wer(reference, batched.text) <= wer(reference, sequential.text) + 0.02
    assert batched.duration == sequential.duration  # whole 10 ms frames, as sequential


def test_each_chunk_is_decoded_in_one_window(clips: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks end 2 s short of the window, so the model finishes each chunk's last sentence in
    its first window: one encoder window a chunk (chunks filled to 30 s took 4 for 3)."""
    from kvcache.models.whisper import Whisper
    from kvcache.transcription import TranscribeOptions
    from kvcache.transcription.transcriber import bundled

    audio = load_audio(clips / "long90.wav")
    windows: list[int] = []
    encode = Whisper.forward_encoder

    def spy(self: Whisper, features: Any) -> Any:
        windows.append(int(features.shape[0]))
        return encode(self, features)

    monkeypatch.setattr(Whisper, "forward_encoder", spy)
    chunks = merge_regions(detect_speech(audio, BATCHED_VAD), VAD_CHUNK_SAMPLES)
    got = bundled().transcribe_chunks(audio, TranscribeOptions(), 8)
    assert sum(windows) == len(chunks) == 3, windows
    assert got.text == _transcribe(clips, "long90", 8).text

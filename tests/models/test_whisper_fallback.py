"""Whisper's decode-rejection rules, each fired by audio built to trigger it, on the real model:
a repetitive transcript (compression ratio > 2.4), a tone (avg log-prob < -1), noise (no
speech); and the prompt rules (previous text, initial prompt, reset after a hot decode)."""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcache.audio.io import load_audio
from kvcache.errors import InvalidArgumentError
from kvcache.transcription import TEMPERATURES, TranscribeOptions, Transcript, transcribe
from kvcache.transcription.longform import LongForm, compression_ratio
from kvcache.transcription.search import Decoded
from kvcache.transcription.transcriber import bundled
from kvcache.weights.ctranslate2 import bundled_whisper_dir

RATE = 16000


def _decodes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Decoded, float]]:
    """Every decode LongForm judges, with its compression ratio, in order."""
    seen: list[tuple[Decoded, float]] = []
    take = LongForm.take

    def spy(self: LongForm, decoded: Decoded) -> int:
        seen.append((decoded, compression_ratio(self.tok.decode(decoded.tokens).strip())))
        return take(self, decoded)

    monkeypatch.setattr(LongForm, "take", spy)
    return seen


@pytest.fixture(scope="module")
def repeated(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """espeak-ng saying "thank you" 25 times: a transcript that compresses 30 to 1."""
    wav = tmp_path_factory.mktemp("repeat") / "thanks.wav"
    text = "thank you, " * 25
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(wav), text], check=True)
    return load_audio(wav)


def _tone(seconds: float = 20.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


def _noise(seconds: float = 20.0) -> np.ndarray:
    return (0.05 * np.random.default_rng(0).standard_normal(int(seconds * RATE))).astype(np.float32)


def test_compression_ratio_falls_back_through_every_temperature(
    repeated: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tiny.en loops on "thank you" past the speech: every decode is too repetitive."""
    seen = _decodes(monkeypatch)
    ladder = (0.0, 1.0)  # a short ladder and 2 samples: each decode runs 224 tokens
    result = transcribe(repeated, temperature=ladder, best_of=2)
    assert [d.temperature for d, _ in seen] == list(ladder)  # 0.0 failed, then 1.0 did too
    assert all(ratio > 2.4 for _, ratio in seen)  # every one too repetitive: none passed
    assert len(seen[0][0].tokens) == 224  # the greedy decode looped to the length limit
    best = max(seen, key=lambda t: t[0].avg_logprob)[0]  # so the likeliest is kept
    (seg,) = result.segments
    assert seg.tokens == tuple(best.tokens) and seg.temperature == best.temperature
    assert seg.compression_ratio > 2.4 and "thank you" in seg.text.lower()


def test_low_log_probability_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _decodes(monkeypatch)
    result = transcribe(_tone())
    assert [d.temperature for d, _ in seen] == list(TEMPERATURES)
    assert all(d.avg_logprob < -1.0 and d.no_speech_prob < 0.6 for d, _ in seen)
    best = max((d for d, _ in seen), key=lambda d: d.avg_logprob)
    assert [s.temperature for s in result.segments] == [best.temperature]
    assert [s.avg_logprob for s in result.segments] == [best.avg_logprob]
    seen.clear()
    transcribe(_tone(), log_prob_threshold=None)
    assert [d.temperature for d, _ in seen] == [0.0]


def test_no_speech_window_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _decodes(monkeypatch)
    result = transcribe(_noise())
    assert result.segments == [] and result.text == ""
    (only,) = seen  # silence: no fallback either, though the log-prob is low
    assert only[0].no_speech_prob > 0.6 and only[0].avg_logprob < -1.0
    hallucinated = transcribe(_noise(), no_speech_threshold=None, temperature=0.0)
    assert hallucinated.text.strip()  # what the rule removed


def test_noise_between_speech_keeps_the_speech() -> None:
    fixtures = Path(__file__).parent.parent / "fixtures" / "audio"
    speech = load_audio(fixtures / "meeting.wav")
    audio = np.concatenate([speech, _noise(32.0), speech])
    result = transcribe(audio)
    assert result.text.lower().count("good morning") == 2
    gap = (len(speech) / RATE + 1.0, len(speech) / RATE + 31.0)
    assert not [s for s in result.segments if gap[0] < s.start and s.end < gap[1]]


# ---- prompts -----------------------------------------------------------------------------
@cache
def _vocab() -> dict[str, int]:
    """The special tokens' ids as the model's tokenizer.json lists them (read here, apart
    from the code under test)."""
    data = json.loads((bundled_whisper_dir() / "tokenizer.json").read_text())
    return {t["content"]: int(t["id"]) for t in data["added_tokens"]}


@cache
def _bpe(text: str) -> tuple[int, ...]:
    """Text token ids of ``text`` from tokenizer.json's BPE, loaded here."""
    from tokenizers import Tokenizer

    bpe = Tokenizer.from_file(str(bundled_whisper_dir() / "tokenizer.json"))
    return tuple(bpe.encode(text, add_special_tokens=False).ids)


SOT_PREV, SOT = "<|startofprev|>", "<|startoftranscript|>"


def _ts(seconds: float) -> int:
    """The id of timestamp <|seconds|>: they follow <|notimestamps|>, one per 0.02 s."""
    return _vocab()["<|notimestamps|>"] + 1 + round(seconds / 0.02)


def _job(**options: Any) -> LongForm:
    tr = bundled()
    audio = np.zeros(75 * RATE, dtype=np.float32)  # three windows of features
    return LongForm(tr.features(audio), tr.tokenizer, TranscribeOptions(**options), 448)


def _said(
    text: str, temperature: float = 0.0, avg_logprob: float = -0.1, no_speech: float = 0.01
) -> Decoded:
    """A decode saying ``text`` in one closed segment of 5 s."""
    tokens = [_ts(0.0), *_bpe(text), _ts(5.0), _ts(5.0)]
    return Decoded(tokens, avg_logprob * (len(tokens) + 1), no_speech, temperature)


def test_previous_text_prompts_the_next_window() -> None:
    job = _job(initial_prompt="Glossary: kvcache.")
    ids = _vocab()
    first = job.request()
    assert first is not None and first.features is not None
    assert first.prompt == [ids[SOT_PREV], *_bpe(" Glossary: kvcache."), ids[SOT]]
    assert job.take(_said(" Hello there.")) == 500  # seek to the closing pair: 5 s
    nxt = job.request()
    assert nxt is not None and nxt.features is not None and nxt.temperature == 0.0
    said = [_ts(0.0), *_bpe(" Hello there."), _ts(5.0)]  # the segment's tokens
    assert nxt.prompt == [ids[SOT_PREV], *_bpe(" Glossary: kvcache."), *said, ids[SOT]]
    assert [s.text for s in job.segments] == [" Hello there."]
    plain = _job(condition_on_previous_text=False)
    plain.take(_said(" Hello there."))
    assert plain.request().prompt == [ids[SOT]]  # type: ignore[union-attr]
    bare = _job(without_timestamps=True)
    assert bare.request().prompt == [ids[SOT], ids["<|notimestamps|>"]]  # type: ignore[union-attr]


def test_prompt_resets_after_a_hot_decode_and_fallback_keeps_the_window() -> None:
    job = _job()
    first = job.request()
    assert first is not None and first.features is not None
    assert job.take(_said(" la" * 60)) == 0  # too repetitive: decode the window again
    again = job.request()
    assert again is not None and again.features is None and again.temperature == 0.2
    asked = []
    for t in TEMPERATURES[1:4]:
        assert job.take(_said(" la" * 60, t)) == 0
        nxt = job.request()
        assert nxt is not None and nxt.features is None
        asked.append(nxt.temperature)
    assert asked == list(TEMPERATURES[2:5])
    assert job.take(_said(" Fine words.", 0.8)) == 500  # 0.8 passes
    assert job.segments[-1].text == " Fine words." and job.segments[-1].temperature == 0.8
    assert job.request().prompt == [_vocab()[SOT]]  # type: ignore[union-attr]  # 0.8 > 0.5: reset


# ---- the no-speech rule --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("avg_logprob", "options", "kept"),
    [
        (-0.3, {}, True),  # no-speech 0.9 but a confident decode (> -1): speech, kept
        (-1.5, {}, False),  # no-speech 0.9 and an unlikely decode: silence, skipped
        (-0.3, {"log_prob_threshold": None}, False),  # no log-prob rule: no-speech alone
        (-1.5, {"no_speech_threshold": None}, True),  # no no-speech rule: never skipped
    ],
)
def test_no_speech_rule_and_its_log_prob_exemption(
    avg_logprob: float, options: dict[str, Any], kept: bool
) -> None:
    """faster-whisper's rule: skip when no-speech prob > 0.6, unless avg log-prob > -1."""
    job = _job(temperatures=(0.0,), **options)  # one temperature: no fallback to wait for
    assert job.request() is not None
    advanced = job.take(_said(" Hello there.", avg_logprob=avg_logprob, no_speech=0.9))
    assert [s.text for s in job.segments] == ([" Hello there."] if kept else [])
    assert advanced == (500 if kept else 3000)  # skipped: the whole window
    if kept:
        assert job.segments[0].no_speech_prob == 0.9
        assert job.segments[0].avg_logprob == pytest.approx(avg_logprob)


def test_unlikely_silence_does_not_fall_back() -> None:
    """No-speech > 0.6 with a low log-prob is silence: skipped at once, no hotter decode."""
    job = _job()
    job.request()
    assert job.take(_said(" Hello there.", avg_logprob=-1.5, no_speech=0.9)) == 3000
    speech = _job()
    speech.request()
    assert speech.take(_said(" Hello there.", avg_logprob=-1.5, no_speech=0.1)) == 0  # fall back


def test_bad_options_are_typed_errors() -> None:
    audio = np.zeros(RATE, dtype=np.float32)
    for kwargs in (
        {"beam_size": 0},
        {"temperature": -0.5},
        {"temperature": []},
        {"best_of": 0},
        {"no_speech_threshold": float("nan")},
        {"initial_prompt": 5},
        {"unknown_option": 1},
    ):
        with pytest.raises(InvalidArgumentError):
            transcribe(audio, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="audio"):
        transcribe(np.zeros((2, 10), dtype=np.float32))
    assert isinstance(transcribe(torch.zeros(RATE)), Transcript)

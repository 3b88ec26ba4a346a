"""Log-mel features against transformers.WhisperFeatureExtractor; audio loading and resampling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from transformers import WhisperFeatureExtractor

from kvcache.audio import io as audio_io
from kvcache.audio.io import load_audio, resample
from kvcache.audio.mel import (
    CHUNK_FRAMES,
    CHUNK_SAMPLES,
    log_mel_spectrogram,
    mel_filters,
    whisper_features,
)
from kvcache.errors import InvalidArgumentError, NotSupportedError

FIXTURES = Path(__file__).parent.parent / "fixtures" / "audio"


@pytest.fixture(scope="module")
def extractor() -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(feature_size=80)


def _reference(fe: WhisperFeatureExtractor, audio: np.ndarray) -> np.ndarray:
    return fe(audio, sampling_rate=16000, return_tensors="np").input_features[0]


def test_filterbank_matches_transformers(extractor: WhisperFeatureExtractor) -> None:
    ours = mel_filters(80).numpy()  # [80, 201]
    assert ours.shape == (80, 201)
    assert np.abs(ours - extractor.mel_filters.T).max() < 1e-7


@pytest.mark.parametrize("seconds", [0.005, 2.5, 30.0, 41.3])
def test_features_match_transformers_on_noise(
    extractor: WhisperFeatureExtractor, seconds: float
) -> None:
    rng = np.random.default_rng(int(seconds * 1000))
    audio = (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)
    ours = whisper_features(audio).numpy()
    assert ours.shape == (80, CHUNK_FRAMES)
    assert np.abs(ours - _reference(extractor, audio)).max() < 1e-4


def test_features_match_transformers_on_speech(extractor: WhisperFeatureExtractor) -> None:
    audio = load_audio(FIXTURES / "stella.wav")
    ours = whisper_features(audio).numpy()
    ref = _reference(extractor, audio)
    assert np.abs(ours - ref).max() < 1e-4
    assert ref.std() > 0.1  # real content, not a padded constant


def test_padded_long_spectrogram_starts_like_one_window() -> None:
    """transcribe() slices windows from one spectrogram padded by 30 s of zeros."""
    audio = load_audio(FIXTURES / "trip.wav")
    full = log_mel_spectrogram(audio, padding=CHUNK_SAMPLES)
    assert full.shape == (80, (len(audio) + CHUNK_SAMPLES) // 160)
    assert torch.allclose(full[:, :CHUNK_FRAMES], whisper_features(audio), atol=1e-5)


def test_bad_audio_shape_is_a_typed_error() -> None:
    with pytest.raises(InvalidArgumentError, match="audio"):
        whisper_features(np.zeros((2, 100), dtype=np.float32))


def test_load_resamples_and_mixes_down(tmp_path: Path) -> None:
    rate, seconds, hz = 44100, 1.5, 440.0
    t = np.arange(int(rate * seconds)) / rate
    left = 0.5 * np.sin(2 * np.pi * hz * t)
    stereo = np.stack([left, left], axis=1)  # [n, 2]: identical channels mix to the same tone
    soundfile.write(tmp_path / "tone.wav", stereo, rate, subtype="PCM_16")
    audio = load_audio(tmp_path / "tone.wav")
    assert audio.dtype == np.float32
    assert abs(len(audio) - seconds * 16000) <= 1
    spectrum = np.abs(np.fft.rfft(audio))
    peak_hz = np.argmax(spectrum) * 16000 / len(audio)
    assert abs(peak_hz - hz) < 2.0
    assert abs(np.abs(audio[1000:-1000]).max() - 0.5) < 0.01  # no gain change


def test_resample_is_identity_at_16k() -> None:
    x = np.linspace(-1, 1, 100, dtype=np.float32)
    assert np.array_equal(resample(x, 16000), x)
    with pytest.raises(InvalidArgumentError, match="rate"):
        resample(x, 0)


def test_unknown_format_without_ffmpeg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "clip.m4a"
    p.write_bytes(b"\0\0\0\x18ftypM4A not really audio")
    monkeypatch.setattr(audio_io.shutil, "which", lambda name: None)
    with pytest.raises(NotSupportedError, match="ffmpeg"):
        load_audio(p)


def test_missing_file() -> None:
    with pytest.raises(InvalidArgumentError, match="path"):
        load_audio("/nonexistent/audio.wav")

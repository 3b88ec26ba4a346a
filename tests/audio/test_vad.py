"""Silero VAD on onnxruntime against faster-whisper's own VAD (same model file): the same
speech probabilities and the same regions, on synthesized speech and on hand-made scores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.audio.io import load_audio
from kvcache.audio.vad import VadOptions, detect_speech, model_path, speech_probs, speech_regions
from kvcache.errors import InvalidArgumentError

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_long_clips.py"
BATCHED = {"max_speech_duration_s": 30.0, "min_silence_duration_ms": 160}  # fw's batched VAD


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    out = tmp_path_factory.mktemp("vad-clips")
    subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--clips", "long45"],
        check=True,
        capture_output=True,
    )
    return load_audio(out / "long45.wav")


def _theirs(audio: np.ndarray, **options: Any) -> list[tuple[int, int]]:
    from faster_whisper.vad import VadOptions as TheirOptions
    from faster_whisper.vad import get_speech_timestamps

    return [(d["start"], d["end"]) for d in get_speech_timestamps(audio, TheirOptions(**options))]


def test_model_is_faster_whispers_asset() -> None:
    assert model_path().name == "silero_vad_v6.onnx" and model_path().parent.name == "assets"


@pytest.mark.parametrize("options", [{}, BATCHED, {"threshold": 0.7, "speech_pad_ms": 100}])
def test_regions_equal_faster_whispers(speech: np.ndarray, options: dict[str, Any]) -> None:
    ours = detect_speech(speech, VadOptions(**options))
    assert ours == _theirs(speech, **options)
    assert len(ours) >= 2 and all(a < b for a, b in ours)


def test_probabilities_equal_faster_whispers(speech: np.ndarray) -> None:
    from faster_whisper.vad import get_vad_model

    x = speech[: 20 * 16000 + 100]  # a partial last frame
    padded = np.pad(x, (0, 512 - len(x) % 512))
    theirs = np.asarray(get_vad_model()(padded)).reshape(-1)
    np.testing.assert_allclose(speech_probs(x), theirs, atol=1e-6)
    assert speech_probs(np.zeros(16000, dtype=np.float32)).max() < 0.1  # silence


@st.composite
def _scores(draw: st.DrawFn) -> np.ndarray:
    """Runs of speech-like and silence-like frame scores, some in between the thresholds."""
    runs = draw(
        st.lists(st.tuples(st.sampled_from([0.05, 0.4, 0.9]), st.integers(1, 80)), max_size=30)
    )
    return np.array([p for p, n in runs for _ in range(n)] or [0.0], dtype=np.float32)


@settings(max_examples=300, deadline=None)
@given(
    _scores(),
    st.sampled_from(
        [
            {},
            BATCHED,
            {"max_speech_duration_s": 2.0, "min_silence_duration_ms": 100},
            {"max_speech_duration_s": 2.0, "min_silence_duration_ms": 600},  # split at silences
        ]
    ),
)
def test_region_rules_equal_faster_whispers(probs: np.ndarray, options: dict[str, Any]) -> None:
    """Our state machine on scores faster-whisper's rules are fed the same scores."""
    import faster_whisper.vad as fv

    n_samples = len(probs) * 512 - 7

    class Fixed:
        def __call__(self, audio: np.ndarray) -> np.ndarray:
            return probs[: len(audio) // 512]

    real = fv.get_vad_model
    fv.get_vad_model = lambda: Fixed()  # type: ignore[assignment]
    try:
        theirs = _theirs(np.zeros(n_samples, dtype=np.float32), **options)
    finally:
        fv.get_vad_model = real
    assert speech_regions(probs, n_samples, VadOptions(**options)) == theirs


def test_bad_options_are_typed_errors() -> None:
    for kwargs in ({"threshold": 1.5}, {"speech_pad_ms": -1}, {"max_speech_duration_s": 0}):
        with pytest.raises(InvalidArgumentError):
            VadOptions(**kwargs)  # type: ignore[arg-type]

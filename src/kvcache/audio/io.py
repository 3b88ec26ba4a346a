"""Read audio files as 16 kHz mono float32 (Whisper's input): soundfile first, ffmpeg otherwise."""

from __future__ import annotations

import shutil
import subprocess
from math import gcd
from pathlib import Path

import numpy as np

from kvcache.audio.mel import SAMPLE_RATE
from kvcache.errors import InvalidArgumentError, NotSupportedError


def resample(audio: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Polyphase resampling (anti-aliased) of 1-D audio from ``rate`` to ``target`` Hz."""
    if rate <= 0:
        raise InvalidArgumentError("rate", rate, "a sample rate > 0")
    if rate == target:
        return audio.astype(np.float32, copy=False)
    from scipy.signal import resample_poly

    g = gcd(rate, target)
    return resample_poly(audio, target // g, rate // g).astype(np.float32)


def _read_soundfile(path: Path) -> tuple[np.ndarray, int] | None:
    import soundfile

    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)  # [n, channels]
    except soundfile.LibsndfileError:
        return None  # not a format libsndfile knows (mp3 on old builds, m4a, ...)
    return data.mean(axis=1), int(rate)


def _read_ffmpeg(path: Path, rate: int) -> np.ndarray:
    exe = shutil.which("ffmpeg")
    if exe is None:
        raise NotSupportedError(
            f"path={str(path)!r}: soundfile cannot read this format and ffmpeg is not installed; "
            "use WAV/FLAC/OGG or install ffmpeg"
        )
    cmd = [
        exe,
        "-nostdin",
        "-v",
        "error",
        "-i",
        str(path),
        "-f",
        "f32le",
        "-ac",
        "1",
        "-ar",
        str(rate),
        "-",
    ]
    proc = subprocess.run(cmd, capture_output=True, check=False)
    if proc.returncode != 0:
        raise InvalidArgumentError(
            "path",
            str(path),
            f"an audio file ffmpeg can decode ({proc.stderr.decode(errors='replace').strip()})",
        )
    return np.frombuffer(proc.stdout, dtype=np.float32).copy()


def load_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Samples [n] float32 of a file, mixed to mono and resampled to ``sample_rate``."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError("path", str(path), "an existing audio file")
    read = _read_soundfile(path)
    if read is None:
        return _read_ffmpeg(path, sample_rate)
    audio, rate = read
    return resample(audio, rate, sample_rate)

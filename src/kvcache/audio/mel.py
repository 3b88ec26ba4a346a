"""Whisper's log-mel front end in torch: 16 kHz audio -> [n_mels, frames] features.

Recipe (OpenAI Whisper / ``transformers.WhisperFeatureExtractor``): reflect-pad n_fft/2,
periodic Hann window of 400, hop 160, |STFT|^2, drop the last frame, Slaney 80-mel
filterbank, log10 clamped at 1e-10, floor at (max - 8), then (x + 4) / 4. One 30 s window
is 480000 samples -> 3000 frames -> the encoder's 1500 positions.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from kvcache.errors import InvalidArgumentError

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
CHUNK_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS  # 480000
CHUNK_FRAMES = CHUNK_SAMPLES // HOP_LENGTH  # 3000
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100

# Slaney mel scale: linear below 1 kHz, logarithmic above
_F_SP = 200.0 / 3.0
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOG_STEP = math.log(6.4) / 27.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    mel = hz / _F_SP
    log_region = hz >= _MIN_LOG_HZ
    mel[log_region] = _MIN_LOG_MEL + np.log(hz[log_region] / _MIN_LOG_HZ) / _LOG_STEP
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = mel * _F_SP
    log_region = mel >= _MIN_LOG_MEL
    hz[log_region] = _MIN_LOG_HZ * np.exp(_LOG_STEP * (mel[log_region] - _MIN_LOG_MEL))
    return hz


@lru_cache(maxsize=4)
def mel_filters(
    n_mels: int = 80, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE
) -> torch.Tensor:
    """Slaney-normalised triangular filters [n_mels, n_fft // 2 + 1], computed once in float64."""
    fft_hz = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)  # [F]
    edges_mel = np.linspace(0.0, _hz_to_mel(np.array([sample_rate / 2]))[0], n_mels + 2)
    edges_hz = _mel_to_hz(edges_mel)  # [n_mels + 2]
    widths = np.diff(edges_hz)  # [n_mels + 1]
    slopes = edges_hz[:, None] - fft_hz[None, :]  # [n_mels + 2, F]
    down = -slopes[:-2] / widths[:-1, None]
    up = slopes[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(down, up))  # [n_mels, F]
    weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]  # Slaney area normalisation
    return torch.from_numpy(weights).to(torch.float32)


def _as_audio(audio: torch.Tensor | np.ndarray) -> torch.Tensor:
    x = torch.as_tensor(audio)
    if x.dim() != 1 or not x.is_floating_point():
        raise InvalidArgumentError(
            "audio",
            f"<{x.dtype} tensor of shape {tuple(x.shape)}>",
            "a 1-D float array of 16 kHz samples",
        )
    return x.to(torch.float32)


def log_mel_spectrogram(
    audio: torch.Tensor | np.ndarray, n_mels: int = 80, padding: int = 0
) -> torch.Tensor:
    """Log-mel features [n_mels, (len + padding) // hop] of 16 kHz mono audio (zeros appended)."""
    x = _as_audio(audio)
    if padding > 0:
        x = torch.nn.functional.pad(x, (0, padding))
    if x.numel() < N_FFT // 2 + 1:  # reflect padding needs more samples than half a window
        x = torch.nn.functional.pad(x, (0, N_FFT // 2 + 1 - x.numel()))
    window = torch.hann_window(N_FFT, periodic=True)
    stft = torch.stft(
        x, N_FFT, HOP_LENGTH, window=window, center=True, pad_mode="reflect", return_complex=True
    )
    power = stft[:, :-1].abs() ** 2  # [F, frames]: drop the last frame
    mel = mel_filters(n_mels) @ power  # [n_mels, frames]
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def pad_or_trim(audio: torch.Tensor | np.ndarray, length: int = CHUNK_SAMPLES) -> torch.Tensor:
    """Cut or zero-pad 1-D audio to exactly ``length`` samples."""
    x = _as_audio(audio)
    if x.numel() >= length:
        return x[:length]
    return torch.nn.functional.pad(x, (0, length - x.numel()))


def whisper_features(audio: torch.Tensor | np.ndarray, n_mels: int = 80) -> torch.Tensor:
    """Features [n_mels, 3000] of one 30 s window, as WhisperFeatureExtractor computes them."""
    return log_mel_spectrogram(pad_or_trim(audio), n_mels)

"""Voice activity detection with Silero VAD (the ONNX model faster-whisper ships), on onnxruntime.

The model scores frames of 512 samples (32 ms at 16 kHz), each seen with the 64 samples before
it; ``speech_regions`` turns the scores into speech regions as Silero's and faster-whisper's
``get_speech_timestamps`` do: speech starts at a frame scored >= ``threshold``, ends after
``min_silence_duration_ms`` below ``neg_threshold``, a region longer than
``max_speech_duration_s`` is split at its last silence of 98 ms or more (else cut), and each
region is padded by ``speech_pad_ms`` (half the gap where two regions are closer than that).
Regions are sample indices ``(start, end)`` into the audio.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.errors import InvalidArgumentError, NotSupportedError

SAMPLE_RATE = 16000
FRAME = 512  # samples the model scores at once
CONTEXT = 64  # samples of the previous frame it sees with each frame
STATE_SHAPE = (1, 1, 128)  # the model's recurrent state (h and c)
MODEL_FILE = "silero_vad_v6.onnx"


@dataclass(frozen=True)
class VadOptions:
    """Silero VAD's knobs (faster-whisper's names and defaults)."""

    threshold: float = 0.5
    neg_threshold: float | None = None  # None: max(threshold - 0.15, 0.01)
    min_speech_duration_ms: int = 0
    max_speech_duration_s: float = math.inf
    min_silence_duration_ms: int = 2000
    speech_pad_ms: int = 400

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise InvalidArgumentError("threshold", self.threshold, "a probability in (0, 1)")
        for name in ("min_speech_duration_ms", "min_silence_duration_ms", "speech_pad_ms"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(name, getattr(self, name), "milliseconds >= 0")
        if not self.max_speech_duration_s > 0:
            raise InvalidArgumentError(
                "max_speech_duration_s", self.max_speech_duration_s, "seconds > 0"
            )


def model_path() -> Path:
    """The Silero VAD model file of the installed faster-whisper (found, not imported: the
    package imports CTranslate2 and PyAV)."""
    spec = importlib.util.find_spec("faster_whisper")
    folders = [] if spec is None else list(spec.submodule_search_locations or [])
    for folder in folders:
        path = Path(folder) / "assets" / MODEL_FILE
        if path.is_file():
            return path
    raise NotSupportedError(
        f"batched transcription needs the Silero VAD model ({MODEL_FILE}) that faster-whisper "
        "ships and onnxruntime to run it: pip install 'kvcache[vad]'"
    )


@lru_cache(maxsize=1)
def _session() -> Any:
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover - installed with the vad extra
        raise NotSupportedError("voice activity detection needs onnxruntime") from e
    opts = onnxruntime.SessionOptions()
    opts.inter_op_num_threads = 1
    opts.intra_op_num_threads = 1  # a small model: one thread, no contention with torch
    opts.log_severity_level = 4
    return onnxruntime.InferenceSession(
        str(model_path()), providers=["CPUExecutionProvider"], sess_options=opts
    )


def speech_probs(audio: np.ndarray) -> np.ndarray:
    """Speech probability of each 512-sample frame [len // 512 + 1] of 16 kHz audio."""
    x = np.asarray(audio, dtype=np.float32).reshape(-1)
    n = len(x) // FRAME + 1  # zeros appended up to a whole frame, always (as faster-whisper)
    frames = np.zeros((n, FRAME), dtype=np.float32)
    frames.reshape(-1)[: len(x)] = x
    frames[-1, -CONTEXT:] = 0  # faster-whisper clears the last frame's tail, kept for parity
    context = np.zeros((n, CONTEXT), dtype=np.float32)  # frame i sees frame i-1's tail
    context[1:] = frames[:-1, -CONTEXT:]
    batch = np.concatenate([context, frames], axis=1)  # [n, 576]
    h = np.zeros(STATE_SHAPE, dtype=np.float32)
    c = np.zeros(STATE_SHAPE, dtype=np.float32)
    probs, _, _ = _session().run(None, {"input": batch, "h": h, "c": c})
    return np.asarray(probs, dtype=np.float32).reshape(-1)[:n]


def speech_regions(
    probs: np.ndarray, n_samples: int, options: VadOptions = VadOptions()
) -> list[tuple[int, int]]:
    """Speech regions (start, end) in samples from per-frame speech probabilities."""
    sr = SAMPLE_RATE
    on = options.threshold
    off = max(on - 0.15, 0.01) if options.neg_threshold is None else options.neg_threshold
    pad = sr * options.speech_pad_ms / 1000
    min_speech = sr * options.min_speech_duration_ms / 1000
    min_silence = sr * options.min_silence_duration_ms / 1000
    max_speech = sr * options.max_speech_duration_s - FRAME - 2 * pad
    split_silence = sr * 98 / 1000  # a silence this long may end a region that is too long
    regions: list[list[int]] = []
    start: int | None = None
    silence_from = 0  # where the current silence began (0: none)
    last_split_end = next_start = 0  # a split point inside the current region
    for i, p in enumerate(np.asarray(probs, dtype=np.float64).tolist()):
        at = FRAME * i
        if p >= on and silence_from:
            silence_from = 0
            if next_start < last_split_end:
                next_start = at
        if p >= on and start is None:
            start = at
            continue
        if start is not None and at - start > max_speech:
            if last_split_end:  # end at the last long-enough silence
                regions.append([start, last_split_end])
                start = None if next_start < last_split_end else next_start
            else:  # none: cut here
                regions.append([start, at])
                start = None
            last_split_end = next_start = silence_from = 0
            if start is None:
                continue
        if p < off and start is not None:
            silence_from = silence_from or at
            if at - silence_from > split_silence:
                last_split_end = silence_from
            if at - silence_from < min_silence:
                continue
            if silence_from - start > min_speech:
                regions.append([start, silence_from])
            start = None
            last_split_end = next_start = silence_from = 0
    if start is not None and n_samples - start > min_speech:
        regions.append([start, n_samples])
    return _pad(regions, n_samples, pad)


def _pad(regions: list[list[int]], n_samples: int, pad: float) -> list[tuple[int, int]]:
    """Widen each region by ``pad`` samples; two closer than 2 * pad meet half way."""
    for i, r in enumerate(regions):
        if i == 0:
            r[0] = int(max(0, r[0] - pad))
        if i + 1 < len(regions):
            nxt = regions[i + 1]
            gap = nxt[0] - r[1]
            if gap < 2 * pad:
                r[1] += int(gap // 2)
                nxt[0] = int(max(0, nxt[0] - gap // 2))
            else:
                r[1] = int(min(n_samples, r[1] + pad))
                nxt[0] = int(max(0, nxt[0] - pad))
        else:
            r[1] = int(min(n_samples, r[1] + pad))
    return [(int(a), int(b)) for a, b in regions]


def detect_speech(audio: np.ndarray, options: VadOptions = VadOptions()) -> list[tuple[int, int]]:
    """Speech regions (start, end) in samples of 16 kHz mono audio."""
    return speech_regions(speech_probs(audio), len(audio), options)

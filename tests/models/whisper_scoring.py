"""Scoring Whisper transcripts against the spoken text and against faster-whisper, shared by
the long-form tests: the synthesized clips, per-sentence recall on one monotone alignment, WER,
the reference model."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jiwer
import numpy as np
from whisper_normalizer.english import EnglishTextNormalizer

from kvcache.weights.ctranslate2 import bundled_whisper_dir

NORM = EnglishTextNormalizer()
CLIP_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_long_clips.py"


def make_clips(out: Path, names: Sequence[str] = ()) -> Path:
    """Synthesize the clips ``names`` (all when empty) into ``out`` with the long-clip script,
    the single source of the audio; returns ``out``."""
    command = [sys.executable, str(CLIP_SCRIPT), str(out)]
    if names:
        command += ["--clips", *names]
    subprocess.run(command, check=True, capture_output=True)
    return out


def words(text: str) -> list[str]:
    """The normalized words of ``text`` (OpenAI's English normalizer)."""
    return NORM(text).split()


def sentence_recall(sentences: list[str], hypothesis: str) -> list[float]:
    """For each spoken sentence, the share of its words the alignment of the whole
    hypothesis against the whole reference matches (monotone: in order, or not at all)."""
    refs = [words(s) for s in sentences]
    owner = [i for i, ws in enumerate(refs) for _ in ws]
    hyp = " ".join(words(hypothesis))
    if not hyp:
        return [0.0] * len(refs)
    out = jiwer.process_words(" ".join(" ".join(r) for r in refs), hyp)
    hits = [0] * len(refs)
    for chunk in out.alignments[0]:
        if chunk.type == "equal":
            for j in range(chunk.ref_start_idx, chunk.ref_end_idx):
                hits[owner[j]] += 1
    return [h / len(r) for h, r in zip(hits, refs, strict=True)]


def wer(reference: str, hypothesis: str) -> float:
    return float(jiwer.wer(NORM(reference), NORM(hypothesis)))


def faster_whisper_model() -> Any:
    """faster-whisper on the bundled tiny.en folder, float32, 2 threads (as benchmarks/whisper.py)."""
    from faster_whisper import WhisperModel

    return WhisperModel(
        str(bundled_whisper_dir()), device="cpu", compute_type="float32", cpu_threads=2
    )


def faster_whisper_segments(model: Any, audio: np.ndarray, **options: Any) -> list[Any]:
    """faster-whisper's segments of 16 kHz float32 samples, greedy (beam 1) unless told."""
    options.setdefault("beam_size", 1)
    segments, _ = model.transcribe(audio.astype(np.float32, copy=False), **options)
    return list(segments)

"""The loaded model and tokenizer, and the functions users call: ``transcribe`` (one input)
and ``transcribe_many`` (several, decoded together in one cell cache)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from kvcache.audio.mel import (
    CHUNK_SAMPLES,
    FRAMES_PER_SECOND,
    HOP_LENGTH,
    SAMPLE_RATE,
    log_mel_spectrogram,
)
from kvcache.audio.vad import VadOptions
from kvcache.errors import InvalidArgumentError
from kvcache.models.whisper import Whisper
from kvcache.models.whisper_decode import WhisperKVCache
from kvcache.text.whisper_tokenizer import WhisperTokenizer
from kvcache.transcription.batch import BatchDecoder, make_search
from kvcache.transcription.chunks import merge_regions
from kvcache.transcription.longform import LongForm, Request, Transcript
from kvcache.transcription.options import TEMPERATURES, TranscribeOptions
from kvcache.transcription.rules import LogitRules
from kvcache.transcription.search import run_search
from kvcache.validate import int_arg

AudioInput = str | Path | np.ndarray | torch.Tensor


# A VAD chunk leaves the last 2 s of its 30-s window empty: speech up to the window's end makes
# the model stop before its last sentence, and decoding on from there costs a second window.
VAD_CHUNK_SAMPLES = 28 * SAMPLE_RATE
BATCHED_VAD = VadOptions(
    max_speech_duration_s=VAD_CHUNK_SAMPLES / SAMPLE_RATE, min_silence_duration_ms=160
)


class Transcriber:
    """A loaded model + tokenizer + suppress lists: transcribe many inputs with one load."""

    def __init__(
        self,
        model: Whisper,
        tokenizer: WhisperTokenizer,
        suppress: Sequence[int],
        suppress_begin: Sequence[int],
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.suppress = list(suppress)
        self.suppress_begin = list(suppress_begin)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Transcriber:
        """Load a CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json)."""
        from kvcache.weights.ctranslate2 import bundled_whisper_dir

        root = bundled_whisper_dir() if path is None else Path(path)
        cfg_file = root / "config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        return cls(
            Whisper.from_ctranslate2(root),
            WhisperTokenizer(root),
            config.get("suppress_ids", []),
            config.get("suppress_ids_begin", []),
        )

    def prompt(self, timestamps: bool) -> list[int]:
        """tiny.en's prompt: <|startoftranscript|> (+ <|notimestamps|> without timestamps)."""
        sp = self.tokenizer.special
        return [sp.sot] if timestamps else [sp.sot, sp.no_timestamps]

    def rules(self, timestamps: bool) -> LogitRules:
        """The suppress lists of the model's config.json, plus the timestamp rules if asked."""
        sp = self.tokenizer.special
        return LogitRules(
            sp, self.model.config.n_vocab, self.suppress, self.suppress_begin, timestamps
        )

    def decode_window(
        self, features: torch.Tensor, *, beam_size: int = 1, timestamps: bool = False
    ) -> list[int]:
        """Tokens (no prompt, no eot) of one window's features [n_mels, 3000] at temperature 0,
        with no previous text: what CTranslate2's ``generate`` returns for the same prompt."""
        with torch.inference_mode():
            audio = self.model.forward_encoder(features.unsqueeze(0))  # [1, 1500, n]
        prompt = self.prompt(timestamps)
        ctx = self.model.config.n_text_ctx
        request = Request(prompt, 0.0, None, min(ctx // 2, ctx + 1 - len(prompt)))
        options = TranscribeOptions(beam_size=beam_size)
        k = options.seqs_per_file
        cache = WhisperKVCache(self.model, audio, max_sequences=k)
        try:
            search = make_search(request, list(range(k)), self.rules(timestamps), options, None)
            return run_search(self.model, search, cache).tokens
        finally:
            cache.close()

    def features(self, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Log-mel features [n_mels, frames + 3000] of 16 kHz audio (30 s of zeros appended
        before the STFT, as OpenAI's; ``LongForm`` cuts the windows and zero-pads a short one)."""
        return log_mel_spectrogram(
            torch.as_tensor(audio, dtype=torch.float32), padding=CHUNK_SAMPLES
        )

    def transcribe_many(
        self,
        audios: Sequence[np.ndarray | torch.Tensor],
        options: TranscribeOptions,
        progress: Callable[[int], None] | None = None,
        max_batch: int = 8,
    ) -> list[Transcript]:
        """Transcripts of several 16 kHz inputs decoded together (``max_batch`` at a time);
        ``progress(frames)`` is called as windows finish (100 frames per second)."""
        ctx = self.model.config.n_text_ctx
        jobs = [LongForm(self.features(a), self.tokenizer, options, ctx) for a in audios]
        BatchDecoder(self.model, self.rules, options, max_batch).run(jobs, progress)
        return [job.transcript() for job in jobs]

    def transcribe(
        self,
        audio: np.ndarray | torch.Tensor,
        options: TranscribeOptions,
        progress: Callable[[int], None] | None = None,
    ) -> Transcript:
        """Transcript of one 16 kHz input (the batched path with one file)."""
        return self.transcribe_many([audio], options, progress)[0]

    def transcribe_chunks(
        self,
        audio: np.ndarray,
        options: TranscribeOptions,
        batch_size: int,
        progress: Callable[[int], None] | None = None,
    ) -> Transcript:
        """Transcript of one 16 kHz input from its speech (Silero VAD) merged into chunks of
        at most 28 s, ``batch_size`` chunks decoded together (faster-whisper's batched
        pipeline). No previous-text prompt across chunks, and no window skipped as silence:
        VAD found speech in each; a chunk whose decode stops before its end is decoded on from
        there, so no chunk's speech is dropped."""
        from kvcache.audio.vad import detect_speech

        samples = np.asarray(audio, dtype=np.float32)
        chunks = merge_regions(detect_speech(samples, BATCHED_VAD), VAD_CHUNK_SAMPLES)
        if progress is not None:  # the silence VAD cut out counts as done
            progress(
                (len(samples) - sum(c.samples for c in chunks)) * FRAMES_PER_SECOND // SAMPLE_RATE
            )
        opts = replace(options, condition_on_previous_text=False, no_speech_threshold=None)
        ctx = self.model.config.n_text_ctx
        jobs = [
            LongForm(self.features(c.audio(samples)), self.tokenizer, opts, ctx) for c in chunks
        ]
        BatchDecoder(self.model, self.rules, opts, batch_size).run(jobs, progress)
        segments = [
            replace(s, start=c.file_time(s.start), end=c.file_time(s.end, is_end=True))
            for c, job in zip(chunks, jobs, strict=True)
            for s in job.segments
        ]
        text = "".join(s.text for s in segments).strip()
        return Transcript(text, segments, len(samples) // HOP_LENGTH / FRAMES_PER_SECOND)


@contextmanager
def progress_bar(
    audios: Sequence[np.ndarray], enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """A tqdm bar on stderr over the seconds of ``audios``; yields the ``progress(frames)``
    callback that ``transcribe_many`` calls as windows finish."""
    from tqdm import tqdm

    seconds = sum(len(a) for a in audios) / SAMPLE_RATE
    fmt = "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s of audio [{elapsed}<{remaining}]"
    with tqdm(
        total=round(seconds, 2), desc="transcribing", bar_format=fmt, disable=not enabled,
        file=sys.stderr,
    ) as bar:  # fmt: skip
        yield lambda frames: bar.update(frames / FRAMES_PER_SECOND)


@lru_cache(maxsize=2)
def bundled(path: str | None = None) -> Transcriber:
    """The Transcriber of a model directory (None = bundled tiny.en), loaded once."""
    return Transcriber.load(path)


def read_audio(audio: AudioInput, name: str = "audio") -> np.ndarray:
    """16 kHz mono float32 samples of a path (any format soundfile/ffmpeg read) or an array."""
    if isinstance(audio, str | Path):
        from kvcache.audio.io import load_audio

        return load_audio(audio)
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().cpu().numpy()
    if not isinstance(audio, np.ndarray):
        raise InvalidArgumentError(name, type(audio).__name__, "a path or 1-D 16 kHz samples")
    if audio.ndim != 1 or not np.issubdtype(audio.dtype, np.floating):
        raise InvalidArgumentError(
            name,
            f"<{audio.dtype} array of shape {audio.shape}>",
            "a path or 1-D float 16 kHz samples",
        )
    return audio.astype(np.float32, copy=False)


def _options(
    beam_size: int,
    temperature: float | Sequence[float],
    initial_prompt: str | None,
    condition_on_previous_text: bool,
    extra: dict[str, object],
) -> TranscribeOptions:
    known = {f.name for f in fields(TranscribeOptions)} - {"temperatures"}
    for key in extra:
        if key not in known:
            raise InvalidArgumentError(key, extra[key], f"a keyword among {sorted(known)}")
    temps = TranscribeOptions.temperatures_of(temperature)
    return TranscribeOptions(
        beam_size=beam_size,
        temperatures=temps,
        initial_prompt=initial_prompt,
        condition_on_previous_text=condition_on_previous_text,
        **extra,  # type: ignore[arg-type]
    )


def transcribe(
    audio: AudioInput,
    *,
    beam_size: int = 1,
    temperature: float | Sequence[float] = TEMPERATURES,
    initial_prompt: str | None = None,
    condition_on_previous_text: bool = True,
    model: str | Path | None = None,
    progress: bool = False,
    batch_size: int | None = None,
    **options: object,
) -> Transcript:
    """Transcribe a file (WAV/FLAC/OGG, other formats through ffmpeg) or 16 kHz mono samples
    with Whisper tiny.en, all of it, window after window (OpenAI's long-form algorithm).

    ``temperature``: one float, or the fallback ladder (default 0.0, 0.2, ..., 1.0).
    Further keywords are :class:`TranscribeOptions` fields (``best_of``, ``patience``,
    ``compression_ratio_threshold``, ``log_prob_threshold``, ``no_speech_threshold``,
    ``without_timestamps``, ``seed``, ...). ``model``: a CTranslate2 Whisper directory;
    ``progress``: a bar over seconds of audio on stderr. ``batch_size``: VAD-batched instead
    (speech found by Silero VAD, merged into chunks of up to 28 s, ``batch_size`` chunks
    decoded together, no previous-text prompt: faster-whisper's ``BatchedInferencePipeline``).
    """
    opts = _options(beam_size, temperature, initial_prompt, condition_on_previous_text, options)
    if batch_size is not None:
        batch_size = int_arg("batch_size", batch_size, minimum=1)
    samples = read_audio(audio)
    tr = bundled(None if model is None else str(model))
    with progress_bar([samples], progress) as advance:
        if batch_size is not None:
            return tr.transcribe_chunks(samples, opts, batch_size, advance)
        return tr.transcribe(samples, opts, advance)


def transcribe_many(
    audios: Sequence[AudioInput],
    *,
    beam_size: int = 1,
    temperature: float | Sequence[float] = TEMPERATURES,
    initial_prompt: str | None = None,
    condition_on_previous_text: bool = True,
    model: str | Path | None = None,
    max_batch: int = 8,
    progress: bool = False,
    **options: object,
) -> list[Transcript]:
    """Transcribe several inputs decoded together in one cell cache (one batched decoder
    step for all); each transcript equals that input transcribed alone."""
    opts = _options(beam_size, temperature, initial_prompt, condition_on_previous_text, options)
    samples = [read_audio(a, f"audios[{i}]") for i, a in enumerate(audios)]
    tr = bundled(None if model is None else str(model))
    with progress_bar(samples, progress) as advance:
        return tr.transcribe_many(samples, opts, advance, max_batch)

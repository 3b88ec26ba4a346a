"""Whisper's byte-level BPE (the model's ``tokenizer.json``) plus its special and timestamp ids.

Ids of the English-only vocabulary (51864 entries)::

    0 .. 50255           text BPE tokens
    50256                <|endoftext|>       (eot)
    50257                <|startoftranscript|>  (sot)
    50258 .. 50361       languages, tasks, <|startoflm|>, <|startofprev|>, <|nocaptions|>
    50362                <|notimestamps|>
    50363 .. 51863       <|0.00|> .. <|30.00|> in steps of 0.02 s (not in tokenizer.json)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvcache.errors import InvalidArgumentError

SECONDS_PER_TIMESTAMP = 0.02


@dataclass(frozen=True)
class SpecialTokens:
    """The ids decoding rules need, read from the vocabulary."""

    eot: int
    sot: int
    no_timestamps: int
    timestamp_begin: int  # <|0.00|>
    sot_prev: int | None = None  # <|startofprev|>: previous text follows (the prompt)
    no_speech: int | None = None  # <|nospeech|> (<|nocaptions|> in English-only models)


class WhisperTokenizer:
    """Decode token ids to text; know which ids are special or timestamps."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise InvalidArgumentError(
                "path", str(path), "a Whisper tokenizer.json or its directory"
            )
        self.tokenizer = Tokenizer.from_file(str(path))
        ids = {
            name: self._id(name)
            for name in ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>")
        }
        no_speech = self.tokenizer.token_to_id("<|nospeech|>")
        self.special = SpecialTokens(
            eot=ids["<|endoftext|>"],
            sot=ids["<|startoftranscript|>"],
            no_timestamps=ids["<|notimestamps|>"],
            timestamp_begin=ids["<|notimestamps|>"] + 1,
            sot_prev=self._id("<|startofprev|>"),
            no_speech=self._id("<|nocaptions|>") if no_speech is None else int(no_speech),
        )

    def _id(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise InvalidArgumentError(
                "path", token, "a Whisper tokenizer.json that defines this token"
            )
        return int(i)

    def encode(self, text: str) -> list[int]:
        """Text token ids (no special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of the text tokens among ``ids`` (special and timestamp tokens dropped)."""
        return str(self.tokenizer.decode([i for i in ids if i < self.special.eot]))

    def is_timestamp(self, token: int) -> bool:
        return token >= self.special.timestamp_begin

    def timestamp_seconds(self, token: int) -> float:
        """Seconds from the window start that a timestamp token stands for."""
        return (token - self.special.timestamp_begin) * SECONDS_PER_TIMESTAMP

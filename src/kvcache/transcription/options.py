"""The knobs of a transcription, validated once: OpenAI's ``transcribe`` defaults."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.errors import InvalidArgumentError
from kvcache.validate import int_arg

TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # the fallback ladder


def temperature_ladder(temperature: float, increment: float | None = 0.2) -> tuple[float, ...]:
    """OpenAI's CLI rule: ``temperature``, then steps of ``increment`` up to 1.0 (None/0: none)."""
    if not increment:
        return (float(temperature),)
    n = int(math.floor((1.0 - temperature) / increment + 1e-6)) + 1
    return tuple(round(temperature + i * increment, 6) for i in range(max(1, n)))


def _optional_float(name: str, v: float | None) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise InvalidArgumentError(name, v, "a finite float or None (rule off)")
    return float(v)


@dataclass(frozen=True)
class TranscribeOptions:
    """How each window is decoded and when a decode is rejected (faster-whisper's names).

    A window is decoded at ``temperatures[0]`` (beam search when 0 and ``beam_size`` > 1,
    else ``best_of`` samples); it falls back to the next temperature when its gzip
    compression ratio exceeds ``compression_ratio_threshold`` or its average log-probability
    falls below ``log_prob_threshold``. A window whose no-speech probability exceeds
    ``no_speech_threshold`` while its log-probability is that low is silence: skipped.
    """

    beam_size: int = 1
    best_of: int = 5
    patience: float = 1.0
    temperatures: tuple[float, ...] = TEMPERATURES
    compression_ratio_threshold: float | None = 2.4
    log_prob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    prompt_reset_on_temperature: float = 0.5
    initial_prompt: str | None = None
    without_timestamps: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        int_arg("beam_size", self.beam_size, minimum=1)
        int_arg("best_of", self.best_of, minimum=1)
        int_arg("seed", self.seed)
        if not (isinstance(self.patience, int | float) and self.patience > 0):
            raise InvalidArgumentError("patience", self.patience, "a float > 0")
        temps = self.temperatures
        if (
            not isinstance(temps, tuple)
            or not temps
            or not all(isinstance(t, int | float) and 0.0 <= t <= 2.0 for t in temps)
        ):
            raise InvalidArgumentError(
                "temperature", temps, "a float in [0, 2] or a non-empty sequence of them"
            )
        for name in ("compression_ratio_threshold", "log_prob_threshold", "no_speech_threshold"):
            _optional_float(name, getattr(self, name))
        if self.initial_prompt is not None and not isinstance(self.initial_prompt, str):
            raise InvalidArgumentError("initial_prompt", self.initial_prompt, "a str or None")

    @staticmethod
    def temperatures_of(temperature: float | Sequence[float]) -> tuple[float, ...]:
        """The ladder of a ``temperature=`` argument: one float or a sequence of them."""
        if isinstance(temperature, int | float) and not isinstance(temperature, bool):
            return (float(temperature),)
        if isinstance(temperature, Sequence) and not isinstance(temperature, str):
            return tuple(float(t) for t in temperature)
        raise InvalidArgumentError(
            "temperature", temperature, "a float in [0, 2] or a non-empty sequence of them"
        )

    @property
    def seqs_per_file(self) -> int:
        """Cache sequences one file's search may hold at once (beams and their children)."""
        return max(2 * self.beam_size, self.best_of)

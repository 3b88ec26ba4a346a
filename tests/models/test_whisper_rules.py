"""Whisper's suppress and timestamp rules on hand-made logits, and segment splitting."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.text.whisper_tokenizer import SpecialTokens, WhisperTokenizer
from kvcache.transcribe import MAX_INITIAL_TIMESTAMP_INDEX, LogitRules, split_segments
from kvcache.weights.ctranslate2 import bundled_whisper_dir

SP = SpecialTokens(eot=50256, sot=50257, no_timestamps=50362, timestamp_begin=50363)
V = 51864
TB = SP.timestamp_begin


def _allowed(
    rules: LogitRules, hist: list[int], logits: torch.Tensor | None = None
) -> torch.Tensor:
    row = torch.zeros(1, V) if logits is None else logits.clone()[None]
    rules.apply(row, [hist])
    return torch.isfinite(row[0])


@pytest.fixture(scope="module")
def ts_rules() -> LogitRules:
    return LogitRules(SP, V, suppress=[1, 2, 50257], suppress_begin=[220, SP.eot], timestamps=True)


def test_suppress_every_step_and_blank_at_begin() -> None:
    rules = LogitRules(SP, V, suppress=[1, 2], suppress_begin=[220, SP.eot], timestamps=False)
    first = _allowed(rules, [])
    assert not first[1] and not first[2] and not first[220] and not first[SP.eot]
    later = _allowed(rules, [400])
    assert not later[1] and later[220] and later[SP.eot]
    assert later[TB + 5]  # no timestamp rules without timestamps (CTranslate2 does the same)


def test_first_token_is_an_early_timestamp(ts_rules: LogitRules) -> None:
    ok = _allowed(ts_rules, [])
    assert not ok[:TB].any()
    assert ok[TB : TB + MAX_INITIAL_TIMESTAMP_INDEX + 1].all()
    assert not ok[TB + MAX_INITIAL_TIMESTAMP_INDEX + 1 :].any()


def test_timestamps_come_in_pairs(ts_rules: LogitRules) -> None:
    likely_eot = torch.zeros(V)
    likely_eot[SP.eot] = 10.0  # else the timestamps' total mass would also rule eot out
    after_open = _allowed(ts_rules, [TB, 400, TB + 30], likely_eot)  # one timestamp: close it
    assert not after_open[: SP.eot].any() and after_open[SP.eot]
    assert after_open[TB + 30 :].all() and not after_open[TB : TB + 30].any()  # never backwards
    after_pair = _allowed(ts_rules, [TB, 400, TB + 30, TB + 30])  # a pair: text must follow
    assert not after_pair[TB:].any() and after_pair[400]
    assert not _allowed(ts_rules, [TB, 400])[SP.no_timestamps]


def test_timestamp_forced_when_their_mass_wins(ts_rules: LogitRules) -> None:
    logits = torch.full((V,), -10.0)
    logits[400] = 2.0  # best single token is text ...
    logits[TB + 10 : TB + 60] = 1.0  # ... but 50 timestamps together weigh more
    assert math.log(50) + 1.0 > 2.0
    ok = _allowed(ts_rules, [TB, 401], logits)
    assert not ok[:TB].any() and ok[TB + 10]
    logits[TB + 10 : TB + 60] = -5.0
    ok = _allowed(ts_rules, [TB, 401], logits)
    assert ok[400]


def test_split_segments_and_seek() -> None:
    tok = WhisperTokenizer(bundled_whisper_dir())
    hello, world = tok.encode(" Hello"), tok.encode(" world")
    # two closed segments: seek to the last timestamp (2 frames per 0.02 s step)
    tokens = [TB, *hello, TB + 50, TB + 50, *world, TB + 120]
    segs, seek = split_segments(tokens, tok, offset=10.0, window_frames=3000)
    assert [(s.start, s.end, s.text) for s in segs] == [
        (10.0, 11.0, " Hello"),
        (11.0, 12.4, " world"),
    ]
    assert seek == 3000  # ends on a single timestamp: the window is done
    tokens = [TB, *hello, TB + 50, TB + 50, *world, TB + 120, TB + 120]
    segs, seek = split_segments(tokens, tok, offset=0.0, window_frames=3000)
    assert len(segs) == 2 and seek == 240
    segs, seek = split_segments([*hello], tok, offset=30.0, window_frames=1500)
    assert [(s.start, s.end) for s in segs] == [(30.0, 45.0)] and seek == 1500

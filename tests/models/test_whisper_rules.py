"""Whisper's suppress and timestamp rules on hand-made logits, and segment splitting."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.text.whisper_tokenizer import SpecialTokens, WhisperTokenizer
from kvcache.transcription.longform import split_segments
from kvcache.transcription.rules import MAX_INITIAL_TIMESTAMP_INDEX, LogitRules
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
    """faster-whisper's _split_segments_by_timestamps: cut at pairs, seek to the last one."""
    tok = WhisperTokenizer(bundled_whisper_dir())
    hello, world = tok.encode(" Hello"), tok.encode(" world")

    def spans(tokens: list[int], frames: int = 3000) -> tuple[list[tuple[int, int, str]], int]:
        """(start, end) in 0.02 s steps (end rounded down when it is the window's end)."""
        cuts, seek = split_segments(tokens, TB, frames)
        return [(round(c.start * 50), int(c.end * 50), tok.decode(c.tokens)) for c in cuts], seek

    # two closed segments ending on a single timestamp: no speech after it, the window is done
    assert spans([TB, *hello, TB + 50, TB + 50, *world, TB + 120]) == (
        [(0, 50, " Hello"), (50, 120, " world")],
        3000,
    )
    # ending on a pair: seek to it (2 frames per 0.02 s step); an unfinished tail is dropped
    assert spans([TB, *hello, TB + 50, TB + 50, *world, TB + 120, TB + 120]) == (
        [(0, 50, " Hello"), (50, 120, " world")],
        240,
    )
    assert spans([TB, *hello, TB + 50, TB + 50, *world]) == ([(0, 50, " Hello")], 100)
    # one segment without a closing timestamp, or no timestamps: the whole window
    assert spans([TB + 3, *hello], frames=1500) == ([(3, 750, " Hello")], 1500)
    assert split_segments([TB + 3, *hello], TB, 1501)[0][0].end == 15.01  # to the last frame
    assert spans([*hello], frames=1500) == ([(0, 750, " Hello")], 1500)
    assert spans([TB, *hello, TB + 40]) == ([(0, 40, " Hello")], 3000)


def test_seek_after_an_unequal_pair_goes_to_its_first_timestamp() -> None:
    """A window ending ``... <|1.00|><|1.20|> text`` (the next segment begun, not finished):
    the last whole segment ends at 1.00, so the next window starts there (100 frames), not
    at 1.20 where the unfinished segment began (its speech would be cut)."""
    tok = WhisperTokenizer(bundled_whisper_dir())
    hello, world = tok.encode(" Hello"), tok.encode(" world")
    cuts, seek = split_segments([TB, *hello, TB + 50, TB + 60, *world], TB, 3000)
    assert [(c.start, c.end) for c in cuts] == [(0.0, 1.0)] and seek == 100
    tokens = [TB, *hello, TB + 50, TB + 60, *world, TB + 120, TB + 130, *hello]
    cuts, seek = split_segments(tokens, TB, 3000)
    assert [(c.start, c.end) for c in cuts] == [(0.0, 1.0), (1.2, 2.4)] and seek == 240


def _fw_split(tokens: list[int], frames: int) -> tuple[list[tuple[float, float]], int]:
    """faster-whisper 1.2.1's own _split_segments_by_timestamps on the same tokens."""
    from faster_whisper.transcribe import WhisperModel

    model = SimpleNamespace(time_precision=0.02, input_stride=2)
    segments, seek, _ = WhisperModel._split_segments_by_timestamps(
        model,  # type: ignore[arg-type]
        SimpleNamespace(timestamp_begin=TB),  # type: ignore[arg-type]
        tokens, 0.0, frames, frames / 100, 0,
    )  # fmt: skip
    return [(s["start"], s["end"]) for s in segments], seek


@st.composite
def _timestamped(draw: st.DrawFn) -> list[int]:
    """Tokens as the timestamp rules allow them: segments of text between non-decreasing
    timestamps, at least one closed pair, ending on a pair, a lone timestamp or text."""
    t, out = draw(st.integers(0, 50)), []
    for _ in range(draw(st.integers(2, 5))):
        out += [TB + t, *draw(st.lists(st.integers(0, 50000), min_size=1, max_size=4))]
        t += draw(st.integers(1, 300))
        out.append(TB + t)
        t += draw(st.integers(0, 40))
    end = draw(st.sampled_from(["pair", "single", "text"]))
    if end == "pair":
        out.append(TB + t)
    elif end == "text":
        out += [TB + t, 400]
    return out


@settings(max_examples=300, deadline=None)
@given(_timestamped(), st.sampled_from([3000, 1700]))
def test_split_and_seek_equal_faster_whispers(tokens: list[int], frames: int) -> None:
    """Windows with at least one timestamp pair: the same cuts and the same seek."""
    cuts, seek = split_segments(tokens, TB, frames)
    theirs, their_seek = _fw_split(tokens, frames)
    assert [(c.start, c.end) for c in cuts] == [pytest.approx(x, abs=1e-9) for x in theirs]
    assert seek == their_seek

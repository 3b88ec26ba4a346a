"""Whisper tiny.en with its real CTranslate2 weights on espeak-ng speech, against ctranslate2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ctranslate2
import numpy as np
import pytest
import torch

from kvcache.audio.io import load_audio
from kvcache.audio.mel import whisper_features
from kvcache.models.whisper import WhisperKVCache, forward_decoder_cached
from kvcache.transcribe import DecodeOptions, Transcriber, beam_decode, greedy_decode, transcribe
from kvcache.weights.ctranslate2 import bundled_whisper_dir

FIXTURES = Path(__file__).parent.parent / "fixtures" / "audio"
SENTENCES: dict[str, str] = json.loads((FIXTURES / "sentences.json").read_text())
SOT, NO_TIMESTAMPS = 50257, 50362


@pytest.fixture(scope="module")
def tr() -> Transcriber:
    return Transcriber.load()


@pytest.fixture(scope="module")
def ct2() -> ctranslate2.models.Whisper:
    return ctranslate2.models.Whisper(
        str(bundled_whisper_dir()),
        device="cpu",
        compute_type="float32",
        intra_threads=torch.get_num_threads(),
    )


def normalise(text: str) -> list[str]:
    """Lower case words without punctuation."""
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def _features(name: str) -> torch.Tensor:
    return whisper_features(load_audio(FIXTURES / name))  # [80, 3000]


def _ct2_tokens(
    ct2: ctranslate2.models.Whisper, feats: torch.Tensor, prompt: list[int], beam: int = 1
) -> list[int]:
    view = ctranslate2.StorageView.from_array(np.ascontiguousarray(feats[None].numpy()))
    return list(ct2.generate(view, [prompt], beam_size=beam)[0].sequences_ids[0])


@pytest.mark.parametrize("name", sorted(SENTENCES))
def test_fixture_transcript(tr: Transcriber, ct2: ctranslate2.models.Whisper, name: str) -> None:
    """Our greedy transcript is the sentence, or (where tiny.en mishears) ctranslate2's."""
    feats = _features(name)
    ours = tr.decode_window(feats, DecodeOptions())
    text = tr.tokenizer.decode(ours)
    if normalise(text) != normalise(SENTENCES[name]):
        assert ours == _ct2_tokens(ct2, feats, [SOT, NO_TIMESTAMPS]), text


def test_most_fixtures_are_heard_right(tr: Transcriber) -> None:
    """Guard on the fixtures themselves: tiny.en gets at least 4 of the 6 sentences exactly."""
    right = sum(
        normalise(tr.tokenizer.decode(tr.decode_window(_features(n), DecodeOptions())))
        == normalise(s)
        for n, s in SENTENCES.items()
    )
    assert right >= 4


def test_encoder_matches_ctranslate2(tr: Transcriber, ct2: ctranslate2.models.Whisper) -> None:
    feats = _features("stella.wav")
    with torch.inference_mode():
        ours = tr.model.forward_encoder(feats[None])[0]
    theirs = np.array(
        ct2.encode(ctranslate2.StorageView.from_array(feats[None].numpy()), to_cpu=True)
    )[0]
    assert ours.shape == theirs.shape == (1500, 384)
    assert np.abs(ours.numpy() - theirs).max() < 2e-4  # measured 2e-5 (|x| up to 12)


def test_cached_and_uncached_greedy_give_identical_tokens(tr: Transcriber) -> None:
    feats = _features("report.wav")
    with torch.inference_mode():
        audio = tr.model.forward_encoder(feats[None])
    prompt = tr.prompt(timestamps=False)
    rules = tr.rules(timestamps=False)
    cached = greedy_decode(tr.model, audio, prompt, rules, max_new=224, cached=True)
    uncached = greedy_decode(tr.model, audio, prompt, rules, max_new=224, cached=False)
    assert len(cached) > 8
    assert cached == uncached


def test_real_cached_logits_equal_full_decoder(tr: Transcriber) -> None:
    with torch.inference_mode():
        audio = tr.model.forward_encoder(_features("trip.wav")[None])
        tokens = [SOT, NO_TIMESTAMPS, *tr.tokenizer.encode(" We should plan a short trip")]
        full = tr.model.forward_decoder(torch.tensor([tokens]), audio)[0]
    cache = WhisperKVCache(tr.model, audio)
    for i, t in enumerate(tokens):
        assert (forward_decoder_cached(tr.model, t, cache) - full[i]).abs().max().item() < 1e-3
    assert cache.step == len(tokens)


def test_timestamps_match_ctranslate2(tr: Transcriber, ct2: ctranslate2.models.Whisper) -> None:
    feats = _features("library.wav")
    ours = tr.decode_window(feats, DecodeOptions(timestamps=True))
    assert ours == _ct2_tokens(ct2, feats, [SOT])
    assert tr.tokenizer.is_timestamp(ours[0]) and tr.tokenizer.is_timestamp(ours[-1])


def test_beam_search(tr: Transcriber) -> None:
    feats = _features("stella.wav")
    with torch.inference_mode():
        audio = tr.model.forward_encoder(feats[None])
    prompt, rules = tr.prompt(False), tr.rules(False)
    greedy = greedy_decode(tr.model, audio, prompt, rules, 224)
    assert beam_decode(tr.model, audio, prompt, rules, 224, beam_size=1) == greedy
    beams = beam_decode(tr.model, audio, prompt, rules, 224, beam_size=4)
    assert normalise(tr.tokenizer.decode(beams)) == normalise(SENTENCES["stella.wav"])


def test_transcribe_long_audio_in_windows(tr: Transcriber) -> None:
    gap = np.zeros(8000, dtype=np.float32)  # 0.5 s
    audio = np.concatenate([x for n in SENTENCES for x in (load_audio(FIXTURES / n), gap)])
    assert len(audio) > 30 * 16000
    result = tr.transcribe(audio, DecodeOptions(timestamps=True))
    assert normalise(result.text) == normalise(" ".join(SENTENCES.values()))
    starts = [s.start for s in result.segments]
    assert starts == sorted(starts) and result.segments[-1].end > 30.0
    assert all(s.end >= s.start for s in result.segments)


def test_transcribe_function_on_a_path_and_an_array() -> None:
    path = FIXTURES / "meeting.wav"
    a = transcribe(path)
    b = transcribe(load_audio(path), beam_size=2)
    assert normalise(a.text) == normalise(SENTENCES["meeting.wav"]) == normalise(str(b))
    t = transcribe(path, timestamps=True)
    assert t.segments and t.segments[0].start == 0.0 and 3.0 < t.segments[-1].end < 7.0

"""Whisper tiny.en with its real CTranslate2 weights on espeak-ng speech, against ctranslate2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ctranslate2
import numpy as np
import pytest
import torch
from whisper_reference import greedy_uncached

from kvcache.audio.io import load_audio
from kvcache.audio.mel import whisper_features
from kvcache.models.whisper_decode import (
    WhisperKVCache,
    forward_decoder_cached,
    forward_decoder_step,
)
from kvcache.transcription import Transcriber, transcribe
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
    ours = tr.decode_window(feats)
    text = tr.tokenizer.decode(ours)
    if normalise(text) != normalise(SENTENCES[name]):
        assert ours == _ct2_tokens(ct2, feats, [SOT, NO_TIMESTAMPS]), text


def test_most_fixtures_are_heard_right(tr: Transcriber) -> None:
    """Guard on the fixtures themselves: tiny.en gets at least 4 of the 6 sentences exactly."""
    right = sum(
        normalise(tr.tokenizer.decode(tr.decode_window(_features(n)))) == normalise(s)
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
    cached = tr.decode_window(feats)
    uncached = greedy_uncached(tr.model, audio, prompt, rules, max_new=224)
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
    ours = tr.decode_window(feats, timestamps=True)
    assert ours == _ct2_tokens(ct2, feats, [SOT])
    assert tr.tokenizer.is_timestamp(ours[0]) and tr.tokenizer.is_timestamp(ours[-1])


def test_decoder_logits_match_ctranslate2(tr: Transcriber, ct2: ctranslate2.models.Whisper) -> None:
    """Cached step logits of every generated token vs CTranslate2's own (return_logits_vocab)."""
    feats = _features("trip.wav")
    view = ctranslate2.StorageView.from_array(np.ascontiguousarray(feats[None].numpy()))
    prompt = [SOT, NO_TIMESTAMPS]
    res = ct2.generate(view, [prompt], beam_size=1, return_logits_vocab=True)[0]
    tokens = list(res.sequences_ids[0])
    theirs = np.stack([np.array(x) for x in res.logits[0]])  # [steps, V]: steps = tokens + eot
    assert theirs.shape == (len(tokens) + 1, 51864) and len(tokens) > 8
    with torch.inference_mode():
        audio = tr.model.forward_encoder(feats[None])
        cache = WhisperKVCache(tr.model, audio)
        ours = [forward_decoder_step(tr.model, prompt, [0] * len(prompt), cache)[-1]]
        ours += [forward_decoder_cached(tr.model, t, cache) for t in tokens]
    got = torch.stack(ours).numpy()
    finite = theirs > -1e30  # CTranslate2 sets its suppressed ids to -FLT_MAX
    assert finite.sum() > 0.99 * theirs.size
    err = np.abs(got[finite] - theirs[finite]).max()
    assert err < 5e-4, err  # measured 5.8e-5 (logits up to ~14)


def test_beam_search(tr: Transcriber, ct2: ctranslate2.models.Whisper) -> None:
    feats = _features("stella.wav")
    greedy = tr.decode_window(feats)
    assert tr.decode_window(feats, beam_size=1) == greedy
    beams = tr.decode_window(feats, beam_size=4)
    assert normalise(tr.tokenizer.decode(beams)) == normalise(SENTENCES["stella.wav"])
    assert beams == _ct2_tokens(ct2, feats, [SOT, NO_TIMESTAMPS], beam=4)


def test_transcribe_long_audio_in_windows(tr: Transcriber) -> None:
    gap = np.zeros(8000, dtype=np.float32)  # 0.5 s
    audio = np.concatenate([x for n in SENTENCES for x in (load_audio(FIXTURES / n), gap)])
    assert len(audio) > 30 * 16000
    result = transcribe(audio)
    assert normalise(result.text) == normalise(" ".join(SENTENCES.values()))
    starts = [s.start for s in result.segments]
    assert starts == sorted(starts) and result.segments[-1].end > 30.0
    assert all(s.end >= s.start for s in result.segments)


def test_transcribe_function_on_a_path_and_an_array() -> None:
    import kvcache

    assert kvcache.transcribe is transcribe and callable(kvcache.transcribe)
    path = FIXTURES / "meeting.wav"
    a = transcribe(path)
    b = transcribe(load_audio(path), beam_size=2)
    c = transcribe(torch.from_numpy(load_audio(path)), temperature=0.0)
    assert normalise(a.text) == normalise(SENTENCES["meeting.wav"]) == normalise(str(b))
    assert c.text == a.text
    assert a.segments and a.segments[0].start == 0.0 and 3.0 < a.segments[-1].end < 7.0
    seg = a.segments[0]
    assert seg.avg_logprob < 0 and 0 <= seg.no_speech_prob < 0.6 and seg.compression_ratio > 0

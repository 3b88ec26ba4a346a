"""The SentencePiece tokenizer built from Gemma 3's GGUF against transformers' tokenizer read
from the same GGUF, and Gemma's chat template."""

from __future__ import annotations

from typing import Any

import pytest

from kvcache.errors import InvalidArgumentError
from kvcache.text.tokenizer import Tokenizer

MULTILINGUAL = (
    "The quick brown fox jumps over the lazy dog. Le cœur a ses raisons que la raison ne "
    "connaît point. Über den Wolken muss die Freiheit wohl grenzenlos sein. "
    "天下大势，分久必合，合久必分。吾輩は猫である。名前はまだ無い。 "
    "Все счастливые семьи похожи друг на друга. ألف ليلة وليلة. नमस्ते दुनिया! "
    "🦙🚀 emoji and rare: \U0001d54f\U00010348 \U0002a6d6 \ue000 \u200b zero-width\n"
    "def f(x):\n\tif x  >  1:\n        return   x ** 2\n\n\n   trailing spaces   \n"
    "<start_of_turn> written in text, <bos> too, and [multimodal]. 3.14159 1,000,000 12345678"
)


def test_multilingual_ids_equal_transformers(gemma3_tokenizer: Tokenizer, gemma3_hf_tokenizer: Any):
    ours = gemma3_tokenizer.encode(MULTILINGUAL)
    assert ours == gemma3_hf_tokenizer.encode(MULTILINGUAL)  # BOS first in both
    assert ours[0] == gemma3_tokenizer.bos_id == 2
    assert gemma3_tokenizer.decode(ours) == MULTILINGUAL.replace("<start_of_turn>", "").replace(
        "<bos>", ""
    )  # specials skipped; everything else (byte fallback included) round-trips
    assert gemma3_tokenizer.decode(ours, skip_special=False) == "<bos>" + MULTILINGUAL
    # a character outside the vocabulary is spelled by its UTF-8 bytes (<0xNN> pieces)
    ids = gemma3_tokenizer.encode("\U0002a6d6", add_bos=False)  # a CJK Extension B ideograph
    pieces = [gemma3_tokenizer.backend.id_to_token(i) for i in ids]
    assert pieces == ["<0xF0>", "<0xAA>", "<0x9B>", "<0x96>"]


def test_chat_template_text_and_ids(gemma3_tokenizer: Tokenizer, gemma3_hf_tokenizer: Any):
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France? "},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Japan (日本)?"},
    ]
    text = gemma3_tokenizer.apply_chat(messages)
    assert text == (
        "<bos><start_of_turn>user\nYou answer in one word.\n\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Japan (日本)?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = gemma3_tokenizer.encode(text)
    assert ids == gemma3_hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(gemma3_tokenizer.bos_id) == 1  # the template's BOS, no second one
    start, end = (gemma3_tokenizer.token_id(t) for t in ("<start_of_turn>", "<end_of_turn>"))
    assert (start, end) == (105, 106) and ids.count(start) == 4 and ids.count(end) == 3
    assert end in gemma3_tokenizer.stop_ids and gemma3_tokenizer.eos_id in gemma3_tokenizer.stop_ids


def test_chat_template_refuses_roles_out_of_turn(gemma3_tokenizer: Tokenizer):
    with pytest.raises(InvalidArgumentError, match="alternate"):
        gemma3_tokenizer.apply_chat(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )

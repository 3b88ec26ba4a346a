"""benchmarks/ruler_tasks.py: the long-context task generators and RULER's scorer, with the
real SmolLM2 tokenizer and the Debian license texts the harness uses."""

from __future__ import annotations

import re
from collections import Counter

import pytest

import ruler_tasks as rt
from common import LICENSES
from kvcache.text.tokenizer import Tokenizer

HAYSTACK_TASKS = ["passkey", "niah_single", "niah_multikey", "vt"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf()


@pytest.fixture(scope="module")
def corpus(tokenizer: Tokenizer) -> rt.Corpus:
    files = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())
    return rt.Corpus(tokenizer, "".join(p.read_text(errors="replace") for p in files))


@pytest.fixture(scope="module")
def fmt(tokenizer: Tokenizer) -> rt.PromptFormat:
    return rt.PromptFormat(lambda c: tokenizer.apply_chat([{"role": "user", "content": c}]))


@pytest.mark.parametrize("task", list(rt.TASKS))
@pytest.mark.parametrize("target", [1024, 2048, 4096, 8192])
def test_token_count_within_two_percent(task, target, corpus, fmt, tokenizer) -> None:
    s = rt.make_sample(task, target, 3, 7, corpus, fmt)
    n = len(tokenizer.encode(s.context, add_bos=False))
    n += len(tokenizer.encode(s.question, add_bos=False))
    assert abs(n - target) <= 0.02 * target, (task, target, n)


@pytest.mark.parametrize("task", HAYSTACK_TASKS)
@pytest.mark.parametrize("index", range(4))
def test_needles_sit_in_the_haystack_at_their_depth(task, index, corpus, fmt) -> None:
    s = rt.make_sample(task, 2048, index, 0, corpus, fmt)
    assert s.haystack in s.context and len(s.needles) == len(s.depths) >= 1
    for needle, depth in zip(s.needles, s.depths, strict=True):
        assert s.haystack.count(needle) == 1, needle
        at = s.haystack.index(needle) / len(s.haystack)
        assert abs(at - depth) < 0.03, (needle, depth, at)
    for answer in s.answers:  # every expected answer is written in some needle
        assert any(answer in n for n in s.needles), (answer, s.needles)
    assert s.answers[0] not in s.question or task != "passkey"


def test_multikey_asks_for_one_key_among_distractors(corpus, fmt) -> None:
    s = rt.make_sample("niah_multikey", 1024, 0, 0, corpus, fmt)
    keys = [re.search(r"for (\S+) is", n).group(1) for n in s.needles]  # type: ignore[union-attr]
    assert len(set(keys)) == 4
    asked = [k for k in keys if k in s.question]
    assert len(asked) == 1
    assert f"for {asked[0]} is: {s.answers[0]}." in s.haystack


@pytest.mark.parametrize("index", range(6))
def test_variable_chain_is_in_reading_order(index, corpus, fmt) -> None:
    s = rt.make_sample("vt", 1024, index, 0, corpus, fmt)
    first, *rest = s.needles
    value = re.fullmatch(r"VAR \w+ = (\d+)\.", first).group(1)  # type: ignore[union-attr]
    assert f"the value {value}" in s.question
    names = [re.match(r"VAR (\w+)", n).group(1) for n in s.needles]  # type: ignore[union-attr]
    assert list(s.answers) == names
    assert [s.haystack.index(n) for n in s.needles] == sorted(
        s.haystack.index(n) for n in s.needles
    )
    for prev, n in zip(names, rest, strict=False):
        assert n.endswith(f"= VAR {prev}.")


def test_common_words_are_the_most_frequent(corpus, fmt) -> None:
    s = rt.make_sample("cwe", 2048, 0, 0, corpus, fmt)
    words = re.findall(r"\d+\. (\w+)", s.haystack)
    counts = Counter(words)
    top = [w for w, _ in counts.most_common(len(s.answers))]
    assert sorted(top) == sorted(s.answers)
    assert {counts[a] for a in s.answers} == {30}
    assert {c for w, c in counts.items() if w not in s.answers} == {3}
    assert [int(i) for i in re.findall(r"(\d+)\. ", s.haystack)] == list(range(1, len(words) + 1))


def test_samples_are_a_function_of_the_seed(corpus, fmt) -> None:
    a = rt.make_sample("niah_single", 1024, 2, 5, corpus, fmt)
    assert a == rt.make_sample("niah_single", 1024, 2, 5, corpus, fmt)
    others = [rt.make_sample("niah_single", 1024, 2, 6, corpus, fmt)]
    others.append(rt.make_sample("niah_single", 1024, 3, 5, corpus, fmt))
    for b in others:
        assert b.answers != a.answers and b.haystack != a.haystack


def test_the_split_is_the_chat_prompt(tokenizer, corpus, fmt) -> None:
    """context + question = the chat template over the whole user turn + the answer prefix."""
    s = rt.make_sample("passkey", 1024, 0, 0, corpus, fmt)
    user = s.context.split("<|im_start|>user\n", 1)[1] + s.question.split("<|im_end|>")[0]
    whole = tokenizer.apply_chat([{"role": "user", "content": user}])
    assert s.context + s.question == whole + "The pass key is"
    assert "pass key?" not in s.context and s.question.startswith("\n\nWhat is the pass key?")


def test_insert_needles_snaps_to_sentence_ends() -> None:
    hay = "Alpha beta. Gamma delta. Epsilon zeta. Eta theta."
    assert rt.insert_needles(hay, ["N."], [0.0]) == "N. " + hay
    assert rt.insert_needles(hay, ["N."], [1.0]) == hay + "N."
    mid = rt.insert_needles(hay, ["N."], [0.5])
    assert mid == "Alpha beta. Gamma delta. N. Epsilon zeta. Eta theta."
    two = rt.insert_needles(hay, ["B.", "A."], [0.9, 0.2])
    assert two.index("A.") < two.index("B.") and two.count("A.") == two.count("B.") == 1


def test_string_match_all() -> None:
    assert rt.string_match_all(" 12345.\n\nThe", ["12345"]) == 1.0
    assert rt.string_match_all("they are: ABCDE, fghij", ["ABCDE", "FGHIJ", "KLMNO"]) == 2 / 3
    assert rt.string_match_all("1234", ["12345"]) == 0.0
    with pytest.raises(ValueError, match="answers"):
        rt.string_match_all("x", [])


def test_unknown_task_is_a_value_error(corpus, fmt) -> None:
    with pytest.raises(ValueError, match="'ruler'"):
        rt.make_sample("ruler", 1024, 0, 0, corpus, fmt)

"""RULER-style long-context tasks (NVIDIA RULER, Hsieh et al. 2024) sized for SmolLM2-135M.

A sample is split where a query-agnostic press (kvpress's protocol) must see it:

    context   chat prefix + instruction + haystack with the needles   prefilled, then pressed
    question  the question + end of the user turn + answer prefix     fed after the press
    answers   strings the greedy answer must contain                   RULER's string match

Tasks follow RULER's templates (passkey from Mohtashami & Jaggi 2023, ``niah_single``,
``niah_multikey``, ``vt``, ``cwe``) with the haystack and the common-word vocabulary taken
from the Debian license texts, and fewer items than RULER asks of 7B+ models: 2 variable
hops instead of 4, 3 common words instead of 10, and vt's answer prefix ends in "VAR" (without
it SmolLM2 writes license text or the value instead of names: 0/3 at 1k; with it 0.42 at 2
hops, mostly the first variable). A sample is a pure function of
(task, target tokens, index, seed); its token count (context + question, each tokenized
on its own as the harness feeds them) is within 1 % of the target.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

SENTINEL = "\x00USER\x00"
BOUNDARY = re.compile(r"[.;:]\s|\n")  # a needle goes after a sentence or a line
DEPTHS = [i / 10 for i in range(11)]  # RULER draws needle depths from an even grid
KEY_WORDS = (  # noqa: SIM905  (a word list reads better as text)
    "amber anchor apple arrow aspen autumn badge bamboo barley beacon birch bison "
    "blossom breeze bronze cactus canyon carbon cedar cherry cinder citrus clover cobalt "
    "comet copper coral cotton crystal dagger daisy delta desert dolphin dragon eagle "
    "ember falcon fern fossil garnet ginger glacier granite harbor hazel helmet heron "
    "indigo island ivory jasmine jungle kettle lagoon lantern lemon lilac linen lotus "
    "magnet maple marble meadow mercury meteor mint nectar nickel oasis olive onyx "
    "orchid otter panda pebble pepper pine planet plum quartz raven reef ribbon river "
    "saffron salmon sapphire scarlet shadow silver spruce summit thistle thunder tiger "
    "timber topaz tulip velvet violet walnut willow zebra"
).split()


class TextTokenizer(Protocol):
    """What the tasks need of a tokenizer (kvcache.text.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...


@dataclass(frozen=True)
class Sample:
    """One prompt: what is prefilled (and pressed), what is asked after, what must be said."""

    task: str
    target_tokens: int
    context: str
    question: str
    answers: tuple[str, ...]
    needles: tuple[str, ...]  # the inserted statements, in haystack order (empty for cwe)
    depths: tuple[float, ...]  # requested depth of each needle in the haystack, 0..1
    haystack: str  # the haystack with the needles, as it appears in the context
    max_new_tokens: int


@dataclass(frozen=True)
class Parts:
    """A task's user turn before sizing: instruction + body (grows with ``n``) + question."""

    instruction: str
    body: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    needles: tuple[str, ...] = ()
    depths: tuple[float, ...] = ()


class Corpus:
    """The license texts as tokens: haystack windows and the common-word vocabulary."""

    def __init__(self, tokenizer: TextTokenizer, text: str) -> None:
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(text, add_bos=False)
        words = {w.lower() for w in re.findall(r"\b[A-Za-z]{4,10}\b", text)}
        self.words = sorted(words)

    def haystack(self, rng: random.Random, tokens: int) -> str:
        """About ``tokens`` tokens of license text from a random offset, starting on a line."""
        if tokens + 64 > len(self.ids):
            raise ValueError(f"tokens={tokens}: the corpus holds only {len(self.ids)} tokens")
        start = rng.randrange(0, len(self.ids) - tokens - 64)
        text = self.tokenizer.decode(self.ids[start : start + tokens + 64])
        cut = text.find("\n") + 1  # drop the partial first line
        ids = self.tokenizer.encode(text[cut:], add_bos=False)[:tokens]
        return self.tokenizer.decode(ids).strip()

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_bos=False))


class PromptFormat:
    """Wraps a user turn in the model's chat template (or none), split at the haystack's end."""

    def __init__(self, render: Callable[[str], str] | None = None) -> None:
        """``render``: user content -> the whole prompt text up to the assistant's turn."""
        whole = render(SENTINEL) if render else SENTINEL
        self.prefix, _, self.suffix = whole.partition(SENTINEL)
        assert SENTINEL not in self.suffix, f"the template repeats the user turn: {whole!r}"

    def split(self, parts: Parts) -> tuple[str, str]:
        """(context, question) texts of a sized user turn."""
        context = self.prefix + parts.instruction + parts.body
        question = parts.question + self.suffix + parts.answer_prefix
        return context, question


def insert_needles(haystack: str, needles: Sequence[str], depths: Sequence[float]) -> str:
    """``haystack`` with each needle after the sentence boundary nearest its depth."""
    bounds = [0, *(m.end() for m in BOUNDARY.finditer(haystack)), len(haystack)]
    spots = [min(bounds, key=lambda b, d=d: abs(b - d * len(haystack))) for d in depths]
    out, last = [], 0
    for spot, needle in sorted(zip(spots, needles, strict=True), key=lambda p: p[0]):
        out += [haystack[last:spot], needle, " " if spot < len(haystack) else ""]
        last = spot
    return "".join([*out, haystack[last:]])


# ---- the tasks: each returns Parts for a haystack of about n tokens -----------------------
def passkey(rng: random.Random, corpus: Corpus, n: int) -> Parts:
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    depth = rng.choice(DEPTHS)
    return Parts(
        "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the important information there.\n\n",
        insert_needles(corpus.haystack(rng, n), [needle], [depth]),
        "\n\nWhat is the pass key?",
        "The pass key is",
        (key,),
        (needle,),
        (depth,),
    )


def _keys(rng: random.Random, count: int) -> list[str]:
    words = rng.sample(KEY_WORDS, 2 * count)
    return [f"{words[2 * i]}-{words[2 * i + 1]}" for i in range(count)]


def _niah(rng: random.Random, corpus: Corpus, n: int, keys: int) -> Parts:
    names = _keys(rng, keys)
    values = [str(rng.randint(1000000, 9999999)) for _ in names]
    needles = [
        f"One of the special magic numbers for {k} is: {v}."
        for k, v in zip(names, values, strict=True)
    ]
    depths = rng.sample(DEPTHS, keys)
    asked = names[0]  # the others are distractors (RULER's multikey_1)
    return Parts(
        "Some special magic numbers are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the numbers afterwards.\n",
        insert_needles(corpus.haystack(rng, n), needles, depths),
        f"\nWhat is the special magic number for {asked} mentioned in the provided text?",
        f"The special magic number for {asked} mentioned in the provided text is",
        (values[0],),
        tuple(needles),
        tuple(depths),
    )


def niah_single(rng: random.Random, corpus: Corpus, n: int) -> Parts:
    return _niah(rng, corpus, n, 1)


def niah_multikey(rng: random.Random, corpus: Corpus, n: int) -> Parts:
    return _niah(rng, corpus, n, 4)


def variable_tracking(rng: random.Random, corpus: Corpus, n: int, hops: int = 2) -> Parts:
    value = str(rng.randint(10000, 99999))
    names = ["".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)) for _ in range(hops + 1)]
    needles = [f"VAR {names[0]} = {value}."]
    needles += [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]
    depths = sorted(rng.sample(DEPTHS[:-1], hops + 1))  # the chain in reading order
    return Parts(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
        insert_needles(corpus.haystack(rng, n), needles, depths),
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above.",
        "Answer: According to the chain(s) of variable assignment in the text above, "
        f"{hops + 1} variables are assigned the value {value}, they are: VAR",
        tuple(names),
        tuple(needles),
        tuple(depths),
    )


def common_words(
    rng: random.Random, corpus: Corpus, n: int, common: int = 3, freq: tuple[int, int] = (30, 3)
) -> Parts:
    """RULER's cwe: ``common`` words ``freq[0]`` times each, the rest ``freq[1]`` times, in a
    shuffled numbered list; ``n`` tokens buy about n / 3 entries."""
    entries = max(n // 3, common * freq[0] + freq[1])
    words = rng.sample(corpus.words, common + (entries - common * freq[0]) // freq[1])
    items = [w for w in words[:common] for _ in range(freq[0])]
    items += [w for w in words[common:] for _ in range(freq[1])]
    rng.shuffle(items)
    return Parts(
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n",
        " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)),
        f"\nQuestion: What are the {common} most common words in the above list?",
        f"Answer: The top {common} words that appear most often in the list are:",
        tuple(words[:common]),
    )


Builder = Callable[[random.Random, Corpus, int], Parts]
TASKS: dict[str, tuple[Builder, int]] = {  # name -> (builder, max new tokens)
    "passkey": (passkey, 10),
    "niah_single": (niah_single, 12),
    "niah_multikey": (niah_multikey, 12),
    "vt": (variable_tracking, 30),
    "cwe": (common_words, 24),
}


def make_sample(
    task: str, target: int, index: int, seed: int, corpus: Corpus, fmt: PromptFormat
) -> Sample:
    """Sample ``index`` of ``task`` at ``target`` tokens: the haystack is resized (same
    random draws) until context + question tokens are within 1 % of the target."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}: expected one of {sorted(TASKS)}")
    build, max_new = TASKS[task]
    n = target
    for _ in range(6):
        parts = build(random.Random(f"{seed}/{task}/{target}/{index}"), corpus, n)
        context, question = fmt.split(parts)
        got = corpus.count(context) + corpus.count(question)
        if abs(got - target) <= target // 100:
            return Sample(
                task, target, context, question, parts.answers, parts.needles, parts.depths,
                parts.body, max_new,
            )  # fmt: skip
        n = max(1, n + (target - got) * n // max(got, 1))
    raise AssertionError(f"{task} at {target} tokens: could not size the sample (last {got})")


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """RULER's score: the fraction of expected answers found (case-insensitive) in ``output``."""
    if not answers:
        raise ValueError("answers=(): a sample has at least one expected answer")
    text = output.lower()
    return sum(a.lower() in text for a in answers) / len(answers)

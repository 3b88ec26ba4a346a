"""Sessions (``kvcache generate --session``): a prompt's cells saved after a run and restored
into the next engine, which computes only what follows the longest common prefix; on the
tiny history-sensitive model, against the no-cache greedy reference (wrong K/V changes the
tokens). The CLI end to end: ``tests/models/test_generate_cli.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from greedy_reference import greedy, random_prompt
from kvcache.errors import SnapshotMismatchError
from kvcache.generate import Completion, GenerationConfig, Generator
from kvcache.models.llama import Llama

STEPS = 6


def complete(gen: Generator, prompt: list[int]) -> Completion:
    rid = gen.add(prompt, GenerationConfig(max_new_tokens=STEPS))
    for _ in gen.run():
        pass
    return gen.results[rid]


@pytest.mark.parametrize("codec", [None, "int8", "turbo4"])
def test_a_session_restores_the_prompt_and_computes_only_the_rest(
    history_model: Llama, tmp_path: Path, codec: str | None
):
    path = tmp_path / "s.kv"
    prompt = random_prompt(40, seed=3)
    first = Generator(history_model, capacity=64, codec=codec)
    assert complete(first, prompt).cached_tokens == 0
    assert first.save_session(path, prompt) == 40

    longer = prompt + random_prompt(7, seed=4)
    gen = Generator(history_model, capacity=64, codec=codec)
    assert gen.load_session(path, longer) == (40, 40)
    done = complete(gen, longer)
    assert done.cached_tokens == 40
    assert gen.stats.computed_tokens == 7 + STEPS - 1  # the rest of the prompt, then decode
    without = complete(Generator(history_model, capacity=64, codec=codec), longer)
    assert done.tokens == without.tokens  # what the same codec gives without a session
    if codec is None:
        assert done.tokens == greedy(history_model, longer, STEPS)


def test_only_the_common_prefix_is_restored(history_model: Llama, tmp_path: Path):
    """The file's tail is cut off before the restore: a pool too small for the whole file
    takes the shared part."""
    path = tmp_path / "s.kv"
    prompt = random_prompt(60, seed=3)
    first = Generator(history_model, capacity=80)
    complete(first, prompt)
    first.save_session(path, prompt)

    other = prompt[:25] + random_prompt(10, seed=5)
    gen = Generator(history_model, capacity=41)  # 41 cells: not enough for all 60
    assert gen.load_session(path, other) == (25, 60)
    assert gen.cache.used_cells() == 25
    done = complete(gen, other)
    assert done.cached_tokens == 25
    assert done.tokens == greedy(history_model, other, STEPS)
    assert gen.save_session(path, other) == 35  # the new prompt's cells, overwritten
    assert Generator(history_model, capacity=64).load_session(path, other) == (35, 35)


def test_a_session_of_another_codec_is_refused_and_changes_nothing(
    history_model: Llama, tmp_path: Path
):
    path = tmp_path / "s.kv"
    prompt = random_prompt(20, seed=3)
    first = Generator(history_model, capacity=64, codec="int8")
    complete(first, prompt)
    first.save_session(path, prompt)
    gen = Generator(history_model, capacity=64)
    with pytest.raises(SnapshotMismatchError, match="codecs"):
        gen.load_session(path, prompt)
    assert gen.cache.used_cells() == 0 and gen.cache.sequences() == []
    done = complete(gen, prompt)
    assert done.cached_tokens == 0 and done.tokens == greedy(history_model, prompt, STEPS)

"""`kvcache generate --model gemma3|FILE`: the architecture read from the GGUF, Gemma 3's
streamed greedy text equal to the library's tokens, the stats line, typed errors."""

from __future__ import annotations

import re
from pathlib import Path

import gguf as gguf_writer
import pytest

from kvcache.cli import main
from kvcache.generate import GenerationConfig, stream_tokens
from kvcache.models.gemma3 import Gemma3
from kvcache.text.tokenizer import Tokenizer

STATS = re.compile(
    r"^\[stats\] prompt tokens: (\d+) \| prefill: [\d.]+ tok/s \| decode: [\d.]+ tok/s \| "
    r"cache: [\d.]+ MiB \| peak RSS: \d+ MiB$"
)
PROMPT = "The three primary colors are"


def test_bundled_name_streams_greedy_text_and_stats(
    capsys: pytest.CaptureFixture[str], gemma3: Gemma3, gemma3_tokenizer: Tokenizer
):
    code = main(
        ["generate", "--model", "gemma3", "--weights", "fp32", "--temperature", "0"]
        + ["--max-new-tokens", "12", PROMPT]
    )
    out = capsys.readouterr().out.rstrip("\n").split("\n")
    assert code == 0
    assert "\n".join(out[:-1]) == _library_text(gemma3, gemma3_tokenizer)
    stats = STATS.match(out[-1])
    assert stats is not None, out[-1]
    assert int(stats.group(1)) == len(gemma3_tokenizer.encode(PROMPT))


def _library_text(model: Gemma3, tokenizer: Tokenizer) -> str:
    """PROMPT's 12 greedy tokens from the library on a cache of its own, as text."""
    ids = tokenizer.encode(PROMPT)
    cache = model.new_cache(len(ids) + 12)
    config = GenerationConfig(max_new_tokens=12)
    tokens = list(stream_tokens(model, cache, ids, config, stop_ids=tokenizer.stop_ids))
    cache.close()
    return tokenizer.decode(tokens)


def test_parallel_sequences_each_give_the_greedy_text(
    capsys: pytest.CaptureFixture[str], gemma3: Gemma3, gemma3_tokenizer: Tokenizer
):
    """-n 3 at temperature 0 runs three sequences of one prompt on the engine (the second and
    third resume the first's prefix from its checkpoint): each prints the library's greedy
    text."""
    code = main(
        ["generate", "--model", "gemma3", "--weights", "fp32", "--temperature", "0", "-n", "3"]
        + ["--max-new-tokens", "12", PROMPT]
    )
    out = capsys.readouterr().out.rstrip("\n").split("\n")
    assert code == 0
    heads = [i for i, line in enumerate(out) if line.startswith("--- sequence ")]
    assert len(heads) == 3, out
    texts = [
        "\n".join(out[a + 1 : b]) for a, b in zip(heads, [*heads[1:], len(out) - 1], strict=True)
    ]
    assert texts == [_library_text(gemma3, gemma3_tokenizer).strip("\n")] * 3
    assert out[-1].startswith("[stats] prompt tokens: ")


def test_a_file_of_another_architecture_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    path = tmp_path / "mamba.gguf"
    writer = gguf_writer.GGUFWriter(str(path), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["generate", "--model", str(path), "hi"]) == 2
    err = capsys.readouterr().err
    assert "general.architecture='mamba' is not supported" in err
    assert "['gemma3', 'llama']" in err


@pytest.mark.parametrize(
    ("option", "named"),
    [
        (["--window", "64"], "--window"),
        (["--press", "knorm:0.5"], "--press"),
    ],
)
def test_options_gemma3_cannot_serve_fail_before_its_weights(
    capsys: pytest.CaptureFixture[str], option: list[str], named: str
):
    assert main(["generate", "--model", "gemma3", *option, "hi"]) == 2
    err = capsys.readouterr().err
    assert named in err and "gemma3" in err, err


def test_an_unknown_model_name_lists_the_bundled_ones(capsys: pytest.CaptureFixture[str]):
    assert main(["generate", "--model", "gemma4", "hi"]) == 2
    assert "['gemma3', 'smollm2']" in capsys.readouterr().err

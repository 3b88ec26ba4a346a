"""`kvcache generate` end to end on the real SmolLM2 weights: streamed text, the stats line,
parallel sequences, reproducible seeds, context shifting, and a clean error exit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.cli import main

pytestmark = pytest.mark.slow

STATS = re.compile(
    r"^\[stats\] prompt tokens: (\d+) \| prefill: [\d.]+ tok/s \| decode: [\d.]+ tok/s \| "
    r"cache: [\d.]+ MiB \| held: [\d.]+ MiB \(([\d.]+)x fp16\) \| peak RSS: \d+ MiB$"
)


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = main(["generate", *args])
    return code, capsys.readouterr().out.rstrip("\n").split("\n")


def test_generate_streams_text_and_ends_with_stats(capsys: pytest.CaptureFixture[str]):
    code, lines = run_cli(
        capsys, "--seed", "1", "--max-new-tokens", "16", "The capital of France is"
    )
    assert code == 0
    match = STATS.match(lines[-1])
    assert match, lines[-1]
    assert int(match.group(1)) == 5
    assert "".join(lines[:-1]).strip()  # non-empty generated text


def test_same_seed_same_text_and_chat_parallel(capsys: pytest.CaptureFixture[str]):
    args = ("--seed", "7", "--max-new-tokens", "12", "--temperature", "1.0", "Once upon a time")
    _, first = run_cli(capsys, *args)
    _, second = run_cli(capsys, *args)
    assert first[:-1] == second[:-1]
    code, lines = run_cli(
        capsys, "--chat", "-n", "3", "--seed", "2", "--max-new-tokens", "8", "Name a colour."
    )
    assert code == 0
    assert sum(line.startswith("--- sequence ") for line in lines) == 3
    assert STATS.match(lines[-1])


def test_context_shift_and_window_runs(capsys: pytest.CaptureFixture[str]):
    code, lines = run_cli(
        capsys,
        "--capacity",
        "24",
        "--max-new-tokens",
        "40",
        "--temperature",
        "0",
        "Count: 1, 2, 3,",
    )
    assert code == 0 and STATS.match(lines[-1])
    code, lines = run_cli(capsys, "--window", "16", "--max-new-tokens", "30", "--seed", "3", "Hi")
    assert code == 0 and STATS.match(lines[-1])


def test_errors_exit_with_message(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    code = main(["generate", "--model", str(tmp_path / "missing.gguf"), "hello"])
    assert code == 2
    assert "missing.gguf" in capsys.readouterr().err
    code = main(["generate", "--temperature", "-1", "hello"])
    assert code == 2
    assert "temperature" in capsys.readouterr().err


def test_press_frees_cells_and_the_stats_line_shows_it(capsys: pytest.CaptureFixture[str]):
    prompt = "The cat sat on the mat. " * 40
    ratios = {}
    for press in (None, "snapkv:0.75"):
        args = ("--temperature", "0", "--max-new-tokens", "4", "--kv-codec", "int8", prompt)
        code, lines = run_cli(capsys, *args, *(("--press", press) if press else ()))
        assert code == 0
        match = STATS.match(lines[-1])
        assert match, lines[-1]
        ratios[press] = float(match.group(2))
    assert 1.6 < ratios[None] < 2.0  # int8 alone: 1.94x fp16, less the rows waiting in fp16
    assert ratios["snapkv:0.75"] > 3 * ratios[None]  # 3/4 of the prompt's cells freed
    assert main(["generate", "--press", "snapkv:1.5", "hi"]) == 2
    assert "snapkv:1.5" in capsys.readouterr().err


def test_press_cells_caps_a_long_generation(capsys: pytest.CaptureFixture[str]):
    """--press-cells 16 --press-every 4 with snapout:0 (decode only): the prompt's P + 47
    tokens fed, at most 19 cells held at the end: the held bytes at most 19 / (P + 47) of
    the plain run's."""
    ratios, prompt = {}, 0
    for cap in ((), ("--press", "snapout:0", "--press-cells", "16", "--press-every", "4")):
        args = ("--temperature", "0", "--max-new-tokens", "48", *cap, "Once upon a time")
        code, lines = run_cli(capsys, *args)
        assert code == 0
        match = STATS.match(lines[-1])
        assert match, lines[-1]
        ratios[bool(cap)], prompt = float(match.group(2)), int(match.group(1))
    assert ratios[True] >= 0.99 * ratios[False] * (prompt + 47) / 19  # (ratios are rounded)


def test_help_is_instant_and_readable():
    out = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "generate", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for flag in ("--chat", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--window"):
        assert flag in out
    assert "stats line" in out
    # the weight kinds and their default; --dtype is a hidden alias of --weights
    assert "--weights {native,fp32,bf16}" in out and "default native" in out
    assert "--dtype" not in out


def test_kv_codec_option(capsys: pytest.CaptureFixture[str]):
    args = (
        "--weights",
        "fp32",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        "The capital of France is",
    )
    code, plain = run_cli(capsys, *args)
    assert code == 0
    code, int8 = run_cli(capsys, "--kv-codec", "int8", *args)
    assert code == 0
    # 17 rows: int8 keeps them in fp16 until 32 of the sequence are sealed together
    assert int8[:-1] == plain[:-1]  # greedy text: fp16 rows change nothing here
    mib = re.compile(r"cache: ([\d.]+) MiB")
    fp32_mib = float(mib.search(plain[-1]).group(1))
    assert float(mib.search(int8[-1]).group(1)) <= fp32_mib / 2 + 0.1  # shown to 0.1 MiB
    code, sealed = run_cli(capsys, "--kv-codec", "int8:batch=1", *args)  # sealed at once
    assert code == 0
    assert float(mib.search(sealed[-1]).group(1)) < fp32_mib / 3  # 8.25 bits against 32
    code, mixed = run_cli(capsys, "--kv-codec", "int8/int4", *args)
    assert code == 0 and STATS.match(mixed[-1])
    assert main(["generate", "--kv-codec", "int3", "hi"]) == 2
    assert "kv" in capsys.readouterr().err


SESSION_PROMPT = (
    "The history of the cell cache begins with a simple idea: every token of every sequence "
    "keeps its keys and values in one shared pool, and attention reads them back by "
    "position. Over time the pool grew codecs, windows and prefix sharing. Tell me more about"
)


def test_session_restores_the_prompt_in_another_process(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    """--session: the first run saves the prompt's K/V; a second process restores them,
    computes only the last prompt token (its logits start the answer), says so in the stats
    line and prints what a run without a session prints (greedy). On fp32 weights: on native
    weights the last prompt token computed alone meets the int8 activation step where the
    whole prompt's forward used float32 tiles, so the text may part (docs/design/weights.md)."""
    session = tmp_path / "prompt.kv"
    args = ("--temperature", "0", "--max-new-tokens", "12", "--kv-codec", "int8")
    args += ("--weights", "fp32")
    code, plain = run_cli(capsys, *args, SESSION_PROMPT)
    assert code == 0
    prompt_tokens = int(STATS.match(plain[-1]).group(1))  # type: ignore[union-attr]
    assert prompt_tokens > 32  # int8 seals rows 32 at a time: codes are saved, not only fp16
    code, first = run_cli(capsys, "--session", str(session), *args, SESSION_PROMPT)
    assert code == 0 and first[-1].endswith(" | session: 0 tokens") and session.is_file()
    assert first[:-1] == plain[:-1]
    second = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "generate", "--session", str(session), *args,
         SESSION_PROMPT],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout.rstrip("\n").split("\n")  # fmt: skip
    assert second[-1].endswith(f" | session: {prompt_tokens - 1} tokens"), second[-1]
    restored = re.match(  # restored and computed tokens, not a prefill rate over one token
        rf"^\[stats\] prompt tokens: {prompt_tokens} \| prefill: {prompt_tokens - 1} tok "
        r"restored in [\d.]+ s, 1 computed \| decode: [\d.]+ tok/s \| ",
        second[-1],
    )
    assert restored, second[-1]
    assert second[:-1] == plain[:-1]
    # a prompt that shares only the start: that much is restored, the rest computed
    assert main(["generate", "--session", str(session), *args, SESSION_PROMPT[:60] + " cats"]) == 0
    out, err = capsys.readouterr()
    shared = int(out.rstrip("\n").rsplit("session: ", 1)[1].split()[0])
    assert 5 < shared < prompt_tokens - 10
    assert f"{shared} of its {prompt_tokens} tokens start the prompt" in err

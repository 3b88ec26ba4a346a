"""Gemma 3 served over HTTP on 127.0.0.1 (a second chat turn reuses >= 95 %
of its prompt past the window, read from the usage and /metrics) and `kvcache generate
--model gemma3 --session FILE` (a second run restores the prompt; the stats line says
restored and computed tokens and the restore time, not a rate over one token)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import kvcache.generate
from kvcache.cli import main
from kvcache.engine.params import EngineConfig
from kvcache.engine.scheduler import Engine
from kvcache.models.gemma3 import Gemma3
from kvcache.text.tokenizer import Tokenizer
from serving import serving

pytestmark = pytest.mark.slow

TIMEOUT = 120.0
SYSTEM = " ".join(
    f"Rule {i}: cells hold the keys and values of tokens, a window forgets the oldest, and "
    "a checkpoint keeps the local layers' last window so a later turn can resume."
    for i in range(24)
)  # past Gemma 3's 512-token window


@pytest.fixture(scope="module")
def server(gemma3: Gemma3, gemma3_tokenizer: Tokenizer) -> Iterator[str]:
    """The engine of ``kvcache serve`` (its sizes) behind uvicorn in a thread on 127.0.0.1."""
    config = EngineConfig(capacity=1024, max_sequences=2, max_batch=256)
    engine = Engine(gemma3, gemma3_tokenizer, config, model_id="gemma3-test")
    try:
        with serving(engine, gemma3_tokenizer, "gemma3") as s:
            yield s.url
    finally:
        engine.close()


def _chat(url: str, messages: list[dict[str, str]]) -> dict:
    body = {"model": "gemma3", "messages": messages, "max_tokens": 16, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    found = re.search(rf"^{name} ([\d.e+]+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_a_second_chat_turn_reuses_its_prompt_past_the_window(server: str):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What does a checkpoint keep?"},
    ]
    first = _chat(server, messages)
    assert first["usage"]["prompt_tokens"] > 600
    answer = first["choices"][0]["message"]["content"]
    assert answer
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the window?"},
    ]
    second = _chat(server, messages)
    prompt = second["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.95 * prompt, (cached, prompt)
    assert _metric(server, "kvcache_prefix_reused_tokens_total") == cached
    assert _metric(server, "kvcache_checkpoint_restores_total") >= 1


PROMPT = "The history of the cell cache begins with a simple idea. Tell me more about"
STATS = re.compile(
    r"^\[stats\] prompt tokens: (\d+) \| prefill: (\d+) tok restored in [\d.]+ s, (\d+) "
    r"computed \| decode: [\d.]+ tok/s \| .* \| session: (\d+) tokens$"
)


def test_generate_session_restores_and_says_restored_and_computed(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    gemma3: Gemma3,
    gemma3_tokenizer: Tokenizer,
):
    """Both runs in this process on the loaded weights (the CLI's loading is tested apart)."""

    def load(spec: object, *a: object, before_weights: Any = None, **kw: object) -> Any:
        if before_weights is not None:
            before_weights("gemma3")
        return gemma3, gemma3_tokenizer

    monkeypatch.setattr(kvcache.generate, "load_model", load)
    session = tmp_path / "gemma.kv"
    args = ["generate", "--model", "gemma3", "--session", str(session), "--temperature", "0"]
    args += ["--max-new-tokens", "4", PROMPT]
    assert main(args) == 0
    first = capsys.readouterr().out.rstrip("\n").split("\n")
    assert first[-1].endswith("| session: 0 tokens") and session.is_file()
    assert main(args) == 0
    *text, stats = capsys.readouterr().out.rstrip("\n").split("\n")
    found = STATS.match(stats)
    assert found, stats
    prompt, restored, computed, used = (int(g) for g in found.groups())
    assert restored == used == prompt - 1 and computed == 1
    assert text == first[:-1]  # the same greedy text

"""Two `kvcache serve` replicas + Redis behind a real sglang-router (``kvcache.deploy``), all on
127.0.0.1: the router registers them without falling back to deprecated probe names; with one
replica killed mid-trace every request completes or gets an error, none gets a wrong answer,
and the router routes the rest of the trace around the dead replica."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvcache.deploy import Deployment, free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2-routed"
QUESTIONS = [f"Name one use of the number {n} in one short sentence." for n in range(8)]
# the router notices a dead worker at once: one failed health check, one retry elsewhere
ROUTER_ARGS = [
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--retry-max-retries",
    "3",
    "--cb-failure-threshold",
    "1",
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(
        replicas=2,
        port=free_port(),
        policy="round_robin",
        threads=1,
        # fp32: the answers are compared as text, and through the shared prefix store a
        # replica continues a prompt chunked otherwise than a cold one (on native weights
        # the int8 step of the activations can turn that noise into other tokens)
        serve_args=[
            "--name",
            MODEL,
            "--capacity",
            "256",
            "--max-sequences",
            "2",
            "--weights",
            "fp32",
        ],
        router_args=ROUTER_ARGS,
        logs=tmp_path_factory.mktemp("deploy"),
    )
    # the replicas take the ports after the router's: find a free run of three
    d.port = next(p for p in iter(free_port, None) if _free(p + 1) and _free(p + 2))
    with d:
        yield d


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ask(url: str, question: str) -> str:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 6,
            "temperature": 0,
        },
        timeout=120,
    )
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def served_by(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r"^kvcache_prompt_tokens_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_router_registers_replicas_without_fallbacks(deployment: Deployment):
    log = Path(deployment.logs, "router.log").read_text(errors="replace")
    assert "Activated" in log or "healthy" in log
    assert "falling back" not in log and "Failed to load tokenizer" not in log
    models = httpx.get(f"{deployment.url}/v1/models", timeout=30).json()
    assert MODEL in str(models)


def test_a_replica_killed_mid_trace(deployment: Deployment):
    url = deployment.url
    truth = {q: ask(url, q) for q in QUESTIONS}  # both replicas up: round-robin over both
    assert all(served_by(u) > 0 for u in deployment.replica_urls)

    outcomes: dict[str, str | Exception] = {}

    def one(q: str) -> None:
        try:
            outcomes[q] = ask(url, q)
        except httpx.HTTPError as e:  # an error is allowed; a wrong answer is not
            outcomes[q] = e

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(one, q) for q in QUESTIONS]
        futures[1].result()  # mid-trace: the first answers are back, the rest in flight
        deployment.kill("replica0")
        for f in futures:
            f.result()
    assert set(outcomes) == set(QUESTIONS)
    for q, got in outcomes.items():
        assert isinstance(got, Exception) or got == truth[q], (q, got, truth[q])

    survivor = deployment.replica_urls[1]
    before = served_by(survivor)
    after = {q: ask(url, q) for q in QUESTIONS}  # routed around the dead replica
    assert after == truth
    assert served_by(survivor) > before

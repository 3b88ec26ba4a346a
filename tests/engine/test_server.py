"""The HTTP server with the real SmolLM2 (loaded once), uvicorn in a thread on 127.0.0.1.

The OpenAI client completes, chat-completes and streams (greedy text equals an uncached
greedy reference; a stream concatenates to the non-stream text); bad requests get 400 with
OpenAI's error body; a client that disconnects has its request cancelled and its cells
freed; /metrics parses as Prometheus text; engine failures answer 500, never hang.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from greedy_reference import random_prompt
from kvcache.cli import main as cli_main
from kvcache.commands.serve import model_identity
from kvcache.engine.metrics import EngineCollector, RateMeter
from kvcache.engine.params import EngineConfig, RequestParams
from kvcache.engine.scheduler import Engine
from kvcache.models.llama import Llama
from kvcache.text.tokenizer import Tokenizer
from kvcache.weights.gguf import GGUFFile, smollm2_path
from serving import TIMEOUT, Served, serving

pytestmark = pytest.mark.slow

MODEL = "smollm2-test"
CAPACITY = 256
SYSTEM = (
    "You are a terse assistant for a key-value cache library. Answer in one short sentence, "
    "name the component involved, and never apologise. Cells hold keys and values of tokens; "
    "a prefix index shares whole blocks of them between requests with the same prompt start."
)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Llama, Tokenizer]:
    with GGUFFile(smollm2_path()) as gguf:
        tokenizer = Tokenizer.from_gguf(gguf)
        gguf.release("tokenizer.")
        return Llama.from_gguf(gguf, weights="fp32"), tokenizer


def new_engine(model: Any, tokenizer: Tokenizer) -> Engine:
    config = EngineConfig(capacity=CAPACITY, max_sequences=4, max_batch=128, block_size=16)
    return Engine(model, tokenizer, config, model_id="smollm2-test")


@pytest.fixture(scope="module")
def served(smollm2: tuple[Llama, Tokenizer]) -> Iterator[Served]:
    engine = new_engine(*smollm2)
    try:
        with serving(engine, smollm2[1], MODEL) as s:
            yield s
    finally:
        engine.close()


def reference_greedy(model: Llama, tokenizer: Tokenizer, ids: list[int], n: int) -> str:
    """Greedy continuation by full forwards over the whole text, no cache at all."""
    out: list[int] = []
    for _ in range(n):
        token = int(torch.argmax(model.forward_full(ids + out)[-1]))
        if token in tokenizer.stop_ids:
            break
        out.append(token)
    return tokenizer.decode(out)


def chat_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def chat_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat(chat_messages(question)))


def sse_payloads(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a server-sent-event stream, checking the framing."""
    payloads = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            payloads.append(line.removeprefix("data: "))
    return payloads


# ---- completions ---------------------------------------------------------------------
def test_models_and_health(served: Served):
    assert [m.id for m in served.client().models.list()] == [MODEL]
    health = httpx.get(f"{served.url}/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_equals_uncached_greedy_reference(served, smollm2):
    model, tokenizer = smollm2
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    want = reference_greedy(model, tokenizer, ids, 8)
    client = served.client()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 8)
    assert r.usage.total_tokens == len(ids) + 8
    extra = r.model_extra["kvcache"]  # beside usage: never preempted, queued a while
    assert extra["preemptions"] == 0 and isinstance(extra["queued_s"], float)
    assert extra["queued_s"] >= 0
    assert set(r.model_extra) == {"kvcache"}
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == want


def test_chat_completion_equals_uncached_greedy_reference(served, smollm2):
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "What is a cell?")
    want = reference_greedy(model, tokenizer, ids, 10)
    r = served.client().chat.completions.create(
        model=MODEL, messages=chat_messages("What is a cell?"), max_tokens=10, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)
    finish = "length" if r.usage.completion_tokens == 10 else "stop"
    assert r.choices[0].finish_reason == finish


def _stream_text(stream: Any, chat: bool) -> tuple[str, str | None, Any]:
    """Concatenated text, last finish_reason and usage of an openai Stream."""
    parts, finish, counts = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            counts = chunk.usage
        for choice in chunk.choices:
            parts.append((choice.delta.content if chat else choice.text) or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, counts


@pytest.mark.parametrize(
    ("chat", "sampling"),
    [
        (False, {"temperature": 0}),
        (False, {"temperature": 0.9, "top_p": 0.9, "seed": 1234}),
        (True, {"temperature": 0.7, "seed": 99}),
    ],
    ids=["completion-greedy", "completion-seeded", "chat-seeded"],
)
def test_stream_concatenates_to_the_non_stream_text(served, chat, sampling):
    client = served.client()
    if chat:
        create: Callable[..., Any] = client.chat.completions.create
        args: dict[str, Any] = {"messages": chat_messages("Name two caches.")}
    else:
        create = client.completions.create
        args = {"prompt": "Three facts about memory:"}
    args |= {"model": MODEL, "max_tokens": 12, **sampling}
    whole = create(**args)
    text = whole.choices[0].message.content if chat else whole.choices[0].text
    streamed = create(**args, stream=True, stream_options={"include_usage": True})
    got, finish, counts = _stream_text(streamed, chat)
    assert got == text and len(text) > 0
    assert finish == whole.choices[0].finish_reason
    assert counts is not None and counts.completion_tokens == whole.usage.completion_tokens
    assert counts.prompt_tokens == whole.usage.prompt_tokens


def test_stream_wire_format_ends_with_done(served):
    body = {**M, "prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_strings_cut_the_text(served, smollm2):
    model, tokenizer = smollm2
    prompt = "A list of fruits: apple, banana,"
    full = reference_greedy(model, tokenizer, tokenizer.encode(prompt), 12)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick another prompt: {full!r}"
    want = full[: full.find(stop)]
    client = served.client()
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=["@@", stop], stream=True
    )
    assert _stream_text(stream, chat=False)[:2] == (want, "stop")


def test_concurrent_requests_each_get_their_own_text(served, smollm2):
    model, tokenizer = smollm2
    prompts = ["Water boils at", "The sun is a", "Cats like to", "One plus one is"]
    want = [reference_greedy(model, tokenizer, tokenizer.encode(p), 6) for p in prompts]
    client = served.client()

    def ask(prompt: str) -> str:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, prompts))
    assert got == want


# ---- errors --------------------------------------------------------------------------
TOO_LONG = "cache " * (2 * CAPACITY)
M = {"model": MODEL}
BAD_REQUESTS: list[tuple[str, str, object, str | None, str | None]] = [
    # (id, path, body (a str is sent as is), param, code)
    ("malformed-json", "completions", '{"model": "x", ', None, None),
    ("body-not-object", "completions", "[1, 2]", None, None),
    ("missing-model", "completions", {"prompt": "a"}, "model", None),
    ("unknown-model", "completions", {"model": "gpt-4", "prompt": "a"}, "model", "model_not_found"),
    (
        "max-tokens-string",
        "completions",
        {**M, "prompt": "a", "max_tokens": "5"},
        "max_tokens",
        None,
    ),
    ("max-tokens-zero", "completions", {**M, "prompt": "a", "max_tokens": 0}, "max_tokens", None),
    (
        "max-tokens-past-context",
        "completions",
        {**M, "prompt": "a", "max_tokens": CAPACITY},
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "prompt-past-context",
        "completions",
        {**M, "prompt": TOO_LONG, "max_tokens": 4},
        "prompt",
        "context_length_exceeded",
    ),
    ("prompt-wrong-type", "completions", {**M, "prompt": 42}, "prompt", None),
    ("token-id-out-of-vocab", "completions", {**M, "prompt": [1, 10**7]}, "prompt", None),
    ("empty-prompt", "completions", {**M, "prompt": ""}, "prompt", None),
    (
        "temperature-string",
        "completions",
        {**M, "prompt": "a", "temperature": "hot"},
        "temperature",
        None,
    ),
    (
        "temperature-high",
        "completions",
        {**M, "prompt": "a", "temperature": 3.0},
        "temperature",
        None,
    ),
    ("top-p-zero", "completions", {**M, "prompt": "a", "top_p": 0}, "top_p", None),
    ("seed-negative", "completions", {**M, "prompt": "a", "seed": -1}, "seed", None),
    ("stop-too-many", "completions", {**M, "prompt": "a", "stop": list("abcde")}, "stop", None),
    ("stop-wrong-type", "completions", {**M, "prompt": "a", "stop": 7}, "stop", None),
    ("stream-string", "completions", {**M, "prompt": "a", "stream": "yes"}, "stream", None),
    ("n-two", "completions", {**M, "prompt": "a", "n": 2}, "n", None),
    ("salt-number", "completions", {**M, "prompt": "a", "cache_salt": 7}, "cache_salt", None),
    ("salt-empty", "completions", {**M, "prompt": "a", "cache_salt": ""}, "cache_salt", None),
    (
        "salt-too-long",
        "chat/completions",
        {**M, "messages": [{"role": "user", "content": "a"}], "cache_salt": "s" * 257},
        "cache_salt",
        None,
    ),
    (
        "salt-list",
        "chat/completions",
        {**M, "messages": [{"role": "user", "content": "a"}], "cache_salt": ["a"]},
        "cache_salt",
        None,
    ),
    ("echo", "completions", {**M, "prompt": "a", "echo": True}, "echo", None),
    ("no-messages", "chat/completions", {**M, "messages": []}, "messages", None),
    (
        "unknown-role",
        "chat/completions",
        {**M, "messages": [{"role": "robot", "content": "hi"}]},
        "messages",
        None,
    ),
    (
        "chat-past-context",
        "chat/completions",
        {**M, "messages": [{"role": "user", "content": TOO_LONG}]},
        "messages",
        "context_length_exceeded",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [c[1:] for c in BAD_REQUESTS],
    ids=[c[0] for c in BAD_REQUESTS],
)
def test_bad_requests_get_400_with_an_openai_error_body(served, path, body, param, code):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{served.url}/v1/{path}",
        content=content.encode(),
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)


def test_openai_client_raises_bad_request(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model="no-such-model", prompt="a", max_tokens=2)
    assert unknown.value.status_code == 400 and unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": TOO_LONG}], max_tokens=2
        )
    assert too_long.value.code == "context_length_exceeded"


# ---- disconnects ---------------------------------------------------------------------
LONG = {"prompt": "Count: 1, 2, 3,", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def test_disconnect_mid_stream_cancels_and_frees_cells(served):
    before = served.cancelled()
    body = {"model": MODEL, "stream": True, **LONG}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        texts = 0
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                texts += 1
            if texts == 3:
                break  # leaving the block closes the connection mid-stream
    served.wait_idle()
    assert served.cancelled() == before + 1  # cancelled, not finished after 200 tokens
    engine = served.engine
    assert not engine.running and not engine.waiting
    assert engine.cache.used_cells() == engine.holder_cells()


def test_disconnect_while_waiting_for_a_whole_answer_cancels(served):
    before = served.cancelled()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{served.url}/v1/completions",
            json={"model": MODEL, **LONG},
            timeout=httpx.Timeout(TIMEOUT, read=1.0),
        )
    served.wait_idle()
    assert served.cancelled() == before + 1
    assert served.engine.cache.used_cells() == served.engine.holder_cells()


# ---- metrics -------------------------------------------------------------------------
def scrape(served: Served) -> dict[str, Any]:
    r = httpx.get(f"{served.url}/metrics", timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def scrape_settled(served: Served) -> dict[str, Any]:
    """A scrape once the engine is idle and its last step's snapshot is published."""
    served.wait_idle()
    deadline = time.monotonic() + 5  # the snapshot is published just after the last step
    while (fam := scrape(served)) and value(fam, "kvcache_generated_tokens") != (
        served.engine.stats.generated_tokens
    ):
        assert time.monotonic() < deadline, "the metrics snapshot lags the engine"
        time.sleep(0.05)
    return fam


def value(families: dict[str, Any], name: str) -> float:
    (sample,) = families[name].samples
    return float(sample.value)


def test_metrics_parse_as_prometheus_text(served):
    served.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    fam = scrape_settled(served)
    kinds = {
        "kvcache_cells_used": "gauge",
        "kvcache_cells_free": "gauge",
        "kvcache_prefix_hit_rate": "gauge",
        "kvcache_prefix_reused_tokens": "counter",
        "kvcache_prefix_store_tokens": "counter",
        "kvcache_requests_running": "gauge",
        "kvcache_requests_queued": "gauge",
        "kvcache_prompt_tokens_per_second": "gauge",
        "kvcache_generated_tokens_per_second": "gauge",
        "kvcache_preemptions": "counter",
        "kvcache_evictions": "counter",
        "kvcache_requests_finished": "counter",
    }
    assert {name: fam[name].type for name in kinds} == kinds
    assert value(fam, "kvcache_cells_used") + value(fam, "kvcache_cells_free") == value(
        fam, "kvcache_cells_total"
    )
    assert value(fam, "kvcache_cells_total") == served.engine.cache.num_cells
    assert value(fam, "kvcache_generated_tokens_per_second") > 0  # tokens came just now
    assert value(fam, "kvcache_engine_up") == 1
    reasons = {s.labels["reason"]: s.value for s in fam["kvcache_requests_finished"].samples}
    assert reasons.get("length", 0) >= 1


LOAD_GAUGES = (
    "kvcache_requests_queued",
    "kvcache_requests_running",
    "kvcache_kv_cache_usage_perc",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)


def load_gauges(families: dict[str, Any]) -> dict[str, float]:
    """The GIE load gauges (ours and vLLM's names), checked to be gauges."""
    assert all(families[name].type == "gauge" for name in LOAD_GAUGES)
    return {name: value(families, name) for name in LOAD_GAUGES}


def test_load_gauges_count_a_step_exactly(history_model):
    """Four requests over two slots, one step: 2 waiting, 2 running, their 2 x 20 cells of
    2 x 64 in use; at the end nothing waits or runs and utilisation is back to 0 although
    idle prefix holders keep cells (they are evicted on demand, as vLLM's free cached blocks)."""
    engine = Engine(history_model, config=EngineConfig(capacity=64, max_sequences=2))
    collector = EngineCollector(engine.metrics, RateMeter(), lambda: True, "tiny")

    def gauges() -> dict[str, float]:
        return load_gauges({m.name: m for m in collector.collect()})

    assert set(gauges().values()) == {0.0}
    for seed in range(4):
        engine.submit(random_prompt(20, seed=seed), RequestParams(max_tokens=6))
    engine.step()
    busy = gauges()
    assert busy["vllm:num_requests_waiting"] == busy["kvcache_requests_queued"] == 2
    assert busy["vllm:num_requests_running"] == busy["kvcache_requests_running"] == 2
    usage = {busy[n] for n in LOAD_GAUGES if "usage" in n}
    assert usage == {2 * 20 / (2 * 64)}
    engine.run()
    assert set(gauges().values()) == {0.0}
    assert engine.metrics()["cells_used"] > 0  # the idle holders' cells


def test_load_gauges_move_under_http_load_and_return_to_idle(served):
    """Eight concurrent requests over four slots: the scraped gauges show a queue and cells
    in use while they run, and zero once they are done."""
    client = served.client()
    seen: dict[str, float] = dict.fromkeys(LOAD_GAUGES, 0.0)
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(
                client.completions.create,
                model=MODEL,
                prompt=f"Count to ten in language {i}:",
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for i in range(8)
        ]
        while not all(f.done() for f in futures):
            now = load_gauges(scrape(served))
            seen = {n: max(seen[n], now[n]) for n in LOAD_GAUGES}
            time.sleep(0.02)
        assert all(f.result().usage.completion_tokens == 24 for f in futures)
    assert seen["vllm:num_requests_waiting"] >= 1 and seen["vllm:num_requests_running"] == 4
    assert 0 < seen["vllm:kv_cache_usage_perc"] <= 1
    assert set(load_gauges(scrape_settled(served)).values()) == {0.0}


def test_shared_system_prompt_is_reused_and_counted(served, smollm2):
    tokenizer = smollm2[1]
    first, second = chat_ids(tokenizer, "Define a block."), chat_ids(tokenizer, "Define a cell.")
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    client = served.client()
    client.chat.completions.create(
        model=MODEL, messages=chat_messages("Define a block."), max_tokens=2, temperature=0
    )
    before = scrape_settled(served)
    r = client.chat.completions.create(
        model=MODEL, messages=chat_messages("Define a cell."), max_tokens=2, temperature=0
    )
    fam = scrape_settled(served)
    reused = (common // 16) * 16  # whole blocks of the shared system prompt
    assert common >= 48 and r.usage.prompt_tokens_details.cached_tokens == reused
    assert (
        value(fam, "kvcache_prefix_reused_tokens") - value(before, "kvcache_prefix_reused_tokens")
        == reused
    )
    assert value(fam, "kvcache_prefix_hit_rate") > 0
    # the second prompt's reuse stopped at a block nobody holds, or at its partial last block
    whole = (len(second) - 1) // 16  # the last token is always computed
    reason = "no_holder" if whole > common // 16 else "partial_block"
    assert misses(fam)[reason] == misses(before)[reason] + 1
    assert sum(misses(fam).values()) == sum(misses(before).values()) + 1
    assert set(misses(fam)) == {
        "no_holder",
        "evicted",
        "partial_block",
        "model_mismatch",
        "codec_mismatch",
        "corrupt",
        "store_unavailable",
        "no_checkpoint",
        "checkpoint_behind",
    }


# ---- what routers probe ------------------------------------------------------------------
def test_router_probes_answer(served):
    """sglang-router / vllm-router read these at registration and for load; a 404 makes them
    fall back to deprecated names."""
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{served.url}{path}", timeout=TIMEOUT).json()
        assert info["served_model_name"] == MODEL and info["page_size"] == 16
        assert info["vllm_config"]["cache_config"]["block_size"] == 16
        assert info["max_running_requests"] == served.engine.config.max_sequences
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(f"{served.url}{path}", timeout=TIMEOUT).json()
        assert info["is_generation"] is True and info["max_context_length"] == CAPACITY
    served.wait_idle()
    [load] = httpx.get(f"{served.url}/get_load", timeout=TIMEOUT).json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert httpx.get(f"{served.url}/health_generate", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{served.url}/version", timeout=TIMEOUT).json()["version"]


@pytest.mark.parametrize("path", ["/reset_prefix_cache", "/flush_cache"])
def test_reset_prefix_cache_empties_the_pool_only_when_idle(served, path):
    client = served.client()
    client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=2, temperature=0)
    served.wait_idle()
    assert served.engine.reuse.blocks() > 0
    busy = served.loop.submit([1] * 8, RequestParams(max_tokens=200, ignore_eos=True))
    try:
        r = httpx.post(f"{served.url}{path}", timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["code"] == "cache_in_use"
        assert served.engine.reuse.blocks() > 0  # nothing changed
    finally:
        busy.cancel()
        served.loop.wake()
    served.wait_idle()
    r = httpx.post(f"{served.url}{path}", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["success"] is True
    assert served.engine.reuse.blocks() == 0 and served.engine.metrics()["cells_used"] == 0
    again = client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # computed anew


def test_cache_salt_separates_tenants_over_http(served):
    """Same system prompt, three tenants: the same salt reuses its blocks, another salt and
    no salt reuse none of them (the cached_tokens of OpenAI's usage)."""
    client = served.client()
    system = "Tenant isolation is checked by this test, before anything else. " + SYSTEM

    def cached(salt: str | None, question: str) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            max_tokens=2,
            temperature=0,
            extra_body=extra,
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a", "What is a cell?") == 0
    assert cached("tenant-a", "What is a block?") >= 48  # the system prompt's whole blocks
    assert cached("tenant-b", "What is a block?") == 0
    assert cached(None, "What is a block?") == 0


def misses(families: dict[str, Any]) -> dict[str, float]:
    """kvcache_prefix_miss_total by reason."""
    return {s.labels["reason"]: s.value for s in families["kvcache_prefix_miss"].samples}


# ---- engine failures -----------------------------------------------------------------
class FailingModel:
    """The real model whose forward raises while ``fail`` is set (an engine bug or OOM)."""

    def __init__(self, model: Llama) -> None:
        self._model = model
        self.fail = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("injected forward failure")
        return self._model.forward(*args, **kwargs)


def test_engine_failure_is_a_500_not_a_hang(smollm2):
    model, tokenizer = smollm2
    failing = FailingModel(model)
    engine = new_engine(failing, tokenizer)
    try:
        with serving(engine, tokenizer, MODEL) as s:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 500
            error = r.json()["error"]
            assert (
                error["type"] == "server_error" and "injected forward failure" in error["message"]
            )
            with pytest.raises(openai.APIError, match="injected forward failure"):
                _stream_text(
                    s.client().chat.completions.create(
                        model=MODEL, messages=chat_messages("Hi"), max_tokens=4, stream=True
                    ),
                    chat=True,
                )
            assert engine.cache.used_cells() == 0  # the failed requests' cells were freed
            assert s.state.prometheus.finishes() == {"error": 2}
            failing.fail = False  # the server keeps serving once the fault is gone
            ok = s.client().completions.create(
                model=MODEL, prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True}
            )
            assert ok.usage.completion_tokens == 2
    finally:
        engine.close()


def test_stopped_engine_answers_503_and_in_flight_requests_500(smollm2):
    model, tokenizer = smollm2
    engine = new_engine(model, tokenizer)
    try:
        with serving(engine, tokenizer, MODEL) as s:
            body = {"model": MODEL, "stream": True, **LONG}
            with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                s.loop.close()  # the engine thread stops under a running request
                payloads = [line.removeprefix("data: ") for line in lines if line]
            assert json.loads(payloads[-1])["error"]["type"] == "server_error"
            health = httpx.get(f"{s.url}/health", timeout=TIMEOUT)
            assert health.status_code == 503 and health.json()["error"]["message"]
            r2 = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "a"})
            assert r2.status_code == 503
    finally:
        engine.close()


# ---- pieces without a server ---------------------------------------------------------
def test_rate_meter_is_the_slope_over_its_window():
    clock = [0.0]
    meter = RateMeter(window_s=10.0, clock=lambda: clock[0])
    assert meter.rate("n") == 0.0  # fewer than two samples
    for t in range(31):  # 7 per second for 30 s, sampled every second
        clock[0] = float(t)
        meter.observe({"n": 7.0 * t})
    assert meter.rate("n") == pytest.approx(7.0)
    clock[0] = 31.0
    meter.observe({"n": 7.0 * 30})  # then nothing for a second
    assert meter.rate("n") == pytest.approx(7.0 * 9 / 10)  # 63 tokens over 21..31 s


def test_model_identity_names_file_content_and_dtype(tmp_path):
    a, b = tmp_path / "m.gguf", tmp_path / "n" / "m.gguf"
    b.parent.mkdir()
    a.write_bytes(b"GGUF" + bytes(4000))
    b.write_bytes(b"GGUF" + bytes(3999) + b"\x01")
    assert model_identity(a, "float32") == model_identity(a, "float32")
    assert model_identity(a, "float32") != model_identity(a, "bfloat16")
    assert model_identity(a, "float32") != model_identity(b, "float32")
    assert ":" not in model_identity(tmp_path / "m.gguf", "float32")  # store keys split on ':'


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefix-store", "bogus"], "prefix_store"),
        (["--prefix-store", "redis://127.0.0.1:1/0"], "--prefix-store"),
        (["--capacity", "1"], "capacity"),
        (["--max-sequences", "0"], "max_sequences"),
        (["--port", "70000"], "--port"),
        (["--model", "/nonexistent.gguf"], "--model"),
        (["--kv-codec", "int3"], "codec"),
        (["--kv-events", "http://127.0.0.1:5557"], "--kv-events"),
        (["--kv-events", "tcp://127.0.0.1:5557", "--no-prefix-cache"], "--kv-events"),
        (["--kv-events-replay", "tcp://127.0.0.1:5558"], "--kv-events-replay"),
    ],
)
def test_serve_rejects_bad_options_before_loading_weights(capsys, args, message):
    assert cli_main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache serve: error:") and message in err

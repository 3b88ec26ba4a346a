"""Load on `kvcache serve` over loopback: TTFT, inter-token latency, throughput.

Starts its own server processes (and, for the replica case, its own redis-server), all on
127.0.0.1 with ports chosen by the OS; sends a fixed number of streaming chat requests from
N concurrent asyncio clients (httpx); stops everything by itself. Three questions, each
measured side by side in one run:

1. Prefix reuse on vs off: requests share a ~1k-token system prompt and differ in the
   question. TTFT p50/p99, inter-token latency p50/p99, generated tokens/s.
2. A second replica through Redis vs cold prefill: replica A computes a ~1k-token prompt
   cold, replica B (fresh, same Redis) answers the same prompt loading A's blocks.
3. 1 vs 8 concurrent clients: aggregate generated tokens/s on short distinct prompts.
4. Oversubscription: 16 concurrent three-turn sessions (distinct ~1.5k-token
   system prompts; each turn sends the conversation so far: the earlier turns' questions and
   answers plus a new question) on servers whose pool holds 8 requests' context
   (``--max-sequences 16 --pool-sequences 8``, 2k each), so sessions outgrow the pool and
   a session's context is pushed out between its turns. Servers, one run each:
     spill            K/V that leaves the pool goes to host memory: preempted requests are
                      spilled and restored (``--spill memory``), evicted prefix holders are
                      demoted to the memory block store (the defaults)
     recompute        nothing outside the pool (``--spill off --prefix-store none``): prefixes
                      are reused while their cells are in the pool, anything evicted or
                      preempted is computed again (vLLM's recompute mode without offload)
     recompute+store  preempted requests recomputed, prefix blocks in the memory store
                      (``--spill off``): how much of spill's gain the block store alone gives
     unconstrained    a pool for all 16: the decode rate that requests never preempted (the
                      response's ``kvcache.preemptions`` is 0) are compared with
   Aggregate generated tokens/s; the resume latency of a session's later turns, p50 and p99:
   from the moment the server takes the turn up (its time to first token less the queue
   wait the response reports as ``kvcache.queued_s``) to its first token, while the
   conversation so far is restored, reloaded or computed again beside the other requests;
   the same with the queue wait (the turn's time to first token); the resume stall of
   preempted requests (the longest gap between two tokens, p99; admission control
   preempts rarely); the median decode rate of requests never preempted (tokens after the
   first / the time streaming them).

Every request is greedy with ``ignore_eos``, so a correct answer has exactly max_tokens
tokens, finish_reason "length", the prompt token count the tokenizer gives, a stream that
ends with ``[DONE]``, and the same text wherever the same prompt is asked (reuse on/off,
replica A/B, 1/8 clients). Any other answer counts as failed or wrong.

    .venv/bin/python benchmarks/serve_load.py            # the full run
    .venv/bin/python benchmarks/serve_load.py --quick    # fewer requests and tokens

Writes benchmarks/results/serve_load.json and, with matplotlib, serve_load.png.
Goals: TTFT p50 >= 10x lower with reuse; replica via Redis >= 5x lower TTFT than
cold prefill; 8 clients >= 4x the generated tokens/s of 1; zero failed or wrong responses.
Oversubscribed: spill >= 1.5x recompute's generated tokens/s and >= 5x lower resume latency
(p50), with zero failed or wrong responses (every run must give every turn the same text);
the decode rate of never-preempted requests within 5 % of the unconstrained run's.
``--questions`` runs a subset (e.g. ``--questions oversubscribed``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from harness import plot, table, write_json
from kvcache.text.tokenizer import Tokenizer

MODEL = "smollm2"
HOST = "127.0.0.1"  # the only address this script ever talks to
LISTENING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
START_TIMEOUT = 300.0
REQUEST_TIMEOUT = 600.0
_LOGS = itertools.count()
TOPICS = (
    "cells",
    "prefix blocks",
    "eviction",
    "preemption",
    "chained hashes",
    "the block store",
    "continuous batching",
    "sliding windows",
)


# ---- processes -----------------------------------------------------------------------
class Server:
    """A `kvcache serve` subprocess on 127.0.0.1 (port from the OS), log in a file."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        command = [sys.executable, "-m", "kvcache.cli", "serve", "--host", HOST, "--port", "0"]
        command += ["--name", MODEL, "--log-level", "info", *args]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        self.url = ""

    def wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while not self.url:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{self.log.read_text()[-3000:]}")
            found = LISTENING.search(self.log.read_text(errors="replace"))
            self.url = found.group(1) if found else ""
            time.sleep(0.1)
        return self.url

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics by name."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


@contextlib.contextmanager
def servers(folder: Path, *arg_lists: list[str]) -> Iterator[list[Server]]:
    """Start servers side by side (model loads overlap), wait for all, stop all at exit."""
    started: list[Server] = []
    try:
        for extra in arg_lists:
            started.append(Server(folder / f"server-{next(_LOGS)}.log", *extra))
        for s in started:
            s.wait_ready()
        yield started
    finally:
        for s in started:
            s.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """A throwaway redis-server on 127.0.0.1 (Debian package), no persistence."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    args = [exe, "--bind", HOST, "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*args, "--dir", str(folder)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((HOST, port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://{HOST}:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---- one request ---------------------------------------------------------------------
@dataclass
class Outcome:
    """What a client saw of one streamed request."""

    key: str  # which prompt (same key = must get the same greedy text)
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    preemptions: int = -1  # the response's kvcache.preemptions (-1: not reported)
    queued: float = float("nan")  # the response's kvcache.queued_s: waiting to start
    done: bool = False

    def decode_tok_s(self) -> float:
        """Tokens after the first per second of streaming them (nan without gaps)."""
        return len(self.gaps) / sum(self.gaps) if self.gaps else float("nan")


@dataclass(frozen=True)
class Ask:
    """One request to send: its messages, expected prompt length and identity."""

    key: str
    messages: list[dict[str, str]]
    prompt_tokens: int


async def stream_chat(http: httpx.AsyncClient, url: str, ask: Ask, max_tokens: int) -> Outcome:
    """Send one streaming chat request; time the first content and the gaps between."""
    out = Outcome(ask.key)
    body = {
        "model": MODEL,
        "messages": ask.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    t0 = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line:
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    out.done = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    return out
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    out.completion_tokens = chunk["usage"]["completion_tokens"]
                    extra = chunk.get("kvcache", {})
                    out.preemptions = extra.get("preemptions", -1)
                    out.queued = extra.get("queued_s", float("nan"))
                for choice in chunk["choices"]:
                    content = choice["delta"].get("content")
                    now = time.perf_counter()
                    if content:
                        if last is None:
                            out.ttft = now - t0
                        else:
                            out.gaps.append(now - last)
                        last = now
                        parts.append(content)
                    out.finish = choice["finish_reason"] or out.finish
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.text = "".join(parts)
    out.ok = True
    return out


async def load(
    url: str, asks: list[Ask], concurrency: int, max_tokens: int
) -> tuple[list[Outcome], float]:
    """``concurrency`` clients send ``asks`` in order, each waiting for its answer."""
    pending = list(reversed(asks))
    results: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as http:

        async def client() -> None:
            while pending:
                results.append(await stream_chat(http, url, pending.pop(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def run_load(
    url: str, asks: list[Ask], concurrency: int, max_tokens: int
) -> tuple[list[Outcome], float]:
    return asyncio.run(load(url, asks, concurrency, max_tokens))


# ---- workloads -----------------------------------------------------------------------
def system_prompt(tokenizer: Tokenizer, tokens: int, session: str) -> str:
    """Deterministic English of about ``tokens`` tokens; ``session`` leads (distinct prefixes)."""
    sentences = [f"Session {session}. You are the operations assistant of a cache library."]
    i = 0
    while len(tokenizer.encode(" ".join(sentences))) < tokens:
        topic = TOPICS[i % len(TOPICS)]
        sentences.append(
            f"Rule {i + 1}: when asked about {topic}, answer with the measured facts first, "
            f"name the component that owns {topic}, and keep the reply under {20 + i % 7} words."
        )
        i += 1
    return " ".join(sentences)


def ask(tokenizer: Tokenizer, key: str, system: str | None, question: str) -> Ask:
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": question})
    ids = tokenizer.encode(tokenizer.apply_chat(messages))
    return Ask(key, messages, len(ids))


def shared_prefix_asks(tokenizer: Tokenizer, count: int, prefix_tokens: int) -> list[Ask]:
    system = system_prompt(tokenizer, prefix_tokens, "shared")
    questions = [
        f"Question {i}: what should I know about {TOPICS[i % len(TOPICS)]}?" for i in range(count)
    ]
    return [ask(tokenizer, f"shared-{i}", system, q) for i, q in enumerate(questions)]


# ---- checks and summaries ------------------------------------------------------------
@dataclass
class Checker:
    """Counts failed and wrong answers; the first text seen for a key is the reference."""

    max_tokens: int
    reference: dict[str, str] = field(default_factory=dict)
    failed: int = 0
    wrong: int = 0
    problems: list[str] = field(default_factory=list)

    def check(self, asks: list[Ask], outcomes: list[Outcome]) -> None:
        expected = {a.key: a.prompt_tokens for a in asks}
        for o in outcomes:
            if not o.ok:
                self.failed += 1
                self.problems.append(f"{o.key}: failed: {o.error}")
                continue
            why = self._wrong(o, expected[o.key])
            if why:
                self.wrong += 1
                self.problems.append(f"{o.key}: wrong: {why}")

    def _wrong(self, o: Outcome, prompt_tokens: int) -> str:
        if not o.done:
            return "stream did not end with [DONE]"
        if (o.finish, o.completion_tokens) != ("length", self.max_tokens):
            return f"finish {o.finish} after {o.completion_tokens} tokens"
        if o.prompt_tokens != prompt_tokens:
            return f"{o.prompt_tokens} prompt tokens, expected {prompt_tokens}"
        want = self.reference.setdefault(o.key, o.text)
        return "" if o.text == want else f"text {o.text[:60]!r} != {want[:60]!r}"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(name: str, outcomes: list[Outcome], wall: float, concurrency: int) -> dict[str, Any]:
    good = [o for o in outcomes if o.ok]
    ttft = [o.ttft for o in good]
    gaps = [g for o in good for g in o.gaps]
    tokens = sum(o.completion_tokens for o in good)
    return {
        "run": name,
        "clients": concurrency,
        "requests": len(outcomes),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "gen_tok_s": tokens / wall,
        "req_s": len(good) / wall,
        "wall_s": wall,
    }


# ---- the three questions -------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Sizes of one benchmark run."""

    requests: int
    clients: int
    max_tokens: int
    prefix_tokens: int
    replica_prompts: int
    concurrency_requests: int
    concurrency_max_tokens: int
    server_args: tuple[str, ...]
    sessions: int = 16  # oversubscribed: concurrent multi-turn sessions
    pool_sequences: int = 8  # ... over a pool of this many requests' context
    session_tokens: int = 1500  # ... each with a distinct system prompt of about this size
    turns: int = 3


def reuse_on_off(
    plan: Plan, tokenizer: Tokenizer, checker: Checker, folder: Path
) -> list[dict[str, Any]]:
    """Shared ~1k-token system prompt, prefix reuse on vs off, one warm-up request each."""
    asks = shared_prefix_asks(tokenizer, plan.requests + 1, plan.prefix_tokens)
    warm, measured = asks[:1], asks[1:]
    rows = []
    on = [*plan.server_args]
    off = [*plan.server_args, "--no-prefix-cache"]
    with servers(folder, on, off) as (s_on, s_off):
        for name, server in (("reuse on", s_on), ("reuse off", s_off)):
            checker.check(warm, run_load(server.url, warm, 1, plan.max_tokens)[0])
            outcomes, wall = run_load(server.url, measured, plan.clients, plan.max_tokens)
            checker.check(measured, outcomes)
            row = summarize(name, outcomes, wall, plan.clients)
            row["reused_tokens"] = server.metrics().get("kvcache_prefix_reused_tokens_total", 0)
            rows.append(row)
    return rows


def replica_via_redis(
    plan: Plan, tokenizer: Tokenizer, checker: Checker, folder: Path
) -> list[dict[str, Any]]:
    """Replica A computes each ~1k-token prompt cold; fresh replica B loads A's blocks."""
    asks = [
        ask(
            tokenizer,
            f"replica-{i}",
            system_prompt(tokenizer, plan.prefix_tokens, f"r{i}"),
            "Summarize the rules.",
        )
        for i in range(plan.replica_prompts)
    ]
    rows = []
    with redis_server(folder) as url:
        args = [*plan.server_args, "--prefix-store", url]
        with servers(folder, args, args) as (a, b):
            for name, server in (("replica A (cold)", a), ("replica B (Redis)", b)):
                outcomes: list[Outcome] = []
                wall = 0.0
                for one in asks:  # one at a time: TTFT of a lone request
                    got, took = run_load(server.url, [one], 1, plan.max_tokens)
                    outcomes += got
                    wall += took
                checker.check(asks, outcomes)
                row = summarize(name, outcomes, wall, 1)
                row["store_tokens"] = server.metrics().get("kvcache_prefix_store_tokens_total", 0)
                rows.append(row)
    return rows


def one_vs_eight(
    plan: Plan, tokenizer: Tokenizer, checker: Checker, folder: Path
) -> list[dict[str, Any]]:
    """Aggregate generated tokens/s of 1 and 8 clients on short distinct prompts."""
    asks = [
        ask(
            tokenizer,
            f"short-{i}",
            None,
            f"Write a short story about {TOPICS[i % len(TOPICS)]} number {i}.",
        )
        for i in range(plan.concurrency_requests)
    ]
    rows = []
    with servers(folder, [*plan.server_args, "--max-sequences", "8"]) as (server,):
        run_load(server.url, asks[:1], 1, 4)  # warm-up (not checked: other length)
        for clients in (1, 8):
            outcomes, wall = run_load(server.url, asks, clients, plan.concurrency_max_tokens)
            checker.check(asks, outcomes)
            rows.append(summarize(f"{clients} client(s)", outcomes, wall, clients))
    return rows


async def session_turns(
    http: httpx.AsyncClient, url: str, tokenizer: Tokenizer, plan: Plan, i: int
) -> list[tuple[Ask, Outcome]]:
    """One multi-turn session: each turn sends the conversation so far plus a question."""
    system = system_prompt(tokenizer, plan.session_tokens, f"s{i}")
    messages = [{"role": "system", "content": system}]
    out = []
    for t in range(plan.turns):
        question = f"Turn {t}: what should I know about {TOPICS[(i + t) % len(TOPICS)]}?"
        messages = [*messages, {"role": "user", "content": question}]
        one = Ask(f"multi-{i}-{t}", messages, len(tokenizer.encode(tokenizer.apply_chat(messages))))
        got = await stream_chat(http, url, one, plan.max_tokens)
        out.append((one, got))
        if not got.ok:
            break
        messages = [*messages, {"role": "assistant", "content": got.text}]
    return out


async def all_sessions(
    url: str, tokenizer: Tokenizer, plan: Plan
) -> tuple[list[tuple[Ask, Outcome]], float]:
    limits = httpx.Limits(max_connections=plan.sessions + 1)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as http:
        t0 = time.perf_counter()
        runs = await asyncio.gather(
            *(session_turns(http, url, tokenizer, plan, i) for i in range(plan.sessions))
        )
        wall = time.perf_counter() - t0
    return [pair for run in runs for pair in run], wall


OVERSUBSCRIBED = (  # (run, pool for all sessions?, server options)
    ("spill", False, ("--spill", "memory", "--prefix-store", "memory")),
    ("recompute", False, ("--spill", "off", "--prefix-store", "none")),
    ("recompute+store", False, ("--spill", "off", "--prefix-store", "memory")),
    ("unconstrained", True, ("--spill", "memory", "--prefix-store", "memory")),
)


def oversubscribed(
    plan: Plan, tokenizer: Tokenizer, checker: Checker, folder: Path
) -> list[dict[str, Any]]:
    """Concurrent multi-turn sessions over a pool for fewer: K/V that leaves the pool kept
    in host memory (spill) or computed again (recompute), and a pool for all (unconstrained)
    for the decode rate of requests never preempted."""
    base = [*plan.server_args, "--max-sequences", str(plan.sessions), "--pool-sequences"]
    args = [
        [*base, str(plan.sessions if roomy else plan.pool_sequences), *options]
        for _, roomy, options in OVERSUBSCRIBED
    ]
    rows = []
    with servers(folder, *args) as all_servers:
        for (name, _, _), server in zip(OVERSUBSCRIBED, all_servers, strict=True):
            run_load(server.url, [ask(tokenizer, "warm", None, "Hi")], 1, 4)  # warm-up
            turns, wall = asyncio.run(all_sessions(server.url, tokenizer, plan))
            asks, outcomes = [a for a, _ in turns], [o for _, o in turns]
            checker.check(asks, outcomes)
            row = summarize(name, outcomes, wall, plan.sessions)
            resumed = [o for a, o in turns if o.ok and not a.key.endswith("-0")]
            row["resume_ttft_p50_s"] = percentile([o.ttft for o in resumed], 50)
            row["resume_ttft_p99_s"] = percentile([o.ttft for o in resumed], 99)
            started = [o.ttft - o.queued for o in resumed]  # from the server taking it up
            row["resume_p50_s"] = percentile(started, 50)
            row["resume_p99_s"] = percentile(started, 99)
            stalls = [max(o.gaps) for o in outcomes if o.ok and o.gaps and o.preemptions > 0]
            row["stall_p99_ms"] = 1000 * percentile(stalls, 99)
            kept = [o.decode_tok_s() for o in outcomes if o.ok and o.preemptions == 0 and o.gaps]
            row["never_preempted"] = len(kept)
            row["never_preempted_decode_tok_s_p50"] = percentile(kept, 50)
            m = server.metrics()
            for key in OVERSUBSCRIBED_COUNTERS:
                row[key] = m.get(f"kvcache_{key}_total", 0.0)
            rows.append(row)
            progress = ["run", "gen_tok_s", "resume_p50_s", "resume_ttft_p50_s", "wall_s"]
            print(table([row], progress), flush=True)
    return rows


OVERSUBSCRIBED_COUNTERS = (
    "preemptions",
    "spills",
    "restores",
    "computed_tokens",
    "prefix_store_tokens",
    "evictions",
    "prefix_reused_tokens",
)


QUESTIONS = {
    "reuse": reuse_on_off,
    "replica": replica_via_redis,
    "concurrency": one_vs_eight,
    "oversubscribed": oversubscribed,
}


# ---- report --------------------------------------------------------------------------
def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def goals(results: dict[str, list[dict[str, Any]]], checker: Checker) -> dict[str, Any]:
    """Each goal of the questions that ran, plus zero failed or wrong responses."""
    out: dict[str, Any] = {}
    if "reuse" in results:
        on, off = results["reuse"]
        v = ratio(off["ttft_p50_s"], on["ttft_p50_s"])
        out["ttft_p50_off_over_on"] = {"value": v, "goal": 10.0, "met": v >= 10}
    if "replica" in results:
        cold, warm = results["replica"]
        v = ratio(cold["ttft_p50_s"], warm["ttft_p50_s"])
        out["ttft_p50_cold_over_redis_replica"] = {"value": v, "goal": 5.0, "met": v >= 5}
    if "concurrency" in results:
        one, eight = results["concurrency"]
        v = ratio(eight["gen_tok_s"], one["gen_tok_s"])
        out["gen_tok_s_8_over_1"] = {"value": v, "goal": 4.0, "met": v >= 4}
    if "oversubscribed" in results:
        runs = {r["run"]: r for r in results["oversubscribed"]}
        spill, recompute = runs["spill"], runs["recompute"]
        v = ratio(spill["gen_tok_s"], recompute["gen_tok_s"])
        out["oversubscribed_gen_tok_s_spill_over_recompute"] = {
            "value": v,
            "goal": 1.5,
            "met": v >= 1.5,
        }
        v = ratio(recompute["resume_p50_s"], spill["resume_p50_s"])
        out["oversubscribed_resume_p50_recompute_over_spill"] = {
            "value": v,
            "goal": 5.0,
            "met": v >= 5,
        }
        v = ratio(recompute["resume_ttft_p50_s"], spill["resume_ttft_p50_s"])
        out["oversubscribed_resume_ttft_p50_recompute_over_spill"] = {  # queue wait too
            "value": v,
            "goal": 5.0,
            "met": v >= 5,
        }
        v = ratio(
            spill["never_preempted_decode_tok_s_p50"],
            runs["unconstrained"]["never_preempted_decode_tok_s_p50"],
        )
        out["oversubscribed_never_preempted_decode_over_unconstrained"] = {
            "value": v,
            "goal": 0.95,
            "met": v >= 0.95,
        }
    bad = checker.failed + checker.wrong
    out["failed_or_wrong"] = {"value": bad, "goal": 0, "met": bad == 0}
    return out


def panels_of(results: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, str]]:
    """(question, figure, title) of each plot panel whose question ran."""
    return [
        (q, key, title)
        for q, key, title in (
            ("reuse", "ttft_p50_s", "TTFT p50 (s), shared 1k prefix"),
            ("replica", "ttft_p50_s", "TTFT p50 (s), second replica"),
            ("concurrency", "gen_tok_s", "generated tokens/s"),
            ("oversubscribed", "gen_tok_s", "generated tokens/s, oversubscribed pool"),
            ("oversubscribed", "resume_p50_s", "resume latency p50 (s), oversubscribed"),
        )
        if q in results
    ]


def draw(fig: Any, axes: Any, results: dict[str, list[dict[str, Any]]]) -> None:
    """A bar chart per panel: each run's figure."""
    panels = panels_of(results)
    for ax, (q, key, title) in zip(axes if len(panels) > 1 else [axes], panels, strict=True):
        names = [r["run"] for r in results[q]]
        values = [r[key] for r in results[q]]
        ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom")
    fig.suptitle("kvcache serve on loopback (SmolLM2-135M, CPU)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens")
    parser.add_argument(
        "--requests", type=int, default=None, help="shared-prefix requests (24; quick 8)"
    )
    parser.add_argument(
        "--clients", type=int, default=4, help="clients for the shared-prefix load (4)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per answer (32; quick 16)"
    )
    parser.add_argument(
        "--prefix-tokens", type=int, default=1024, help="shared system prompt (1024)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads per server (2)")
    parser.add_argument(
        "--questions",
        nargs="+",
        choices=QUESTIONS,
        default=list(QUESTIONS),
        help="which questions to run (all)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument(
        "--out",
        default=None,
        metavar="NAME",
        help="results file stem (serve_load; serve_load_partial with --questions)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    plan = Plan(
        requests=args.requests or (8 if quick else 24),
        clients=args.clients,
        max_tokens=args.max_tokens or (16 if quick else 32),
        prefix_tokens=args.prefix_tokens,
        replica_prompts=3 if quick else 6,
        concurrency_requests=8 if quick else 16,
        concurrency_max_tokens=32 if quick else 64,
        server_args=("--capacity", "2048", "--threads", str(args.threads)),
        sessions=6 if quick else 16,
        pool_sequences=2 if quick else 8,
        session_tokens=700 if quick else 1500,
    )
    tokenizer = Tokenizer.from_gguf()
    checker = Checker(plan.max_tokens)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
        folder = Path(tmp)
        for question in args.questions:
            own = Checker(plan.concurrency_max_tokens) if question == "concurrency" else checker
            results[question] = QUESTIONS[question](plan, tokenizer, own, folder)
            if own is not checker:
                checker.failed += own.failed
                checker.wrong += own.wrong
                checker.problems += own.problems
    columns = [
        "run",
        "clients",
        "requests",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_ms",
        "itl_p99_ms",
        "gen_tok_s",
        "req_s",
    ]
    print(table([row for rows in results.values() for row in rows], columns))
    if "oversubscribed" in results:
        print()
        extra = ["run", "resume_p50_s", "resume_p99_s", "resume_ttft_p50_s", "resume_ttft_p99_s"]
        extra += ["stall_p99_ms"]
        extra += [*OVERSUBSCRIBED_COUNTERS, "never_preempted", "never_preempted_decode_tok_s_p50"]
        print(table(results["oversubscribed"], extra))
    result = goals(results, checker)
    print()
    for name, g in result.items():
        print(f"{name}: {g['value']:.3g} (goal {g['goal']}) {'met' if g['met'] else 'NOT met'}")
    for problem in checker.problems[:20]:
        print("problem:", problem)
    name = args.out or (
        "serve_load" if set(args.questions) == set(QUESTIONS) else "serve_load_partial"
    )
    write_json(
        name,
        {
            "plan": plan.__dict__,
            "quick": quick,
            **results,
            "goals": result,
            "failed": checker.failed,
            "wrong": checker.wrong,
            "problems": checker.problems,
        },
    )
    if not args.no_plot:
        n = len(panels_of(results))
        plot(name, lambda fig, axes: draw(fig, axes, results), figsize=(4.4 * n, 4), ncols=n)
    return 0 if checker.failed + checker.wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a cache-aware router buys over round-robin, with and without the shared block store.

Two `kvcache serve` replicas (1 thread each) behind sglang-router, all on 127.0.0.1
(``kvcache.deploy``), one fresh deployment per policy and pool:

    round_robin         requests alternate replicas; each reuses only its own pool
    cache_aware         sglang-router's cache_aware policy (a prefix tree of what it sent where)
    round_robin+redis   round-robin, the replicas share prefix blocks through Redis

The trace: 16 sessions x 4 turns over 4 shared system prompts of ~1k tokens, 4 clients at a
time; each turn sends the conversation so far (system prompt, earlier questions and
answers) plus a new question, streamed, greedy, ``ignore_eos``. It runs on two pools a replica:

    tight   cells for 3,072 tokens: less than the 4 prompts' working set, so where a request
            lands decides what stays cached (the regime a router is bought for)
    ample   cells for 8,192 tokens: every replica keeps all 4 prompts whatever the policy

Per policy and pool: token hit rate (prompt tokens served from a prefix cache or the store /
prompt tokens, OpenAI's ``cached_tokens``), TTFT p50 / p90 (to the first chunk with text),
and the answers, which must be the same under every policy and pool.

A timing probe (the prefix-cache side channel of CVE-2025-46570): a victim tenant sends
prompts; an attacker sends 64-token guesses at them, half the victim's true prefix, half
random, and classifies by its time to first token. Attacker ROC AUC (95 % bootstrap interval)
without salts and with per-tenant ``cache_salt``.

    .venv/bin/python benchmarks/routing.py            # the full run (~12 min here)
    .venv/bin/python benchmarks/routing.py --quick    # 4 sessions x 2 turns, short prompts

Writes benchmarks/results/routing.json and routing.png (TTFT per policy and pool; probe
TTFTs). Goals: cache_aware token hit rate >= 85 %; its TTFT p50 >= 2x lower than
round_robin's on the tight pool; attacker AUC >= 0.9 without salts and <= 0.6 with salts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harness import load, plot, table, write_json
from kvcache.deploy import Deployment, free_port

MODEL = "smollm2-routing"
WORDS = [
    "cache",
    "block",
    "token",
    "prefix",
    "replica",
    "router",
    "session",
    "tenant",
    "model",
    "layer",
    "value",
    "key",
    "memory",
    "pool",
    "request",
    "answer",
    "question",
    "system",
    "policy",
    "store",
    "redis",
    "latency",
    "window",
    "batch",
    "decode",
    "prefill",
    "hash",
    "chain",
    "event",
    "queue",
    "thread",
    "server",
    "client",
    "stream",
    "metric",
    "gauge",
    "salt",
]
POLICIES = {  # name -> (router policy, shared Redis store)
    "round_robin": ("round_robin", False),
    "cache_aware": ("cache_aware", False),
    "round_robin+redis": ("round_robin", True),
}
POOLS = {  # name -> a replica's pool (serve arguments)
    "tight": ["--capacity", "1536", "--pool-sequences", "2"],
    "ample": ["--capacity", "2048"],
}
# fp32 weights: the int8 activations of the stored weights follow prefill chunking, which
# follows where reuse stops, so native weights could part answers between policies.
WEIGHTS = ["--weights", "fp32"]


@dataclass(frozen=True)
class Trace:
    sessions: int
    turns: int
    system_words: int
    max_tokens: int
    clients: int


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(1000 + i)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return f"You are assistant number {i} of a routing benchmark. " + " ".join(sentences)


def question(session: int, turn: int) -> str:
    return f"Session {session}, question {turn}: what does a {WORDS[(session + turn) % len(WORDS)]} do?"


def stream_chat(url: str, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """One streamed request: seconds to the first chunk with text, the text, the usage."""
    start = time.perf_counter()
    ttft, parts, usage = None, [], {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    ttft = time.perf_counter() - start if ttft is None else ttft
                    parts.append(text)
    assert ttft is not None and usage, "a stream without text or usage"
    return ttft, "".join(parts), usage


def run_session(url: str, s: int, trace: Trace) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": system_prompt(s % 4, trace.system_words)}]
    turns = []
    for t in range(trace.turns):
        messages.append({"role": "user", "content": question(s, t)})
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": trace.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        ttft, text, usage = stream_chat(url, body)
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        turns.append(
            {
                "session": s,
                "turn": t,
                "ttft_s": ttft,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": cached,
                "completion_tokens": usage["completion_tokens"],
                "text": text,
            }
        )
        messages.append({"role": "assistant", "content": text})
    return turns


def deployment(policy: str, redis: bool, logs: Path, pool: list[str]) -> Deployment:
    port = free_port()
    store = [] if redis else ["--prefix-store", "none"]
    return Deployment(
        replicas=2,
        port=port,
        policy=policy,
        redis=redis,
        threads=1,
        serve_args=["--name", MODEL, "--max-sequences", "4", *pool, *WEIGHTS, *store],
        logs=logs,
    )


def percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def run_policy(name: str, pool: str, trace: Trace, logs: Path, probe: bool) -> dict[str, Any]:
    policy, redis = POLICIES[name]
    with deployment(policy, redis, logs / f"{pool}-{name}", POOLS[pool]) as d:
        start = time.perf_counter()
        with ThreadPoolExecutor(trace.clients) as clients:
            sessions = list(
                clients.map(lambda s: run_session(d.url, s, trace), range(trace.sessions))
            )
        seconds = time.perf_counter() - start
        probes = timing_probe(d.replica_urls[0], trials=128) if probe else None
    turns = [t for s in sessions for t in s]
    ttft = [t["ttft_s"] for t in turns]
    prompt, cached = sum(t["prompt_tokens"] for t in turns), sum(t["cached_tokens"] for t in turns)
    return {
        "pool": pool,
        "policy": name,
        "requests": len(turns),
        "token_hit_rate": cached / prompt,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "trace_seconds": seconds,
        "ttft_s": ttft,
        "answers": {f"{t['session']}/{t['turn']}": t["text"] for t in turns},
        "probe": probes,
        "load_end": load(),
    }


# ---- the timing probe ------------------------------------------------------------------
def completion_ttft(url: str, prompt: list[int], salt: str | None) -> float:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return time.perf_counter() - start  # one token: the whole request is its TTFT


def auc(positives: list[float], negatives: list[float]) -> float:
    """ROC AUC of "faster means the guess was right": P(a true guess is faster than a false
    one), ties half (Mann-Whitney)."""
    wins = sum((p < n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def auc_interval(
    positives: list[float], negatives: list[float], rounds: int = 2000
) -> tuple[float, float]:
    """95 % bootstrap interval of ``auc``: with a few dozen trials a class, one AUC is
    +-0.1 of noise, so a goal is read against the interval, not the point alone."""
    rng = random.Random(11)
    draws = sorted(
        auc(rng.choices(positives, k=len(positives)), rng.choices(negatives, k=len(negatives)))
        for _ in range(rounds)
    )
    return draws[int(0.025 * rounds)], draws[int(0.975 * rounds) - 1]


def timing_probe(url: str, trials: int) -> dict[str, Any]:
    """A victim's 96-token prompts; the attacker's 64-token guesses, half of them the victim's
    true first 64 tokens (in a shuffled order, so that no drift of the machine lines up with
    the classes); with and without per-tenant salts."""
    out: dict[str, Any] = {}
    for mode, (victim, attacker) in {
        "no_salt": (None, None),
        "salted": ("tenant-victim", "tenant-attacker"),
    }.items():
        rng = random.Random(7)
        classes = [i % 2 == 0 for i in range(trials)]
        rng.shuffle(classes)
        right, wrong = [], []
        for true_guess in classes:
            secret = [rng.randrange(1000, 40000) for _ in range(96)]
            completion_ttft(url, secret, victim)  # the victim's request: its blocks cached
            guess = secret[:64] if true_guess else [rng.randrange(1000, 40000) for _ in range(64)]
            (right if true_guess else wrong).append(completion_ttft(url, guess, attacker))
        out[mode] = {
            "auc": auc(right, wrong),
            "auc_95": auc_interval(right, wrong),
            "true_ttft_s": right,
            "false_ttft_s": wrong,
        }
    return out


def draw(results: list[dict[str, Any]], pools: list[str]) -> Any:
    def paint(fig: Any, axes: Any) -> None:
        *pool_axes, probe_ax = axes
        for ax, pool in zip(pool_axes, pools, strict=True):
            runs = [r for r in results if r["pool"] == pool]
            ax.boxplot([r["ttft_s"] for r in runs], showfliers=True)
            ax.set_xticks(range(1, len(runs) + 1), [r["policy"] for r in runs], fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel("TTFT (s)")
            ax.set_title(f"2 replicas behind sglang-router, {pool} pool", fontsize=10)
        probe = next((r["probe"] for r in results if r["probe"]), None)
        if probe:
            data, labels = [], []
            for mode, p in probe.items():
                data += [p["true_ttft_s"], p["false_ttft_s"]]
                labels += [f"{mode}\nright (AUC {p['auc']:.2f})", f"{mode}\nwrong"]
            probe_ax.boxplot(data)
            probe_ax.set_xticks(range(1, len(data) + 1), labels, fontsize=7)
            probe_ax.set_ylabel("attacker's TTFT (s)")
            probe_ax.set_title("timing probe: 64-token guesses", fontsize=10)

    return paint


def pool_goals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One pool's goals: cache_aware's hit rate and its TTFT p50 against round_robin's."""
    by = {r["policy"]: r for r in runs}
    goals: dict[str, Any] = {}
    if "cache_aware" in by:
        goals["cache_aware_hit_rate_ge_85pct"] = by["cache_aware"]["token_hit_rate"] >= 0.85
    if "cache_aware" in by and "round_robin" in by:
        ratio = by["round_robin"]["ttft_p50_s"] / by["cache_aware"]["ttft_p50_s"]
        goals["cache_aware_ttft_p50_vs_round_robin"] = ratio
        goals["cache_aware_ttft_p50_2x_lower"] = ratio >= 2
    return goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4 sessions x 2 turns, short")
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--pools", nargs="*", default=list(POOLS), choices=list(POOLS))
    parser.add_argument("--no-probe", action="store_true", help="skip the timing probe")
    parser.add_argument("--out", default="routing", help="result name (routing)")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/kvcache-routing-logs"))
    args = parser.parse_args(argv)
    trace = (
        Trace(sessions=4, turns=2, system_words=120, max_tokens=8, clients=2)
        if args.quick
        else Trace(sessions=16, turns=4, system_words=760, max_tokens=24, clients=4)
    )
    probe_run = (args.pools[-1], "cache_aware")  # once: the probe does not depend on the trace
    results = [
        run_policy(name, pool, trace, args.logs, not args.no_probe and (pool, name) == probe_run)
        for pool in args.pools
        for name in args.policies
    ]
    answers = [r["answers"] for r in results]
    goals: dict[str, Any] = {"same_answers_everywhere": all(a == answers[0] for a in answers)}
    for pool in args.pools:
        goals[pool] = pool_goals([r for r in results if r["pool"] == pool])
    probe = next((r["probe"] for r in results if r["probe"]), None)
    if probe:
        goals["probe_auc_no_salt_ge_0.9"] = probe["no_salt"]["auc"] >= 0.9
        goals["probe_auc_salted_le_0.6"] = probe["salted"]["auc"] <= 0.6
    keys = ("pool", "policy", "requests", "token_hit_rate", "ttft_p50_s", "ttft_p90_s")
    rows = [{k: r[k] for k in (*keys, "trace_seconds")} for r in results]
    print(table(rows, list(rows[0])))
    if probe:
        for mode, p in probe.items():
            low, high = p["auc_95"]
            print(f"attacker AUC {mode}: {p['auc']:.3f} (95 % {low:.3f}-{high:.3f})")
    print(goals)
    write_json(
        args.out,
        {
            "trace": trace.__dict__,
            "pools": {p: POOLS[p] for p in args.pools},
            "weights": WEIGHTS,
            "rows": rows,
            "goals": goals,
            "results": results,
        },
    )
    plot(args.out, draw(results, args.pools), ncols=len(args.pools) + 1, figsize=(16.0, 4.5))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

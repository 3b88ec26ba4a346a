"""Does prefix reuse survive Gemma 3's sliding window in a multi-turn serve trace?

The engine that ``kvcache serve --model gemma3`` runs (in process, no HTTP), one run with
prefix reuse (global layers shared, local layers restored from checkpoints) and one
without, side by side on the same trace: ``--sessions`` conversations share a ~1k-token
system prompt; each turn sends the conversation so far (earlier questions and answers) plus
a new ~60-token question, the answers (``--tokens``) making them grow past 2k tokens over
``--turns`` turns; the sessions' turns of one round are submitted together. Greedy with
``ignore_eos``: with ``--weights fp32`` both runs give every turn the same text; with the
weights as stored (the default, what ``serve`` loads) the decode-row kernels' int8 step
rounds a prompt computed in other chunks a little differently, so a long answer may part
from the other run's, and the run prints where.

Reports, on turns 2+: % of prompt tokens reused, TTFT (submit to first token) median with
and without reuse, and the checkpoint bytes held at the end (and at most).

    .venv/bin/python benchmarks/gemma_reuse.py                 # 8 sessions x 4 turns
    .venv/bin/python benchmarks/gemma_reuse.py --sessions 2    # a shorter trace
    .venv/bin/python benchmarks/gemma_reuse.py --weights fp32 --name gemma_reuse_fp32

Writes benchmarks/results/NAME.json (``--name``, default gemma_reuse). Goal: >= 95 % of prompt tokens reused on turns
2+ (the engine before checkpoints reused none once the window had moved).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from harness import table, write_json
from kvcache.engine.params import EngineConfig, RequestParams
from kvcache.engine.request import Event
from kvcache.engine.scheduler import Engine
from kvcache.generate import load_model
from kvcache.models.sampling import SamplingParams

SYSTEM = " ".join(
    f"Rule {i}: the cache keeps each token's keys and values in cells; a sliding window "
    "forgets the oldest cells, and a checkpoint keeps the local layers' last window."
    for i in range(40)
)


def question(session: int, turn: int) -> str:
    body = " ".join(
        f"Item {j} of note {session}.{turn}: the pool held {session * 7 + j} cells."
        for j in range(4)
    )
    return f"{body} Summarise note {session}.{turn} in one sentence."


def run_trace(engine: Engine, tokenizer: Any, sessions: int, turns: int, tokens: int) -> dict:
    """Every round: each session's next turn submitted together, run to the end."""
    chats = [[{"role": "system", "content": SYSTEM}] for _ in range(sessions)]
    params = RequestParams(
        max_tokens=tokens, sampling=SamplingParams(temperature=0.0), ignore_eos=True
    )
    rows, texts, peak = [], [], 0
    for turn in range(turns):
        firsts: dict[int, float] = {}
        started = time.perf_counter()
        reqs = []
        for s, chat in enumerate(chats):
            chat.append({"role": "user", "content": question(s, turn)})

            def listen(e: Event, s: int = s, firsts: dict[int, float] = firsts) -> None:
                firsts.setdefault(s, time.perf_counter())

            reqs.append(engine.submit(tokenizer.apply_chat(chat), params, listen))
        while engine.busy:
            engine.step()
            peak = max(peak, int(engine.metrics()["checkpoint_bytes"]))
        for s, (chat, r) in enumerate(zip(chats, reqs, strict=True)):
            text = "".join(r.text)
            chat.append({"role": "assistant", "content": text})
            texts.append(text)
            rows.append(
                {
                    "turn": turn + 1,
                    "session": s,
                    "prompt": r.prompt_len,
                    "reused": r.cached_tokens or 0,
                    "ttft_s": firsts[s] - started,
                }  # fmt: skip
            )
    return {"rows": rows, "texts": texts, "peak_checkpoint_bytes": peak,
            "metrics": engine.metrics()}  # fmt: skip


def first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=200, help="tokens generated a turn")
    parser.add_argument("--weights", default="native", help="native | fp32 | bf16 (native)")
    parser.add_argument("--name", default="gemma_reuse", help="result name (gemma_reuse)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model("gemma3", weights=args.weights)
    out: dict[str, dict] = {}
    for mode, reuse in (("reuse", True), ("no_reuse", False)):
        config = EngineConfig(
            capacity=4096, max_sequences=args.sessions, max_batch=256, prefix_cache=reuse
        )
        engine = Engine(model, tokenizer, config, model_id="gemma3-bench")
        out[mode] = run_trace(engine, tokenizer, args.sessions, args.turns, args.tokens)
        engine.close()
    same = out["reuse"]["texts"] == out["no_reuse"]["texts"]
    differ = [
        {"turn": r["turn"], "session": r["session"], "first_char": first_difference(a, b)}
        for r, a, b in zip(
            out["reuse"]["rows"], out["reuse"]["texts"], out["no_reuse"]["texts"], strict=True
        )
        if a != b
    ]
    summary = []
    for mode, res in out.items():
        later = [r for r in res["rows"] if r["turn"] > 1]
        summary.append(
            {
                "mode": mode,
                "reused_pct_turns_2plus": 100
                * sum(r["reused"] for r in later)
                / sum(r["prompt"] for r in later),
                "ttft_p50_s_turns_2plus": statistics.median(r["ttft_s"] for r in later),
                "max_prompt": max(r["prompt"] for r in res["rows"]),
                "checkpoint_mib_end": res["metrics"]["checkpoint_bytes"] / 2**20,
                "checkpoint_mib_peak": res["peak_checkpoint_bytes"] / 2**20,
            }
        )
    print(table(summary, list(summary[0])))
    print(f"same text with and without reuse: {same}")
    for d in differ:  # a session's later turns carry the differing answer in their prompt
        print(f"  turn {d['turn']} session {d['session']}: texts part at char {d['first_char']}")
    write_json(
        args.name,
        {
            "args": vars(args),
            "same_text": same,
            "differing_turns": differ,
            "summary": summary,
            "rows": {m: r["rows"] for m, r in out.items()},
        },  # fmt: skip
    )


if __name__ == "__main__":
    main()

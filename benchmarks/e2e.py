"""End to end on the same GGUF: kvcache against llama.cpp (llama-cpp-python), side by side.

Both run the very same file (the bundled SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M
Q4_K_M), the same token ids (consecutive windows of the Debian license texts, no BOS; the
multi-sequence prompts distinct windows), greedy, EOS ignored, ``--threads`` threads each.
Each contender runs in a worker process of its own (``harness.spawn_worker``); the two take
turns over ``--rounds`` rounds (``harness.take_turns``, the order rotating) and every ratio
ours / llama.cpp is the median of the per-round ratios. Questions (``--questions``):

- ``decode``: SmolLM2, one sequence at 19-, 1k- and 4k-token prompts: decode tok/s (the
  median step of ``--steps`` after ``--warm``) and prefill tok/s, per K/V type: ours fp16,
  int8, kivi4 (the engine that ``kvcache generate`` runs) against llama.cpp's f16 (its
  default, flash attention auto) and q8_0 / q4_0 K and V (flash attention on, as they need).
- ``multi``: 16 distinct prompts x 2k decoding together, aggregate tok/s: ours (the engine
  over one cell cache, codecs ``--multi-kv``) against llama.cpp's own parallel decoding
  (its low-level batch API: one ``llama_decode`` of 16 tokens with 16 sequence ids a step,
  ``n_seq_max=16``, a context of 16 x the sequence). Ours' codecs take turns step by step
  in one worker (decode.py's ``decode_in_turn``), so kivi4 / fp32 is a paired ratio too.
- ``rss``: peak RSS of ``kvcache generate`` as a user runs it (its stats line; greedy, the
  1k prompt as text, 32 new tokens, default K/V) against llama-cpp-python's ``Llama`` doing
  the same (``VmHWM`` of its process).
- ``gemma``: Gemma 3 decode and prefill at 19 / 1k / 4k, ours fp16 (``stream_tokens`` over
  the model's wrapper cache, as ``kvcache generate --model gemma3`` does) against llama.cpp
  f16.
- ``kl``: llama.cpp's next-token KL against the fp32-weights reference on kv_quality.py's
  protocol (the first ``--kl-windows`` windows of 2048 license tokens, the last 1024 of each
  scored after a 1024-token prefill): the reference is ours with fp32 weights and fp32 K/V
  (``kv_quality.window_logprobs``), KL(reference || llama.cpp) per scored token, llama.cpp
  with its default f16 K/V. Ours with native weights too where the loader has them. Writes
  ``e2e_kl.json`` besides.

Ours' weights: ``--weights auto`` (default) tries ``from_gguf(path, weights="native")`` and
falls back to fp32 where the loader has no ``weights`` keyword yet; the kind used is in every
row. llama.cpp is patched so that its model params set ``use_extra_bufts = False`` (its AMX
extra buffer type crashes on this CPU's first decode).

    python benchmarks/e2e.py --setup                # builds llama-cpp-python (~4-7 min), once
    python benchmarks/e2e.py                        # every question (~15 min, quiet machine)
    python benchmarks/e2e.py --questions decode kl  # a subset
    KVCACHE_RESULTS=/tmp/e2e python benchmarks/e2e.py --trial   # a short run of the script

Writes benchmarks/results/e2e.json and e2e.png (decode tok/s against context, a line for
each K/V type of each contender; SmolLM2 and Gemma 3 panels), e2e_kl.json for ``kl``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from common import license_tokens
from harness import (
    load,
    minutes,
    paired_ratio,
    plot,
    spawn_worker,
    started_load,
    table,
    take_turns,
    worker_result,
    write_json,
)
from hf_generate import peak_bytes

LLAMA_CPP = "llama-cpp-python==0.3.36"
QUESTIONS = ("decode", "multi", "rss", "gemma", "kl")
OURS_KV = ("fp16", "int8", "kivi4")
PEER_KV = ("f16", "q8_0", "q4_0")
# ours' K/V -> llama.cpp's nearest type (bits per value), for the x_peer column
COUNTERPART = {"fp32": "f16", "fp16": "f16", "bf16": "f16", "int8": "q8_0", "kivi4": "q4_0"}
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "lengths": [19, 1024, 4096],
        "multi": [16, 2048],
        "steps": 32,
        "warm": 3,
        "rounds": 2,
        "multi_steps": 12,
        "kl_windows": 4,
        "rss_tokens": 1024,
    },
    "trial": {
        "lengths": [19, 128],
        "multi": [4, 64],
        "steps": 4,
        "warm": 1,
        "rounds": 1,
        "multi_steps": 3,
        "kl_windows": 1,
        "rss_tokens": 64,
    },
}
RSS_NEW = 32  # new tokens of the RSS runs
GEMMA_KV = "fp16"
QUIET_LOAD = 0.5  # 1-minute load average above which the machine was not quiet
# the goals of issue 60, each a ratio ours / llama.cpp (rss: MiB ours - llama.cpp, at most)
GOALS = {
    "decode 19": 1.0,
    "decode 1k": 1.2,
    "decode 4k": 1.2,
    "compressed 4k": 1.5,
    "multi": 2.0,
    "cache decides": 1.8,
    "prefill 1k": 2.0,
    "rss": 300.0,
    "gemma": 1.0,
}


# ---- llama.cpp (llama-cpp-python's low-level API) ------------------------------------
def llama_cpp_lib() -> Any:
    """``llama_cpp.llama_cpp`` with its model params' ``use_extra_bufts`` off (the AMX extra
    buffer type segfaults on this CPU's first decode) and its log quiet."""
    try:
        import llama_cpp.llama_cpp as lib
    except ImportError as exc:
        raise SystemExit(f"llama.cpp peer missing: run `python {__file__} --setup`") from exc
    if not getattr(lib, "_e2e_patched", False):
        default = lib.llama_model_default_params

        def params() -> Any:
            p = default()
            p.use_extra_bufts = False
            return p

        lib.llama_model_default_params = params
        lib._e2e_quiet = lib.llama_log_callback(lambda level, text, data: None)  # kept alive
        lib.llama_log_set(lib._e2e_quiet, ctypes.c_void_p())
        lib.llama_backend_init()
        lib._e2e_patched = True
    return lib


class Peer:
    """One llama.cpp model and a context over it, fed token ids through ``llama_batch``."""

    def __init__(self, path: Path, threads: int) -> None:
        self.lib = lib = llama_cpp_lib()
        self.threads = threads
        self.model = lib.llama_model_load_from_file(
            str(path).encode(), lib.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.ctx: Any = None

    def open(self, n_ctx: int, kv: str = "f16", n_seq: int = 1) -> None:
        """A fresh context of ``n_ctx`` cells (``n_seq`` sequences share them, each its own
        stream) with K and V stored as ``kv``; flash attention on for quantized K/V."""
        lib = self.lib
        self.close()
        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 2048, 512, n_seq
        p.n_threads = p.n_threads_batch = self.threads
        p.type_k = p.type_v = getattr(lib, f"GGML_TYPE_{kv.upper()}")
        if kv != "f16":  # a quantized V cache needs flash attention
            p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lib.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context (n_ctx={n_ctx}, kv={kv})")
        self.batch = lib.llama_batch_init(2048, 0, n_seq)

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> Any:
        """One ``llama_decode`` of (token, position, sequence, wants logits) rows (at most
        2048); the logits of the rows that want them [n, V] (a view, valid until the next)."""
        import numpy as np

        b = self.batch
        for i, (token, pos, seq, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        code = self.lib.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} ({len(rows)} rows)")
        n = sum(r[3] for r in rows)
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(n, self.vocab))

    def prefill(self, prompts: list[list[int]]) -> tuple[float, list[int]]:
        """Every prompt (sequence i = prompt i) in forwards of up to 2048 rows, only each
        prompt's last row with logits; (seconds, each sequence's greedy first token)."""
        rows = [
            (t, pos, seq, pos == len(p) - 1)
            for seq, p in enumerate(prompts)
            for pos, t in enumerate(p)
        ]
        first: list[int] = []
        start = time.perf_counter()
        for i in range(0, len(rows), 2048):
            first += [int(x) for x in self.decode(rows[i : i + 2048]).argmax(axis=1)]
        return time.perf_counter() - start, first

    def generate(self, prompts: list[list[int]], steps: int) -> dict[str, Any]:
        """Prefill, then ``steps`` greedy decode steps of every sequence at once; the
        seconds of each step and the first sequence's tokens."""
        seconds, last = self.prefill(prompts)
        tokens, times = [last[0]], []
        for k in range(steps):
            rows = [
                (t, len(p) + k, s, True) for s, (t, p) in enumerate(zip(last, prompts, strict=True))
            ]
            start = time.perf_counter()
            last = [int(x) for x in self.decode(rows).argmax(axis=1)]
            times.append(time.perf_counter() - start)
            tokens.append(last[0])
        return {"prefill_s": seconds, "step_s": times, "tokens": tokens}


def peer_rows(args: argparse.Namespace, tokens: list[int], kvs: Iterable[str]) -> list[dict]:
    """llama.cpp, one sequence per prompt length and K/V type (a fresh context each)."""
    peer = Peer(model_path(args.model), args.threads)
    new = args.warm + args.steps
    peer.open(64, "f16")  # a warm-up: first-call costs stay out of the timing
    peer.generate([tokens[:16]], 8)
    rows = []
    for kv in kvs:
        for n in args.lengths:
            peer.open(n + new + 8, kv)
            out = peer.generate([tokens[:n]], new)
            rows.append(rate_row("llama.cpp", kv, 1, n, out["prefill_s"], out["step_s"], args))
            rows[-1]["tokens"] = out["tokens"]
    peer.close()
    return rows


def peer_multi(args: argparse.Namespace, tokens: list[int]) -> list[dict]:
    """llama.cpp's parallel decoding: B distinct prompts, one batch of B rows a step."""
    b, c = args.multi
    prompts = [tokens[i * c : (i + 1) * c] for i in range(b)]
    peer = Peer(model_path(args.model), args.threads)
    new = args.warm + args.multi_steps
    peer.open(b * (c + new + 8), "f16", n_seq=b)
    out = peer.generate(prompts, new)
    peer.close()
    return [rate_row("llama.cpp", "f16", b, c, out["prefill_s"], out["step_s"], args)]


def peer_rss(args: argparse.Namespace, text: str) -> dict[str, Any]:
    """llama-cpp-python's ``Llama`` completing the prompt text greedily, as a user calls it;
    the peak RSS of this process."""
    llama_cpp_lib()
    from llama_cpp import Llama as PeerLlama

    llm = PeerLlama(
        str(model_path(args.model)),
        n_ctx=args.rss_tokens * 2 + RSS_NEW + 64,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    llm(text, max_tokens=RSS_NEW, temperature=0.0)
    return {"rows": [{"system": "llama.cpp", "peak_rss_mib": peak_bytes() / 2**20}]}


# ---- ours -----------------------------------------------------------------------------
def model_path(name: str) -> Path:
    from kvcache.weights.bundled import resolve_model

    return resolve_model(name)


def load_ours(name: str, weights: str) -> tuple[Any, str]:
    """Our model of the bundled file ``name`` with ``weights`` ("auto": native where the
    loader takes ``weights=``, else fp32); (model, the kind loaded)."""
    if name == "gemma3":
        from kvcache.models.gemma3 import Gemma3 as Model
    else:
        from kvcache.models.llama import Llama as Model
    path = model_path(name)
    kind = "native" if weights == "auto" else weights
    try:
        return Model.from_gguf(path, weights=kind), kind
    except TypeError as exc:  # a loader without the weights keyword: fp32 weights only
        if "weights" not in str(exc) or weights not in ("auto", "fp32"):
            raise
        return Model.from_gguf(path, dtype=torch.float32), "fp32"


def ours_rows(args: argparse.Namespace, tokens: list[int], kvs: Iterable[str]) -> dict[str, Any]:
    """Ours on the engine, one sequence per prompt length and codec, all in turn."""
    from decode import decode_in_turn

    model, kind = load_ours(args.model, args.weights)
    runs = [(kv, [tokens[:n]]) for kv in kvs for n in args.lengths]
    rows = [engine_row(r, kind) for r in decode_in_turn(model, runs, args, "single")]
    return {"weights": kind, "rows": rows}


def ours_multi(args: argparse.Namespace, tokens: list[int]) -> dict[str, Any]:
    """Ours on the engine: B distinct prompts decoding together, each codec in turn."""
    from decode import decode_in_turn

    b, c = args.multi
    model, kind = load_ours(args.model, args.weights)
    prompts = [tokens[i * c : (i + 1) * c] for i in range(b)]
    steps = args.steps
    args.steps = args.multi_steps  # decode_in_turn reads the steps from args
    rows = decode_in_turn(model, [(kv, prompts) for kv in args.multi_kv], args, "multi")
    args.steps = steps
    return {"weights": kind, "rows": [engine_row(r, kind) for r in rows]}


def engine_row(r: dict[str, Any], kind: str) -> dict[str, Any]:
    return {
        "system": "ours",
        "kv": r["codec"],
        "batch": r["batch"],
        "context": r["context"],
        "weights": kind,
        "prefill_tok_s": r["prefill_tok_s"],
        "decode_tok_s": r["decode_tok_s"],
        "step_ms": r["step_ms"],
        "tokens": r["tokens"],
    }


def ours_stream(args: argparse.Namespace, tokens: list[int]) -> dict[str, Any]:
    """Gemma 3 as ``kvcache generate`` runs it: ``stream_tokens`` over the model's cache."""
    from kvcache.generate import DecodeStats, GenerationConfig, stream_tokens

    model, kind = load_ours(args.model, args.weights)
    new = args.warm + args.steps + 1
    rows = []
    for n in [16, *args.lengths]:  # the first: a warm-up
        cache = model.new_cache(n + new, codec=GEMMA_KV)
        stats, stamps = DecodeStats(), []
        config = GenerationConfig(max_new_tokens=new, ignore_eos=True)
        out = []
        for token in stream_tokens(model, cache, tokens[:n], config, stats=stats):
            stamps.append(time.perf_counter())
            out.append(token)
        cache.close()
        steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        row = rate_row("ours", GEMMA_KV, 1, n, stats.prefill_seconds, steps, args)
        rows.append({**row, "weights": kind, "tokens": out})
    return {"weights": kind, "rows": rows[1:]}


def ours_rss(args: argparse.Namespace, text: str) -> dict[str, Any]:
    """``kvcache generate`` run as a user runs it; the peak RSS its stats line reports."""
    exe = Path(sys.executable).with_name("kvcache")
    cmd = [str(exe), "generate", "--temperature", "0", "--threads", str(args.threads)]
    cmd += ["--max-new-tokens", str(RSS_NEW), "--model", args.model]
    helps = subprocess.run([str(exe), "generate", "--help"], capture_output=True, text=True)
    if "--weights" in helps.stdout and args.weights != "auto":
        cmd += ["--weights", args.weights]
    proc = subprocess.run([*cmd, text], capture_output=True, text=True, check=False)
    found = re.search(r"peak RSS: (\d+) MiB", proc.stdout)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"kvcache generate failed ({proc.returncode}): {proc.stderr[-2000:]}")
    stats = proc.stdout.strip().splitlines()[-1]
    return {"rows": [{"system": "ours", "peak_rss_mib": float(found.group(1)), "stats": stats}]}


# ---- the KL worker ----------------------------------------------------------------------
def kl_worker(args: argparse.Namespace, tokens: list[int]) -> dict[str, Any]:
    """KL(fp32 reference || llama.cpp) and (where it loads) || ours native, per window."""
    import numpy as np

    from kv_quality import SCORED, WINDOW, quality, window_logprobs

    reference, _ = load_ours(args.model, "fp32")
    native = None
    if args.weights in ("auto", "native"):
        model, kind = load_ours(args.model, "native" if args.weights == "auto" else args.weights)
        native = model if kind == "native" else None
    peer = Peer(model_path(args.model), args.threads)
    wins = [tokens[w * WINDOW : (w + 1) * WINDOW] for w in range(args.kl_windows)]
    per: dict[str, list[dict[str, float]]] = {"llama.cpp": [], "ours-native": []}
    with torch.inference_mode():
        for win in wins:
            base = window_logprobs(reference, "fp32", win)
            peer.open(WINDOW + 8, "f16")
            prefill = WINDOW - SCORED
            logits = [
                peer.decode(
                    [(t, i, 0, i == prefill - 1) for i, t in enumerate(win[:prefill])]
                ).copy()
            ]
            rest = [(win[i], i, 0, True) for i in range(prefill, WINDOW - 1)]
            logits.append(peer.decode(rest).copy())
            theirs = torch.log_softmax(torch.from_numpy(np.concatenate(logits)).double(), dim=-1)
            per["llama.cpp"].append(quality([theirs], [win], [base]))
            if native is not None:
                per["ours-native"].append(
                    quality([window_logprobs(native, "fp32", win)], [win], [base])
                )
            per.setdefault("reference", []).append(quality([base], [win], [base]))
            print(
                f"  kl window: llama.cpp {per['llama.cpp'][-1]['kl']:.4f}",
                file=sys.stderr,
                flush=True,
            )
    peer.close()
    return {"windows": len(wins), "scored_per_window": SCORED, "rows": kl_rows(per)}


def kl_rows(per: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """One row per system: the mean over windows of equal size of the per-token KL and
    top-1, perplexity from the mean log of the windows' perplexities."""
    import math

    rows = []
    for system, qs in per.items():
        if qs:
            rows.append(
                {
                    "system": system,
                    "kl": statistics.fmean(q["kl"] for q in qs),
                    "top1": statistics.fmean(q["top1"] for q in qs),
                    "ppl": math.exp(statistics.fmean(math.log(q["ppl"]) for q in qs)),
                    "window_kl": [q["kl"] for q in qs],
                }
            )
    return rows


# ---- rows and ratios (pure) -------------------------------------------------------------
def rate_row(
    system: str,
    kv: str,
    batch: int,
    context: int,
    prefill_s: float,
    step_s: list[float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """A measurement: prefill tok/s over all the prompts, aggregate decode tok/s from the
    median of the steps after the first ``--warm``."""
    timed = step_s[args.warm :] or step_s
    return {
        "system": system,
        "kv": kv,
        "batch": batch,
        "context": context,
        "prefill_tok_s": batch * context / prefill_s,
        "decode_tok_s": batch / statistics.median(timed),
        "step_ms": [round(t * 1e3, 3) for t in timed],
    }


Key = tuple[str, str, str, int, int]  # (model, system, kv, batch, context)


def key_of(row: dict[str, Any]) -> Key:
    return (row["model"], row["system"], row["kv"], row["batch"], row["context"])


def by_round(rounds: Iterable[list[dict[str, Any]]]) -> dict[Key, list[dict[str, Any]]]:
    """Rows of every round, grouped by what they measured (round order kept)."""
    out: dict[Key, list[dict[str, Any]]] = {}
    for rows in rounds:
        for r in rows:
            out.setdefault(key_of(r), []).append(r)
    return out


def paired(
    runs: dict[Key, list[dict[str, Any]]], a: Key, b: Key, field: str = "decode_tok_s"
) -> float | None:
    """a's ``field`` / b's: the median over rounds of the per-round ratios (None: either
    missing). Two contenders of one worker (the same round, ``step_ms`` of equal length)
    pair step by step."""
    ra, rb = runs.get(a), runs.get(b)
    if not ra or not rb or len(ra) != len(rb):
        return None
    if a[1] == b[1] == "ours" and field == "decode_tok_s" and len(ra) == 1:
        sa, sb = ra[0]["step_ms"], rb[0]["step_ms"]
        if len(sa) == len(sb):  # one worker, in turn: per-step pairs
            return paired_ratio([a[3] / t for t in sa], [b[3] / t for t in sb])
    return paired_ratio([r[field] for r in ra], [r[field] for r in rb])


def best_of(
    runs: dict[Key, list[dict[str, Any]]], keys: list[Key], field: str = "decode_tok_s"
) -> list[float] | None:
    """Per round, the best ``field`` among ``keys`` that were measured (None: none)."""
    present = [runs[k] for k in keys if k in runs]
    if not present or len({len(p) for p in present}) != 1:
        return None
    return [max(p[i][field] for p in present) for i in range(len(present[0]))]


def summary(runs: dict[Key, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A row per measurement: medians over rounds; ours' ratios against llama.cpp's f16 and
    against its counterpart type (``COUNTERPART``) at the same shape."""
    rows = []
    for key, rs in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][4], kv[0][3], kv[0][1])):
        model, system, kv, batch, context = key
        row: dict[str, Any] = {
            "model": model,
            "system": system,
            "kv": kv,
            "batch": batch,
            "context": context,
            "weights": rs[0].get("weights", "gguf"),
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
            "rounds": len(rs),
        }
        if system == "ours":
            f16 = (model, "llama.cpp", "f16", batch, context)
            row["x_f16"] = paired(runs, key, f16)
            row["prefill_x_f16"] = paired(runs, key, f16, "prefill_tok_s")
            twin = (model, "llama.cpp", COUNTERPART.get(kv, "f16"), batch, context)
            row["x_peer"] = paired(runs, key, twin)
            theirs = runs.get(f16)
            if theirs and rs[0].get("tokens") and theirs[0].get("tokens"):
                row["same_tokens"] = agreement_of(rs[0]["tokens"], theirs[0]["tokens"])
        rows.append(row)
    return rows


def agreement_of(a: list[int], b: list[int]) -> int:
    from common import agreement

    return agreement(a, b)


def goal(name: str, value: float | None, figure: str, weights: str = "") -> dict[str, Any]:
    """A goal row: its value against ``GOALS[name]`` (rss: at most, MiB; else at least)."""
    want = GOALS[name]
    if value is None:
        status = "not measured"
    elif name == "rss":
        status = "met" if value <= want else "missed"
    else:
        status = "met" if value >= want else "missed"
    bound = f"<= +{want:g} MiB" if name == "rss" else f">= {want:g}x"
    shown = "-" if value is None else round(value, 3)
    return {
        "goal": name,
        "figure": figure,
        "weights": weights,
        "value": shown,
        "want": bound,
        "status": status,
    }


def goals(
    runs: dict[Key, list[dict[str, Any]]], rss: list[dict[str, Any]], multi: tuple[int, int]
) -> list[dict[str, Any]]:
    """Every goal of issue 60 with its measured ratio (medians of per-round ratios)."""
    s, g = "smollm2", "gemma3"

    def w(key: Key) -> str:
        return str(runs[key][0].get("weights", "")) if key in runs else ""

    out = []
    for n, name in ((19, "decode 19"), (1024, "decode 1k"), (4096, "decode 4k")):
        a = (s, "ours", "fp16", 1, n)
        out.append(
            goal(
                name,
                paired(runs, a, (s, "llama.cpp", "f16", 1, n)),
                f"ours fp16 / llama.cpp f16, {n}-token prompt",
                w(a),
            )
        )
    ours_best = best_of(runs, [(s, "ours", kv, 1, 4096) for kv in ("int8", "kivi4")])
    peer_best = best_of(runs, [(s, "llama.cpp", kv, 1, 4096) for kv in ("q8_0", "q4_0")])
    value = (
        paired_ratio(ours_best, peer_best)
        if ours_best and peer_best and len(ours_best) == len(peer_best)
        else None
    )
    out.append(
        goal(
            "compressed 4k",
            value,
            "best of ours int8 / kivi4 / best of llama.cpp q8_0 / q4_0 (FA), 4k",
            w((s, "ours", "int8", 1, 4096)),
        )
    )
    b, c = multi
    peer = (s, "llama.cpp", "f16", b, c)
    for kv in ("fp16", "fp32", "int8", "kivi4"):
        a = (s, "ours", kv, b, c)
        if a in runs:
            out.append(
                goal(
                    "multi",
                    paired(runs, a, peer),
                    f"ours {kv} / llama.cpp f16, {b} x {c} aggregate",
                    w(a),
                )
            )
    a = (s, "ours", "kivi4", b, c)
    out.append(
        goal(
            "cache decides",
            paired(runs, a, (s, "ours", "fp32", b, c)),
            f"ours kivi4 / ours fp32, {b} x {c} aggregate",
            w(a),
        )
    )
    a = (s, "ours", "fp16", 1, 1024)
    value = paired(runs, a, (s, "llama.cpp", "f16", 1, 1024), "prefill_tok_s")
    out.append(goal("prefill 1k", value, "ours / llama.cpp prefill tok/s, 1k prompt", w(a)))
    by = {r["system"]: r["peak_rss_mib"] for r in rss}
    value = by["ours"] - by["llama.cpp"] if {"ours", "llama.cpp"} <= set(by) else None
    out.append(goal("rss", value, "peak RSS, kvcache generate - llama.cpp (MiB)"))
    for n in (19, 1024, 4096):
        a = (g, "ours", GEMMA_KV, 1, n)
        out.append(
            goal(
                "gemma",
                paired(runs, a, (g, "llama.cpp", "f16", 1, n)),
                f"Gemma 3 ours {GEMMA_KV} / llama.cpp f16, {n}-token prompt",
                w(a),
            )
        )
    return out


# ---- driver -----------------------------------------------------------------------------
def setup() -> int:
    """Build and install the peer (llama-cpp-python from source) into this Python."""
    cmd = [sys.executable, "-m", "pip", "install", LLAMA_CPP]
    print(" ".join(cmd), "(builds llama.cpp from source: minutes)", flush=True)
    return subprocess.run(cmd, check=False).returncode


def run_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    data = json.loads(Path(args.tokens).read_text())
    tokens, text = data["tokens"], data.get("text", "")
    workers: dict[str, Callable[[], Any]] = {
        "ours-decode": lambda: ours_rows(args, tokens, args.ours_kv),
        "peer-decode": lambda: {"rows": peer_rows(args, tokens, args.peer_kv)},
        "ours-multi": lambda: ours_multi(args, tokens),
        "peer-multi": lambda: {"rows": peer_multi(args, tokens)},
        "ours-gemma": lambda: ours_stream(args, tokens),
        "peer-gemma": lambda: {"rows": peer_rows(args, tokens, ["f16"])},
        "ours-rss": lambda: ours_rss(args, text),
        "peer-rss": lambda: peer_rss(args, text),
        "kl": lambda: kl_worker(args, tokens),
    }
    worker_result(workers[args.worker]())


def write_tokens(args: argparse.Namespace, folder: Path, model: str) -> Path:
    """The license texts' tokens under ``model``'s tokenizer (and, for the RSS runs, the
    first ``rss_tokens`` of them as text), once for every worker."""
    from kv_quality import WINDOW
    from kvcache.text.tokenizer import Tokenizer

    b, c = args.multi
    count = max(max(args.lengths), b * c, args.kl_windows * WINDOW, args.rss_tokens)
    tokenizer = Tokenizer.from_gguf(model_path(model))
    ids = license_tokens(tokenizer, count)
    path = folder / f"tokens_{model}.json"
    path.write_text(json.dumps({"tokens": ids, "text": tokenizer.decode(ids[: args.rss_tokens])}))
    return path


def worker_argv(args: argparse.Namespace, worker: str, model: str, tokens: Path) -> list[str]:
    argv = ["--worker", worker, "--model", model, "--tokens", str(tokens)]
    argv += ["--lengths", *map(str, args.lengths), "--multi", *map(str, args.multi)]
    argv += ["--ours-kv", *args.ours_kv, "--peer-kv", *args.peer_kv, "--multi-kv", *args.multi_kv]
    for key in (
        "weights",
        "steps",
        "warm",
        "multi_steps",
        "kl_windows",
        "rss_tokens",
        "threads",
        "max_batch",
    ):
        argv += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    return argv


def pair(
    args: argparse.Namespace, question: str, model: str, tokens: Path, rounds: int
) -> list[list[dict]]:
    """Ours' and llama.cpp's workers of one question taking turns; each round's rows."""

    def worker(name: str) -> Callable[[], dict[str, Any]]:
        def call() -> dict[str, Any]:
            print(f"{name} {model} (load {load():.1f}, {minutes():.1f} min)", flush=True)
            argv = worker_argv(args, name, model, tokens)
            return spawn_worker(__file__, argv, args.threads, name, echo=True)

        return call

    turns = take_turns({s: worker(f"{s}-{question}") for s in ("ours", "peer")}, rounds)
    out = []
    for ours, peer in zip(turns["ours"], turns["peer"], strict=True):
        rows = [
            {**r, "model": model, "system": r.get("system", "llama.cpp")}
            for r in ours["rows"] + peer["rows"]
        ]
        for r in rows:
            if r["system"] == "llama.cpp":
                r["weights"] = "gguf"
        out.append(rows)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--setup", action="store_true", help=f"pip install {LLAMA_CPP} (a source build) and stop"
    )
    p.add_argument("--trial", action="store_true", help="tiny sizes: a check that the script runs")
    p.add_argument("--questions", nargs="+", choices=QUESTIONS, default=list(QUESTIONS))
    p.add_argument(
        "--weights",
        default="auto",
        help="ours' weights: auto (native if the loader has it, else fp32), native, fp32, bf16",
    )
    p.add_argument(
        "--lengths", type=int, nargs="+", help="prompt tokens, one sequence (19 1024 4096)"
    )
    p.add_argument(
        "--multi", type=int, nargs=2, metavar=("B", "C"), help="distinct prompts x tokens (16 2048)"
    )
    p.add_argument(
        "--ours-kv",
        nargs="+",
        default=list(OURS_KV),
        help=f"ours' codecs, one sequence ({' '.join(OURS_KV)})",
    )
    p.add_argument(
        "--peer-kv", nargs="+", default=list(PEER_KV), choices=PEER_KV, help="llama.cpp's K/V types"
    )
    p.add_argument(
        "--multi-kv",
        nargs="+",
        default=["fp32", "kivi4"],
        help="ours' codecs at B x C (fp32 kivi4)",
    )
    p.add_argument("--steps", type=int, help="timed decode steps per measurement (32)")
    p.add_argument("--multi-steps", type=int, help="timed decode steps at B x C (12)")
    p.add_argument("--warm", type=int, help="decode steps dropped first (3)")
    p.add_argument(
        "--rounds", type=int, help="rounds of the decode and gemma questions (2; multi: 1)"
    )
    p.add_argument("--kl-windows", type=int, help="kv_quality windows for kl (4)")
    p.add_argument("--rss-tokens", type=int, help="prompt tokens of the RSS runs (1024)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=2048, help="ours: tokens per forward (2048)")
    p.add_argument("--name", default=None, help="result name (e2e; --trial: e2e_trial)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2", help=argparse.SUPPRESS)
    p.add_argument("--tokens", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in SIZES["trial" if args.trial else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("steps", "multi_steps", "rounds", "kl_windows", "rss_tokens", "threads"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if min(args.lengths) < 2 or min(args.multi) < 1:
        p.error(
            f"--lengths {args.lengths} / --multi {args.multi}: expected lengths >= 2, sizes >= 1"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        return setup()
    if args.worker:
        run_worker(args)
        return 0
    llama_cpp_lib()  # the peer is there before any worker starts
    name = args.name or ("e2e_trial" if args.trial else "e2e")
    rounds: list[list[dict[str, Any]]] = []
    rss: list[dict[str, Any]] = []
    kl: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as folder:
        smol = write_tokens(args, Path(folder), "smollm2")
        for q in args.questions:
            if q == "decode":
                rounds += pair(args, "decode", "smollm2", smol, args.rounds)
            elif q == "multi":
                rounds += pair(args, "multi", "smollm2", smol, 1)
            elif q == "gemma":
                gemma = write_tokens(args, Path(folder), "gemma3")
                rounds += pair(args, "gemma", "gemma3", gemma, args.rounds)
            elif q == "rss":
                for r in pair(args, "rss", "smollm2", smol, 1)[0]:
                    rss.append(r)
            elif q == "kl":
                kl = spawn_worker(
                    __file__,
                    worker_argv(args, "kl", "smollm2", smol),
                    args.threads,
                    "kl",
                    echo=True,
                )
    runs = by_round([r for r in rnd if "decode_tok_s" in r] for rnd in rounds)
    rows = summary(runs)
    checks = goals(runs, rss, tuple(args.multi))
    print(
        f"\nkvcache vs llama.cpp ({LLAMA_CPP}), same GGUF, {args.threads} threads, greedy; "
        f"{minutes():.1f} min, load average {started_load():.1f} -> {load():.1f} on {os.cpu_count()} cores"
    )
    if started_load() > QUIET_LOAD:
        print("WARNING: the machine was busy before the run (loaded figures: ratios only)")
    columns = [
        "model",
        "system",
        "kv",
        "batch",
        "context",
        "weights",
        "prefill_tok_s",
        "decode_tok_s",
    ]
    columns += ["x_f16", "x_peer", "prefill_x_f16", "same_tokens", "rounds"]
    if rows:
        print(
            f"\ndecode and prefill tok/s (x_f16: ours / llama.cpp f16, x_peer: / its nearest type)\n{table(rows, columns)}"
        )
    if rss:
        print(f"\npeak RSS\n{table(rss, ['system', 'peak_rss_mib', 'stats'])}")
    if kl is not None:
        print(
            f"\nnext-token KL vs the fp32-weights reference ({kl['windows']} windows)\n{table(kl['rows'], ['system', 'kl', 'top1', 'ppl'])}"
        )
        write_json(f"{name}_kl", {"peer": LLAMA_CPP, "protocol": PROTOCOL, **kl})
    print(
        f"\ngoals (issue 60)\n{table(checks, ['goal', 'figure', 'weights', 'value', 'want', 'status'])}\n"
    )
    settings = {
        k: getattr(args, k)
        for k in (
            "threads",
            "weights",
            "steps",
            "warm",
            "rounds",
            "multi_steps",
            "lengths",
            "multi",
            "trial",
        )
    }
    raw = [{k: v for k, v in r.items() if k != "tokens"} for rnd in rounds for r in rnd]
    write_json(
        name,
        {
            "peer": LLAMA_CPP,
            **settings,
            "rows": rows,
            "rss": rss,
            "kl": kl,
            "goals": checks,
            "runs": raw,
        },
    )
    if rows:
        plot(name, lambda fig, axes: draw(fig, axes, rows), figsize=(12, 4.5), ncols=2)
    return 0


PROTOCOL = (
    "kv_quality.py's windows: the license texts' first N x 2048 tokens (no BOS), per window a "
    "1024-token prefill then the last 1024 tokens scored; KL(reference || system) per scored "
    "token, the reference = kvcache's Llama with fp32 weights and fp32 K/V; llama.cpp with its "
    "default f16 K/V"
)


def draw(fig: Any, axes: Any, rows: list[dict[str, Any]]) -> None:
    """Decode tok/s against the prompt length, one sequence: a line per contender and K/V
    type (ours solid, llama.cpp dashed), a panel per model."""
    for ax, model in zip(axes, ("smollm2", "gemma3"), strict=True):
        mine = [r for r in rows if r["model"] == model and r["batch"] == 1]
        for system, kv in dict.fromkeys((r["system"], r["kv"]) for r in mine):
            pts = sorted(
                (r["context"], r["decode_tok_s"])
                for r in mine
                if (r["system"], r["kv"]) == (system, kv)
            )
            xs, ys = zip(*pts, strict=True)
            label = f"ours {kv}" if system == "ours" else f"llama.cpp {kv}"
            ax.plot(xs, ys, "-o" if system == "ours" else "--s", label=label)
        ax.set(xscale="log", xlabel="prompt tokens", ylabel="decode tok/s", title=model)
        ax.grid(alpha=0.3)
        if mine:
            ax.legend(fontsize=8)
    fig.suptitle("kvcache vs llama.cpp, same GGUF, one sequence (shared machine)", fontsize=10)


if __name__ == "__main__":
    sys.exit(main())

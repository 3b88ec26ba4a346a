"""SmolLM2-135M decode on the cell cache: many distinct sequences, long contexts, every codec.

One run measures side by side (bundled SmolLM2-135M, fp32 weights, greedy, EOS ignored,
``--threads`` torch threads) and reports each figure as a ratio next to its goal:

1. grid: B distinct prompts of C tokens decoding together (B = 1, 4, 16; C = 1k, 2k; prompt i
   is the i-th C-token window of the Debian license texts, never a copy), per codec
   (fp32 fp16 int8 int4 kivi4 turbo4): aggregate decode tok/s. Goals: 16x1k fp32 >= 4x 1x1k
   fp32; at 16x1k and 16x2k int8 >= 1.10x fp32, int4 and kivi4 >= 1.15x, turbo4 >= 0.9x.
2. long: one sequence at 7.5k tokens (SmolLM2's context is 8k), fp32 / int8 / kivi4.
   Goal: int8 and kivi4 >= 1.0x fp32.
3. floor: 1 / (short-context step + fp32 K/V bytes at 7.5k / read bandwidth); the step (a
   16-token prompt), the bandwidth (a torch sum over 400 MB) and the 7.5k rates all come from
   one worker. Goal: fp32 at 7.5k >= 85 % of it.
4. attention: ``CausalCache.attention`` alone, one decode row over an 8k history (SmolLM2's
   shapes and RoPE, random K/V), per codec: stored bytes (``memory_usage_bytes()`` per layer,
   fp16 windows included) read per second, as a fraction of the bandwidth measured in the
   same worker (``of_bandwidth``: the best of the sums over 400 MB around the codecs' calls).
   The calls go round SmolLM2's 30 layers, so each finds its K/V in memory and not in the CPU
   cache (one fp32 layer at 8k is 12.6 MB), as in a decode step. Goal: fp32 >= 70 % of "a
   plain sum over the same bytes" (the issue's words): after each timed step of the 30 calls,
   torch sums the very K/V rows they read (views of the storage) and ``of_same_bytes`` is the
   median over the steps of (rows the calls read per second) / (rows the sums read per
   second), each step paired with its own sums as the decode ratios are.
5. transformers ``generate`` with DynamicCache / StaticCache vs ours fp32, one sequence, the
   16-token and the first grid prompt (``same``: greedy tokens in common).

Rates come from the Generator's own counters: per step, the change of ``stats.decode_seconds``.
Only decode-only steps in which all B sequences decode count (one whose prompt ends early
decodes during the others' prefill chunks); the first ``--warm`` are dropped and the rate is
B / the median step (a median ignores a burst of load on a shared machine). Prefill tok/s is
the same run's ``stats.prefill_rate``. Every codec and batch is warmed up before it is timed.
Workers, one subprocess each: attention; long + floor; one per grid context; one per
transformers measurement. In the grid and long workers every contender (codec x batch) is
prefilled in a Generator of its own, then they decode in turn, one step each per round (the
order rotating), so a slow minute of a shared VM slows every contender of that round alike;
each ratio (``x fp32``, the goals) is the median of the per-round ratios, not a ratio of two
medians taken minutes apart (two runs of one build can differ by more than the codecs do).

    python benchmarks/decode.py            # the full grid: ~400k prompt tokens to prefill
    python benchmarks/decode.py --quick    # 1 and 16 x 1k, one sequence at 4k: ~120k
    python benchmarks/decode.py --codecs fp32 int8 --batches 1 16 --contexts 1024 --no-hf

Run it on a quiet machine: with other processes on the cores, every parallel region of two
threads waits for a descheduled thread, and steps slow down many times, unevenly per codec.
Writes benchmarks/results/decode.json (``--quick``: decode_quick.json) and the PNG beside it:
aggregate tok/s against batch size and against prompt length, a line per codec.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import agreement, hf_checkpoint, license_tokens, token_clock
from harness import (
    load,
    minutes,
    paired_ratio,
    plot,
    read_bandwidth,
    spawn_worker,
    started_load,
    table,
    take_turns,
    worker_result,
    write_json,
)
from kvcache.kernels.build import extension

CODECS = ("fp32", "fp16", "int8", "int4", "kivi4", "turbo4")
LONG_CODECS = ("fp32", "int8", "kivi4")
HF_SYSTEMS = ("hf-dynamic", "hf-static")
SHORT = 16  # prompt tokens of the short-context step
# goals: codec vs fp32 at the largest batch; codec vs fp32, one sequence at the
# long context; largest batch vs one sequence (fp32); shares of the floor and the bandwidth
CODEC_GOALS = {"int8": 1.10, "int4": 1.15, "kivi4": 1.15, "turbo4": 0.90}
LONG_GOALS = {"int8": 1.0, "kivi4": 1.0}
BATCH_GOAL, FLOOR_GOAL, ATTENTION_GOAL = 4.0, 0.85, 0.70
PRESETS: dict[str, dict[str, Any]] = {  # steps: timed decode steps, warm: dropped before
    "full": {
        "batches": [1, 4, 16],
        "contexts": [1024, 2048],
        "long": 7680,
        "history": 8192,
        "steps": 24,
        "warm": 3,
    },
    "quick": {
        "batches": [1, 16],
        "contexts": [1024],
        "long": 4096,
        "history": 4096,
        "steps": 8,
        "warm": 2,
    },
}
STYLES = ("-", "--", ":", "-.")  # plot lines of one codec
QUIET_LOAD = 0.5  # 1-minute load average above which the machine was not quiet


# ---- measurements (inside a worker) --------------------------------------------------
class Contender:
    """One codec and batch of prompts in a Generator of its own, stepped from outside."""

    def __init__(
        self, model: Any, prompts: list[list[int]], codec: str, args: argparse.Namespace
    ) -> None:
        from kvcache.generate import GenerationConfig, Generator

        self.codec, self.batch, self.context = codec, len(prompts), max(len(p) for p in prompts)
        warm_up(model, self.batch, codec, args.max_batch)
        b, n = self.batch, self.context
        mixed = -(-b * n // (args.max_batch - b)) + 1  # steps with prompt rows, at most
        new = args.warm + args.steps + mixed + 1
        self.gen = Generator(
            model, capacity=n + new, max_sequences=b, max_batch=args.max_batch, codec=codec
        )
        config = GenerationConfig(max_new_tokens=new, ignore_eos=True)
        self.first = self.gen.add_many(prompts, config)[0]
        self.steps: list[float] = []
        while not self.step():  # the prompts, then one decode step (untimed)
            assert self.gen.busy, f"{codec} {b}x{n}: done before a step that was all decode"
        self.steps.clear()

    def step(self) -> bool:
        """One Generator step; whether all B sequences decoded in it (its time is kept)."""
        s = self.gen.stats
        prefilled, decoded, seconds = s.prefill_tokens, s.decode_tokens, s.decode_seconds
        self.gen.step()
        full = s.prefill_tokens == prefilled and s.decode_tokens - decoded == self.batch
        if full:
            self.steps.append(s.decode_seconds - seconds)
        return full

    def decode(self) -> None:
        """One round's turn: a step in which all B sequences decode."""
        assert self.step(), f"{self.codec} {self.batch}x{self.context}: a step not all decode"

    def finish(self, args: argparse.Namespace) -> dict[str, Any]:
        """The row: rates from the timed steps (one sequence: decoded to the end, its tokens)."""
        while self.batch == 1 and self.gen.busy:
            self.gen.step()
        self.gen.close()
        timed = self.steps[args.warm :]
        s = self.gen.stats
        return {
            "codec": self.codec,
            "batch": self.batch,
            "context": self.context,
            "prefill_tok_s": s.prefill_rate,
            "decode_tok_s": self.batch / statistics.median(timed),
            "decode_tok_s_mean": self.batch * len(timed) / sum(timed),
            "step_ms": [round(t * 1e3, 3) for t in timed],
            "tokens": self.gen.results[self.first].tokens if self.first in self.gen.results else [],
        }


def decode_in_turn(
    model: Any, runs: list[tuple[str, list[list[int]]]], args: argparse.Namespace, group: str
) -> list[dict[str, Any]]:
    """Each (codec, prompts) prefilled in a Generator of its own, one after another; then
    ``--warm`` + ``--steps`` rounds in which every contender takes one decode step, the
    order rotating by one each round. A slow minute on a shared machine slows every
    contender of a round alike, so the median of per-round ratios (``paired``) compares
    them where separate runs, minutes apart, would not."""
    contenders = []
    for codec, prompts in runs:
        contenders.append(Contender(model, prompts, codec, args))
        c = contenders[-1]
        print(f"  prefilled {codec:7} {c.batch:2} x {c.context:5}", file=sys.stderr, flush=True)
    turns = {f"{i} {c.codec}": c.decode for i, c in enumerate(contenders)}
    take_turns(turns, args.warm + args.steps)  # each row drops its first --warm steps itself
    rows = []
    for c in contenders:
        rows.append({**c.finish(args), "group": group})
        progress(rows[-1])
    return rows


def warm_up(model: Any, batch: int, codec: str, max_batch: int) -> None:
    """A few short steps with this codec and batch: first-call costs stay out of the timing."""
    from kvcache.generate import GenerationConfig, Generator

    gen = Generator(model, capacity=40, max_sequences=batch, max_batch=max_batch, codec=codec)
    gen.add_many([[100 + i] * 32 for i in range(batch)], GenerationConfig(4, ignore_eos=True))
    for _ in gen.run():
        pass
    gen.close()


def attention_op(codec: str, args: argparse.Namespace) -> dict[str, float]:
    """``cache.attention`` for one decode row over a ``--history`` of random K/V, every
    layer in turn; the median call and the stored bytes per layer it reads. ``"turbo4@post"``:
    keys quantized after RoPE (``CausalCache(key_rope=...)``)."""
    from kvcache import Batch, CausalCache
    from kvcache.models.llama import LlamaConfig
    from kvcache.models.rope import Rope
    from kvcache.weights.gguf import GGUFFile, smollm2_path

    cfg = LlamaConfig.from_gguf(GGUFFile(smollm2_path()))
    n, layers, kv, d = args.history, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    rope = Rope(d, cfg.rope_theta)
    name, _, key_rope = codec.partition("@")
    cache = CausalCache(
        n + args.warm + args.steps, shift=rope, codec=name, key_rope=key_rope or None
    )
    g = torch.Generator().manual_seed(0)
    cache.start_forward(Batch.single(0, 0, n))
    for layer in range(layers):
        cache.put(layer, torch.randn(n, kv, d, generator=g), torch.randn(n, kv, d, generator=g))
    q = torch.randn(1, cfg.num_heads, d, generator=g)  # q: [1, Hq, D]
    k, v = torch.randn(2, 1, kv, d, generator=g)  # k, v: [1, Hkv, D]
    # fp32: the stored K/V rows themselves (views), summed after each step's calls
    same = [cache.read(layer, slice(0, n)) for layer in range(layers)] if name == "fp32" else []
    times, shares = [], []
    for i in range(args.warm + args.steps):
        cache.start_forward(Batch.single(0, n + i, 1))
        step = 0.0
        for layer in range(layers):
            start = time.perf_counter()
            cache.attention(layer, q, k, v)
            times.append(time.perf_counter() - start)
            step += times[-1]
        if same and i >= args.warm:
            start = time.perf_counter()
            for keys, values in same:
                keys.sum(), values.sum()
            summed = time.perf_counter() - start
            shares.append((n + i + 1) / step / (n / summed))  # rows read per second, op / sum
    stored = cache.memory_usage_bytes() / layers
    cache.close()
    seconds = statistics.median(times[args.warm * layers :])
    out = {"bytes_per_layer": stored, "call_us": seconds * 1e6, "gb_s": stored / seconds / 1e9}
    if shares:
        out["of_same_bytes"] = statistics.median(shares)
    return out


# ---- workers (a subprocess each) -----------------------------------------------------
def worker_grid(args: argparse.Namespace, tokens: list[int]) -> dict[str, Any]:
    """Every batch and codec at one context, in turn step by step: B windows of the texts
    decoding together."""
    model = load_model()
    c = args.context
    runs = [
        (codec, [tokens[i * c : (i + 1) * c] for i in range(b)])  # distinct windows
        for b in args.batches
        for codec in args.codecs
    ]
    return {"rows": decode_in_turn(model, runs, args, f"grid {c}")}


def worker_long(args: argparse.Namespace, tokens: list[int]) -> dict[str, Any]:
    """The short step (fp32) and one sequence at the long context per codec, in turn step
    by step, between two read bandwidth measurements (the best kept)."""
    model = load_model()
    bandwidth = [read_bandwidth()]
    runs = [("fp32", [tokens[:SHORT]]), *[(c, [tokens[: args.long]]) for c in args.long_codecs]]
    rows = decode_in_turn(model, runs, args, "long")
    bandwidth.append(read_bandwidth())
    c = model.config
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # fp32 K and V
    return {"rows": rows, "bandwidth": max(bandwidth), "fp32_kv_per_token": kv_per_token}


def worker_attention(args: argparse.Namespace) -> dict[str, Any]:
    """The attention op per codec, each after a bandwidth measurement (the best one kept)."""
    rows, bandwidth = [], []
    for codec in args.codecs:
        bandwidth.append(read_bandwidth())
        rows.append({"codec": codec, "history": args.history, **attention_op(codec, args)})
        print(f"  attention {codec:7} {rows[-1]['gb_s']:6.1f} GB/s", file=sys.stderr, flush=True)
    bandwidth.append(read_bandwidth())
    return {"rows": rows, "bandwidth": max(bandwidth)}


def worker_hf(args: argparse.Namespace, tokens: list[int]) -> dict[str, Any]:
    """transformers generate, greedy, DynamicCache or StaticCache (eager); median step."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.LlamaForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32)
    new = args.warm + args.steps + 1
    kwargs: dict[str, Any] = (
        {"cache_implementation": "static"} if args.worker == "hf-static" else {}
    )

    def once(ids: torch.Tensor, n_new: int) -> tuple[list[float], list[int]]:
        clock = token_clock()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
                **kwargs,
            )
        return clock.times, out[0, ids.shape[1] :].tolist()

    once(torch.tensor([tokens[:8]]), 4)  # warm-up
    start = time.perf_counter()
    times, out = once(torch.tensor([tokens[: args.context]]), new)
    steps = [b - a for a, b in zip(times[1:], times[2:], strict=False)][args.warm :]
    return {
        "prefill_tok_s": args.context / (times[1] - start),
        "tokens": out,
        "decode_tok_s": 1 / statistics.median(steps),
    }  # times[0]: the prompt


def load_model() -> Any:
    from kvcache.models.llama import Llama

    return Llama.from_gguf(dtype=torch.float32, weights="fp32")


def progress(row: dict[str, Any]) -> None:
    print(
        f"  {row['codec']:7} {row['batch']:2} x {row['context']:5}: prefill "
        f"{row['prefill_tok_s']:6.0f} tok/s, decode {row['decode_tok_s']:6.1f} tok/s "
        f"(load {load():.1f})",
        file=sys.stderr,
        flush=True,
    )


def run_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    tokens: list[int] = json.loads(Path(args.tokens).read_text()) if args.tokens else []
    workers = {
        "grid": lambda: worker_grid(args, tokens),
        "long": lambda: worker_long(args, tokens),
        "attention": lambda: worker_attention(args),
    }
    result = workers[args.worker]() if args.worker in workers else worker_hf(args, tokens)
    worker_result(result)


# ---- driver ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sizes = PRESETS["full"]
    parser.add_argument("--quick", action="store_true", help="a few minutes: see above")
    parser.add_argument(
        "--codecs",
        nargs="+",
        choices=CODECS,
        default=list(CODECS),
        metavar="CODEC",
        help=f"cache codecs, fp32 first ({' '.join(CODECS)})",
    )
    parser.add_argument("--batches", type=int, nargs="+", help=f"grid batches {sizes['batches']}")
    parser.add_argument(
        "--contexts", type=int, nargs="+", help=f"grid prompt tokens {sizes['contexts']}"
    )
    parser.add_argument("--long", type=int, help=f"one sequence's prompt ({sizes['long']})")
    parser.add_argument("--history", type=int, help=f"attention history ({sizes['history']})")
    parser.add_argument("--steps", type=int, help=f"timed decode steps ({sizes['steps']})")
    parser.add_argument("--warm", type=int, help=f"decode steps dropped first ({sizes['warm']})")
    parser.add_argument("--max-batch", type=int, default=2048, help="tokens per forward (2048)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument(
        "--hf-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "kvcache"
        / "smollm2-hf",
        help="transformers checkpoint converted from the GGUF (made once)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=SHORT, help=argparse.SUPPRESS)
    parser.add_argument("--long-codecs", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--tokens", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("batches", "contexts", "long", "history", "steps"):
        value = getattr(args, key)
        if min(value if isinstance(value, list) else [value]) < 1:
            parser.error(f"--{key} must be positive, got {value}")
    if args.warm < 0:
        parser.error(f"--warm must be >= 0, got {args.warm}")
    if args.max_batch <= max(args.batches):
        parser.error(f"--max-batch {args.max_batch} must exceed the largest batch")
    return args


def jobs(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(worker, context) in the order they run."""
    out = [("attention", 0), ("long", 0), *[("grid", c) for c in args.contexts]]
    if not args.no_hf:
        out += [(s, length) for length in (SHORT, args.contexts[0]) for s in HF_SYSTEMS]
    return out


def measure(worker: str, context: int, args: argparse.Namespace, tokens: Path) -> dict[str, Any]:
    """One worker subprocess (its progress lines go to our stderr); its result."""
    long_codecs = [c for c in LONG_CODECS if c in args.codecs]
    argv = ["--worker", worker, "--context", str(context), "--tokens", str(tokens)]
    argv += ["--codecs", *args.codecs, "--long-codecs", *long_codecs]
    argv += ["--batches", *map(str, args.batches), "--contexts", *map(str, args.contexts)]
    for key in ("long", "history", "steps", "warm", "max_batch", "threads", "hf_dir"):
        argv += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    print(f"{worker} {context or ''} (load {load():.1f})", flush=True)
    return spawn_worker(__file__, argv, args.threads, f"{worker} {context}", echo=True)


def write_tokens(args: argparse.Namespace, folder: Path) -> Path:
    """The license texts' tokens, tokenized once for every worker."""
    from kvcache.text.tokenizer import Tokenizer

    count = max(max(args.batches) * max(args.contexts), args.long, SHORT)
    path = folder / "tokens.json"
    path.write_text(json.dumps(license_tokens(Tokenizer.from_gguf(), count)))
    return path


# ---- report ----------------------------------------------------------------------------
Rates = dict[tuple[str, int, int], float]  # (codec, batch, context) -> decode tok/s
Runs = dict[tuple[str, int, int], dict[str, Any]]  # (codec, batch, context) -> its row


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired(runs: Runs, a: tuple[str, int, int], b: tuple[str, int, int]) -> float | None:
    """a's aggregate decode rate / b's: the median of the per-round ratios where the two took
    turns in one worker (``decode_in_turn``), else the ratio of their medians."""
    ra, rb = runs.get(a), runs.get(b)
    if ra is None or rb is None:
        return None
    if ra.get("group") == rb.get("group") and len(ra["step_ms"]) == len(rb["step_ms"]):
        rates = [[r["batch"] / t for t in r["step_ms"]] for r in (ra, rb)]
        return paired_ratio(*rates)
    return ratio(ra["decode_tok_s"], rb["decode_tok_s"])


def goal_row(figure: str, value: float | None, goal: float) -> dict[str, Any]:
    status = "not measured" if value is None else ("met" if value >= goal else "missed")
    shown = "-" if value is None else value
    return {"figure": figure, "value": shown, "goal": f">= {goal:g}", "status": status}


def goals(args: argparse.Namespace, runs: Runs, floor: dict, attn: list[dict]) -> list[dict]:
    """Every goal of the issue with its value (the first grid context, the largest batch);
    the decode ratios are medians of per-round ratios (``paired``)."""
    c0, top, long = args.contexts[0], max(args.batches), args.long
    scaling = paired(runs, ("fp32", top, c0), ("fp32", 1, c0))
    rows = [goal_row(f"{top}x{c0} fp32 / 1x{c0} fp32", scaling, BATCH_GOAL)]
    for c in args.contexts:
        for codec, goal in CODEC_GOALS.items():
            value = paired(runs, (codec, top, c), ("fp32", top, c))
            rows.append(goal_row(f"{top}x{c} {codec} / fp32", value, goal))
    for codec, goal in LONG_GOALS.items():
        value = paired(runs, (codec, 1, long), ("fp32", 1, long))
        rows.append(goal_row(f"1x{long} {codec} / fp32", value, goal))
    figure = f"1x{long} fp32 / floor {floor['floor_tok_s']:.1f} tok/s"
    rows.append(goal_row(figure, floor["fraction"], FLOOR_GOAL))
    fp32 = [r for r in attn if r["codec"] == "fp32"]
    figure = f"attention fp32 at {args.history} / a sum over the same bytes"
    rows.append(goal_row(figure, fp32[0]["of_same_bytes"] if fp32 else None, ATTENTION_GOAL))
    return rows


def floor_of(args: argparse.Namespace, long: dict[str, Any], rate: Rates) -> dict[str, Any]:
    """1 / (short step + fp32 K/V bytes at the long context / bandwidth), and fp32's share."""
    step = 1 / rate[("fp32", 1, SHORT)]
    context = args.long + args.warm + (args.steps + 1) / 2  # mean history of the timed steps
    kv = long["fp32_kv_per_token"] * context
    floor = 1 / (step + kv / long["bandwidth"])
    return {
        "short_step_ms": step * 1e3,
        "bandwidth_gb_s": long["bandwidth"] / 1e9,
        "fp32_kv_bytes": kv,
        "floor_tok_s": floor,
        "fraction": ratio(rate.get(("fp32", 1, args.long)), floor),
    }


def pivot(runs: list[dict[str, Any]], key: str, by_key: Runs) -> list[dict[str, Any]]:
    """A line per codec, a column per batch x prompt tokens (decode: x fp32 beside, the
    median of per-round ratios; decode_tok_s_mean: the ratio of the two means)."""
    lines: dict[str, dict[str, Any]] = {}
    for r in sorted(runs, key=lambda r: (r["context"], r["batch"])):
        text, shape = f"{r[key]:.1f}", (r["batch"], r["context"])
        vs = None
        if key == "decode_tok_s":
            vs = paired(by_key, (r["codec"], *shape), ("fp32", *shape))
        elif key == "decode_tok_s_mean" and ("fp32", *shape) in by_key:
            vs = ratio(r[key], by_key[("fp32", *shape)][key])
        if r["codec"] != "fp32" and vs is not None:
            text += f" ({vs:.2f}x)"
        lines.setdefault(r["codec"], {"codec": r["codec"]})[f"{r['batch']}x{r['context']}"] = text
    return list(lines.values())


def hf_rows(ours: dict[int, dict], hf: dict[tuple[str, int], dict]) -> list[dict[str, Any]]:
    """Ours fp32 and transformers, one sequence per prompt length, vs DynamicCache."""
    rows = []
    for length, mine in sorted(ours.items()):
        base = hf.get(("hf-dynamic", length))
        systems = [("ours-fp32", mine), *[(s, hf.get((s, length))) for s in HF_SYSTEMS]]
        for system, r in systems:
            if r is None or base is None:
                continue
            rows.append(
                {
                    "system": system,
                    "prompt": length,
                    "prefill_tok_s": r["prefill_tok_s"],
                    "decode_tok_s": r["decode_tok_s"],
                    "vs_dynamic": r["decode_tok_s"] / base["decode_tok_s"],
                    "same_greedy_tokens": agreement(r["tokens"], base["tokens"]),
                }
            )
    return rows


def report(args: argparse.Namespace, results: dict[tuple[str, int], Any]) -> dict[str, Any]:
    """The tables (each a list of rows) and the figures behind them."""
    grid = [r for (w, _), res in results.items() if w == "grid" for r in res["rows"]]
    long, attn = results[("long", 0)], results[("attention", 0)]
    for r in attn["rows"]:
        r["of_bandwidth"] = r["gb_s"] * 1e9 / attn["bandwidth"]
    runs = grid + long["rows"]
    by_key = {(r["codec"], r["batch"], r["context"]): r for r in runs}
    rate = {key: r["decode_tok_s"] for key, r in by_key.items()}
    floor = floor_of(args, long, rate)
    ours = {
        r["context"]: r
        for r in runs
        if (r["codec"], r["batch"]) == ("fp32", 1) and r["context"] in (SHORT, args.contexts[0])
    }
    hf = {key: res for key, res in results.items() if key[0] in HF_SYSTEMS}
    return {
        "tables": {
            "decode": pivot(runs, "decode_tok_s", by_key),
            "throughput": pivot(runs, "decode_tok_s_mean", by_key),
            "prefill": pivot(runs, "prefill_tok_s", by_key),
            "attention": attn["rows"],
            "transformers": hf_rows(ours, hf),
            "goals": goals(args, by_key, floor, attn["rows"]),
        },
        "floor": floor,
        "attention_bandwidth_gb_s": attn["bandwidth"] / 1e9,
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    print(f"kernels: {extension().__file__}")  # built once, outside every worker
    if not args.no_hf:
        hf_checkpoint(args.hf_dir)
    with tempfile.TemporaryDirectory() as folder:
        tokens = write_tokens(args, Path(folder))
        results = {(w, c): measure(w, c, args, tokens) for w, c in jobs(args)}
    out = report(args, results)
    floor, bandwidth = out["floor"], out["attention_bandwidth_gb_s"]
    titles = {
        "decode": "aggregate decode tok/s (x fp32 at the same shape); columns: batch x prompt",
        "throughput": "aggregate decode tok/s over all the timed steps (tokens / seconds: the "
        "steps that seal window rows into codes count in full)",
        "prefill": "prefill tok/s",
        "attention": f"cache.attention alone, one decode row, {args.history}-token history, "
        f"SmolLM2 shapes, all layers in turn (read bandwidth {bandwidth:.1f} GB/s)",
        "transformers": "ours fp32 vs transformers generate, one sequence",
        "goals": f"goals (floor = 1 / ({floor['short_step_ms']:.1f} ms step + "
        f"{floor['fp32_kv_bytes'] / 1e6:.0f} MB / {floor['bandwidth_gb_s']:.1f} GB/s))",
    }
    print(
        f"\nSmolLM2-135M fp32 weights, threads={args.threads}, greedy; median of {args.steps} "
        f"decode steps after {args.warm}; {minutes():.1f} min, load average "
        f"{started_load():.1f} -> {load():.1f} on {os.cpu_count()} cores"
    )
    if started_load() > QUIET_LOAD:
        print("WARNING: the machine was busy before the run; these are not final figures")
    for name, rows in out["tables"].items():
        if rows:
            columns = list(dict.fromkeys(k for r in rows for k in r))
            print(f"\n{titles[name]}\n{table(rows, columns)}")
    settings = {k: getattr(args, k) for k in ("threads", "warm", "steps", "max_batch", "quick")}
    name = "decode_quick" if args.quick else "decode"
    print()
    write_json(name, {**settings, **out})
    if not args.no_plot:
        runs = [r for r in out["runs"] if r["context"] != SHORT]
        plot(name, lambda fig, axes: draw(fig, axes, runs), figsize=(12, 4.5), ncols=2)
    return 0


def draw(fig: Any, axes: Any, runs: list[dict[str, Any]]) -> None:
    """Aggregate decode tok/s against batch size (a line style per prompt length) and
    against prompt length (the largest batch and one sequence); a colour per codec."""
    import matplotlib.pyplot as plt

    by_batch, by_length = axes
    colours = dict(zip(CODECS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    batched = {r["context"] for r in runs if r["batch"] > 1}  # grid contexts
    lengths, top = sorted(batched), max(r["batch"] for r in runs)
    for codec, colour in colours.items():
        mine = [r for r in runs if r["codec"] == codec]
        for i, n in enumerate(lengths):
            pts = [(r["batch"], r["decode_tok_s"]) for r in mine if r["context"] == n]
            curve(by_batch, pts, STYLES[i], colour, codec if i == 0 else None)
        for i, b in enumerate(dict.fromkeys((top, 1))):
            pts = [(r["context"], r["decode_tok_s"]) for r in mine if r["batch"] == b]
            curve(by_length, pts, STYLES[i], colour, codec if i == 0 else None)
    keys = ", ".join(f"'{s}' {n}" for s, n in zip(STYLES, lengths, strict=False))
    by_batch.set(
        xlabel="sequences decoding together (distinct prompts)", title=f"prompt tokens: {keys}"
    )
    by_length.set(xlabel="prompt tokens", title=f"'-' {top} sequences, '--' 1 sequence")
    ticks = {by_batch: {r["batch"] for r in runs}, by_length: {r["context"] for r in runs}}
    for ax, xs in ticks.items():
        ax.set(xscale="log", ylabel="aggregate decode tok/s")
        ax.set_xticks(sorted(xs), [str(x) for x in sorted(xs)])
        ax.minorticks_off()
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M decode on the cell cache, per codec (fp32 weights)")


def curve(
    ax: Any, pts: list[tuple[float, float]], style: str, colour: str, name: str | None
) -> None:
    if pts:
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, style, marker="o", color=colour, label=name)


if __name__ == "__main__":
    sys.exit(main())

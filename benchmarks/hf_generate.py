"""SmolLM2-135M in transformers' generate: what does each cache cost per decode step?

Contenders, in one process, on the same model and prompts: transformers' DynamicCache,
StaticCache and QuantizedCache (quanto int4) under sdpa, and ours,
``KVCacheForTransformers(config, codec=C)`` under ``attn_implementation="kvcache"`` (the
attention reads the codes in the cell cache) for C in fp32, int8, kivi4, turbo4
(``--decoded`` adds ``sdpa-C``: ours under sdpa, attending over K/V decoded every step).

For each prompt length and batch size (distinct prompts per row: consecutive slices of the
Debian license texts), every contender prefills its own cache once (generate of one token),
then the rounds: each contender in turn continues its own greedy generate by ``--step``
tokens from its cache, the order rotating each round (``harness.take_turns``). Decode tok/s
= batch x step / the round's time (aggregate over rows); ``x_dynamic`` / ``x_quanto`` = the
median of per-round ratios. KV bytes: ours = bytes the cells in use hold (``held``) and the
storage allocated; transformers' caches = every tensor they hold. ``same`` = greedy tokens
equal to DynamicCache's, first row, up to that token.

RSS (a worker process per codec at the longest length, batch 1; ``--rss-only``): after the
prefill, memory freed is handed back (``malloc_trim``: else the steps would reuse the
prefill's freed pages unseen) and the peak RSS is reset (``/proc/self/clear_refs``), then 32
decode tokens; ``growth``
= that peak - the RSS before them - the growth of the cache's own bytes. The issue's bound:
< 10 MB for ours under "kvcache" (the sdpa rows show what decoding the history costs).

    .venv/bin/python benchmarks/hf_generate.py                      # 1k and 4k, batch 1 and 4
    .venv/bin/python benchmarks/hf_generate.py --lengths 512 --batches 1 --rounds 2 --no-rss

Writes benchmarks/results/hf_generate.json and .png (decode tok/s against context per cache,
one panel per batch size). Goals (4k, batch 1): ours fp32 >= 1.4x DynamicCache, int8 and
kivi4 >= 1.5x, turbo4 >= 1.3x, each >= 3x QuantizedCache.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common import hf_checkpoint, license_tokens
from harness import paired_ratio, plot, spawn_worker, table, take_turns, worker_result, write_json

PEERS = ("dynamic", "static", "quanto-int4")
CODECS = ("fp32", "int8", "kivi4", "turbo4")
GOALS = {"fp32": 1.4, "int8": 1.5, "kivi4": 1.5, "turbo4": 1.3}  # x DynamicCache at 4k, batch 1
GOAL_QUANTO = 3.0
RSS_STEPS = 32
DEFAULT_HF_DIR = Path.home() / ".cache" / "kvcache" / "smollm2-hf"


def load_model(hf_dir: Path) -> Any:
    import transformers

    import kvcache.hf  # noqa: F401  # registers the "kvcache" attention implementation

    transformers.logging.set_verbosity_error()
    return transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def prompts(length: int, batch: int) -> torch.Tensor:
    """``batch`` distinct prompts of ``length`` tokens [batch, length]."""
    from kvcache.text.tokenizer import Tokenizer
    from kvcache.weights.gguf import smollm2_path

    ids = license_tokens(Tokenizer.from_gguf(smollm2_path()), length * batch)
    return torch.tensor(ids).view(batch, length)


# ---- caches ------------------------------------------------------------------------------
def make_cache(name: str, config: Any, capacity: int, batch: int) -> tuple[Any, str]:
    """A fresh cache by contender name and the attention implementation it runs under."""
    from transformers import DynamicCache, QuantizedCache, StaticCache

    from kvcache.hf import KVCacheForTransformers

    if name in CODECS or name.startswith("sdpa-"):
        codec = name.removeprefix("sdpa-")
        cache = KVCacheForTransformers(config, capacity=capacity, max_batch_size=batch, codec=codec)
        return cache, "sdpa" if name.startswith("sdpa-") else "kvcache"
    peers: dict[str, Callable[[], Any]] = {
        "dynamic": lambda: DynamicCache(config=config),
        "static": lambda: StaticCache(config=config, max_cache_len=capacity),
        "quanto-int4": lambda: QuantizedCache(backend="quanto", config=config, nbits=4),
    }
    return peers[name](), "sdpa"


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable from ``obj`` (quanto QTensors through their inner
    tensors, cache layers through their attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith(("transformers", "optimum")):
        return sum(tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


def kv_bytes(cache: Any) -> tuple[int, int]:
    """(bytes held, bytes allocated) of a cache's K/V."""
    if hasattr(cache, "caches"):  # ours
        held = sum(c.held_bytes() for c in cache.caches)
        return held, int(cache.memory_usage_bytes())
    n = sum(tensor_bytes(layer) for layer in cache.layers)
    return n, n


# ---- one contender -------------------------------------------------------------------------
class Contender:
    """One cache generating greedily, ``step`` tokens per call, from where it stopped."""

    def __init__(self, name: str, model: Any, ids: torch.Tensor, capacity: int) -> None:
        self.name, self.model = name, model
        self.cache, self.attn = make_cache(name, model.config, capacity, ids.shape[0])
        self.seqs = ids
        self.prefill_s = self._generate(1)

    def _generate(self, new: int) -> float:
        self.model.set_attn_implementation(self.attn)
        start = time.perf_counter()
        with torch.no_grad():
            self.seqs = self.model.generate(
                self.seqs,
                attention_mask=torch.ones_like(self.seqs),
                past_key_values=self.cache,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    def decode(self, step: int) -> Callable[[], float]:
        return lambda: self._generate(step)


def measure(model: Any, names: list[str], length: int, batch: int, args: Any) -> list[dict]:
    """Rounds of ``args.step`` tokens per contender at one (length, batch), taking turns."""
    ids = prompts(length, batch)
    capacity = length + 1 + (args.rounds + 1) * args.step
    contenders = {}
    for name in names:
        print(f"  prefill {name} L={length} B={batch}", flush=True)
        contenders[name] = Contender(name, model, ids, capacity)
    times = take_turns({n: c.decode(args.step) for n, c in contenders.items()}, args.rounds, warm=1)
    ref = contenders["dynamic"].seqs[0, length:].tolist() if "dynamic" in contenders else None
    rows = []
    for name, c in contenders.items():
        held, allocated = kv_bytes(c.cache)
        row: dict[str, Any] = {
            "cache": name,
            "attn": c.attn,
            "length": length,
            "batch": batch,
            "prefill_tok_s": length * batch / c.prefill_s,
            "decode_tok_s": batch * args.step / statistics.median(times[name]),
            "kv_held_mib": held / 2**20,
            "kv_alloc_mib": allocated / 2**20,
        }
        for peer in ("dynamic", "quanto-int4"):
            if peer in times:
                row[f"x_{peer.split('-')[0]}"] = paired_ratio(times[peer], times[name])
        if ref is not None:
            mine = c.seqs[0, length:].tolist()
            row["same"] = next(
                (i for i, (a, b) in enumerate(zip(ref, mine, strict=False)) if a != b), len(ref)
            )
        rows.append(row)
    del contenders
    return rows


# ---- peak RSS over decode (a worker per codec) --------------------------------------------
def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_worker(name: str, length: int, hf_dir: Path) -> dict[str, Any]:
    model = load_model(hf_dir)
    warm = Contender(name, model, prompts(64, 1), 64 + 40)
    warm._generate(8)
    del warm
    c = Contender(name, model, prompts(length, 1), length + RSS_STEPS + 8)
    c._generate(2)  # the first decode steps allocate what every step reuses
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed prefill memory leaves: reuse would hide
    before, held = rss_bytes(), kv_bytes(c.cache)[1]
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    c._generate(RSS_STEPS)
    peak = peak_bytes()
    grown = kv_bytes(c.cache)[1] - held
    return {
        "cache": name,
        "length": length,
        "rss_before_mib": before / 2**20,
        "peak_mib": peak / 2**20,
        "cache_growth_mib": grown / 2**20,
        "growth_mib": (peak - before - grown) / 2**20,
    }


# ---- report --------------------------------------------------------------------------------
def goals(rows: list[dict[str, Any]], length: int) -> list[str]:
    by = {r["cache"]: r for r in rows if r["length"] == length and r["batch"] == 1}
    out = []
    for codec, goal in GOALS.items():
        r = by.get(codec)
        if r is None:
            continue
        for key, want, peer in (
            ("x_dynamic", goal, "DynamicCache"),
            ("x_quanto", GOAL_QUANTO, "quanto"),
        ):
            if key in r:
                ok = r[key] >= want
                out.append(
                    f"[{'met' if ok else 'MISSED'}] L={length} B=1: {codec} decode "
                    f"{r[key]:.2f}x {peer} (goal >= {want}x)"
                )
    return out


def draw(rows: list[dict[str, Any]], batches: list[int]) -> Callable[[Any, Any], None]:
    def inner(fig: Any, axes: Any) -> None:
        axes = [axes] if len(batches) == 1 else list(axes)
        for ax, batch in zip(axes, batches, strict=True):
            mine = [r for r in rows if r["batch"] == batch]
            for name in dict.fromkeys(r["cache"] for r in mine):
                pts = [r for r in mine if r["cache"] == name]
                style = "-o" if name in CODECS else "--s"
                label = f"ours {name}" if name in CODECS else name
                xs = [r["length"] for r in pts]
                ax.plot(xs, [r["decode_tok_s"] for r in pts], style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (prompt tokens)")
            ax.set_ylabel("decode tok/s (all rows)")
            ax.set_title(f"batch {batch}")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle("SmolLM2-135M generate, caches side by side (shared machine)", fontsize=10)

    return inner


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (its parent package missing counts as not)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--caches", nargs="+", default=[*PEERS, *CODECS])
    ap.add_argument("--decoded", action="store_true", help="add ours under sdpa (sdpa-CODEC)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step", type=int, default=8, help="decode tokens per contender per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS workers")
    ap.add_argument("--rss-only", action="store_true", help="only the peak-RSS workers")
    ap.add_argument("--name", default="hf_generate", help="result name")
    ap.add_argument("--hf-dir", type=Path, default=DEFAULT_HF_DIR)
    ap.add_argument("--rss-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.rss_worker:
        worker_result(rss_worker(args.rss_worker, max(args.lengths), args.hf_dir))
        return 0
    names = list(args.caches) + ([f"sdpa-{c}" for c in CODECS] if args.decoded else [])
    if "quanto-int4" in names and not installed("optimum.quanto"):
        ap.error('quanto-int4 needs optimum-quanto: .venv/bin/pip install -e ".[peers]"')
    hf_checkpoint(args.hf_dir)
    model = load_model(args.hf_dir)
    rows: list[dict[str, Any]] = []
    for batch in [] if args.rss_only else args.batches:
        for length in args.lengths:
            rows += measure(model, names, length, batch, args)
    columns = ["cache", "attn", "length", "batch", "prefill_tok_s", "decode_tok_s"]
    columns += ["x_dynamic", "x_quanto", "kv_held_mib", "kv_alloc_mib", "same"]
    if rows:
        print(table(rows, columns))
    rss = []
    if not args.no_rss:
        top = max(args.lengths)
        for name in [c for c in CODECS if c in names] + ["sdpa-int8"]:
            worker_args = [
                "--rss-worker",
                name,
                "--lengths",
                str(top),
                "--hf-dir",
                str(args.hf_dir),
            ]
            worker_args += ["--threads", str(args.threads)]
            rss.append(spawn_worker(__file__, worker_args, args.threads, f"rss {name}"))
        print(
            table(
                rss,
                ["cache", "length", "rss_before_mib", "peak_mib", "cache_growth_mib", "growth_mib"],
            )
        )
    checks = goals(rows, 4096 if 4096 in args.lengths else max(args.lengths))
    print("\n".join(checks))
    payload = {"step": args.step, "rounds": args.rounds, "rows": rows, "rss": rss, "goals": checks}
    write_json(args.name, payload)
    if rows:
        plot(
            args.name,
            draw(rows, args.batches),
            figsize=(6.0 * len(args.batches), 4.5),
            ncols=len(args.batches),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""SmolLM2-135M decoding: ours (cell cache) vs transformers generate (DynamicCache, StaticCache).

Same weights (the GGUF dequantized to float32; transformers loads a checkpoint converted once
from the same file), same dtype, same thread count, greedy, exactly N new tokens (EOS
ignored). Each measurement runs in its own subprocess so peak RSS (ru_maxrss, model load
included) belongs to one system only. A worker warms up, then times one run; the driver makes
``--rounds`` passes over all configurations and keeps the best of each (this machine is
shared: spreading a system's samples over time and keeping the best is the least noisy).

Prefill tok/s = prompt tokens / time to the first new token; decode tok/s = the other N-1
tokens / their time (transformers: timed with a streamer on its generate loop; ours: the
Generator's own counters). Then the aggregate decode throughput of ours with 1, 4 and 16
sequences decoding together in one cache (distinct 16-token prompts).

    .venv/bin/python benchmarks/decode.py            # prompts 16, 1k, 4k; 128 new; 1/4/16 seqs
    .venv/bin/python benchmarks/decode.py --quick    # prompts 16, 1k; 32 new; 1/4 seqs

Writes benchmarks/results/decode.json and, with matplotlib, decode.png.
Goals (issue 3): decode >= 1.3x DynamicCache at 1k and >= 1.5x at 4k; 16 sequences >= 6x the
aggregate tokens/s of one; peak RSS no higher than transformers'.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    agreement,
    hf_checkpoint,
    spawn_worker,
    table,
    token_clock,
    write_json,
)

SYSTEMS = ("ours", "hf-dynamic", "hf-static")
PROMPT_SEED = 1234


def prompt_ids(length: int, index: int = 0) -> list[int]:
    """A deterministic prompt of ordinary vocabulary ids (no special tokens)."""
    g = torch.Generator().manual_seed(PROMPT_SEED + index)
    return torch.randint(100, 49000, (length,), generator=g).tolist()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- workers (run in a subprocess each) ------------------------------------------------
def worker_ours(length: int, new: int, parallel: int, repeats: int) -> dict[str, Any]:
    """Our Generator: `parallel` prompts of `length` tokens, `new` tokens each."""
    from kvcache.generate import GenerationConfig, Generator
    from kvcache.models.llama import Llama

    model = Llama.from_gguf(dtype=torch.float32)

    def once(n_new: int, prompt_len: int) -> tuple[float, float, list[int]]:
        gen = Generator(model, capacity=prompt_len + n_new, max_sequences=parallel, max_batch=512)
        cfg = GenerationConfig(max_new_tokens=n_new, ignore_eos=True)
        ids = gen.add_many([prompt_ids(prompt_len, i) for i in range(parallel)], cfg)
        for _ in gen.run():
            pass
        s = gen.stats
        gen.close()
        return s.prefill_rate, s.decode_rate, gen.results[ids[0]].tokens

    once(4, 8)  # warm-up
    runs = [once(new, length) for _ in range(repeats)]
    return {
        "prefill_tok_s": max(r[0] for r in runs),
        "decode_tok_s": max(r[1] for r in runs),
        "tokens": runs[0][2],
    }


def worker_hf(length: int, new: int, static: bool, repeats: int, hf_dir: str) -> dict[str, Any]:
    """transformers generate, greedy, DynamicCache or StaticCache (eager)."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def once(n_new: int, prompt_len: int) -> tuple[float, float, list[int]]:
        ids = torch.tensor([prompt_ids(prompt_len)])
        clock = token_clock()
        kwargs: dict[str, Any] = {"cache_implementation": "static"} if static else {}
        start = time.perf_counter()
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
        end = time.perf_counter()
        first = clock.times[1]  # times[0]: the prompt, put before any forward
        prefill = prompt_len / (first - start)
        decode = (n_new - 1) / (end - first)
        return prefill, decode, out[0, prompt_len:].tolist()

    once(4, 8)
    runs = [once(new, length) for _ in range(repeats)]
    return {
        "prefill_tok_s": max(r[0] for r in runs),
        "decode_tok_s": max(r[1] for r in runs),
        "tokens": runs[0][2],
    }


def run_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.worker == "ours":
        result = worker_ours(args.length, args.new_tokens, args.parallel, args.repeats)
    else:
        static = args.worker == "hf-static"
        result = worker_hf(args.length, args.new_tokens, static, args.repeats, args.hf_dir)
    result["peak_rss_mib"] = peak_rss_mib()
    print("RESULT " + json.dumps(result), flush=True)


# ---- driver ----------------------------------------------------------------------------
def measure(system: str, length: int, parallel: int, args: argparse.Namespace) -> dict[str, Any]:
    """One worker subprocess; its RESULT line parsed."""
    worker_args = [
        "--worker",
        system,
        "--length",
        str(length),
        "--new-tokens",
        str(args.new_tokens),
    ]
    worker_args += ["--parallel", str(parallel), "--threads", str(args.threads)]
    worker_args += ["--repeats", str(args.repeats), "--hf-dir", str(args.hf_dir)]
    return spawn_worker(__file__, worker_args, args.threads, f"{system} L={length}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Each measurement runs in its own subprocess; see the module docstring.",
    )
    parser.add_argument("--quick", action="store_true", help="prompts 16, 1k; 32 new; 1/4 seqs")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens (128)")
    parser.add_argument("--parallel-list", type=int, nargs="+", default=None, help="1 4 16")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds over all configurations, best kept (2)"
    )
    parser.add_argument(
        "--hf-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "kvcache"
        / "smollm2-hf",
        help="converted transformers checkpoint (made once)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--parallel", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args()


def best(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Fastest rates and the largest peak RSS over a configuration's samples."""
    return {
        "prefill_tok_s": max(r["prefill_tok_s"] for r in samples),
        "decode_tok_s": max(r["decode_tok_s"] for r in samples),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in samples),
        "tokens": samples[0]["tokens"],
    }


def main() -> int:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return 0
    lengths = args.lengths or ([16, 1024] if args.quick else [16, 1024, 4096])
    args.new_tokens = args.new_tokens or (32 if args.quick else 128)
    parallels = args.parallel_list or ([1, 4] if args.quick else [1, 4, 16])
    rounds = args.rounds or (1 if args.quick else 2)
    hf_checkpoint(args.hf_dir)
    load_before = os.getloadavg()

    # every round measures every configuration once: samples of one system spread over time,
    # so a burst of load on this shared machine does not hit one system only
    configs = [(system, length, 1) for length in lengths for system in SYSTEMS]
    configs += [("ours", 16, n) for n in parallels]
    samples: dict[tuple[str, int, int], list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(rounds):
        for system, length, n in configs:
            sample = measure(system, length, n, args)
            samples[(system, length, n)].append(sample)
            print(
                f"round {r + 1}/{rounds}: {system:10} prompt={length:5} seqs={n:2}: prefill "
                f"{sample['prefill_tok_s']:7.1f} tok/s, decode {sample['decode_tok_s']:6.1f} "
                f"tok/s, peak RSS {sample['peak_rss_mib']:.0f} MiB (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    results = {c: best(v) for c, v in samples.items()}

    rows: list[dict[str, Any]] = []
    for length in lengths:
        base = results[("hf-dynamic", length, 1)]
        for system in SYSTEMS:
            res = results[(system, length, 1)]
            rows.append(
                {
                    "system": system,
                    "prompt": length,
                    "prefill_tok_s": res["prefill_tok_s"],
                    "decode_tok_s": res["decode_tok_s"],
                    "vs_dynamic": res["decode_tok_s"] / base["decode_tok_s"],
                    "peak_rss_mib": res["peak_rss_mib"],
                    "same_greedy_tokens": agreement(res["tokens"], base["tokens"]),
                }
            )
    one = results[("ours", 16, parallels[0])]["decode_tok_s"]
    parallel_rows = [
        {
            "sequences": n,
            "aggregate_decode_tok_s": results[("ours", 16, n)]["decode_tok_s"],
            "vs_one": results[("ours", 16, n)]["decode_tok_s"] / one,
            "peak_rss_mib": results[("ours", 16, n)]["peak_rss_mib"],
        }
        for n in parallels
    ]
    load_after = os.getloadavg()
    print()
    print(
        f"SmolLM2-135M float32, {args.threads} threads, {args.new_tokens} new tokens, greedy, "
        f"best of {rounds} rounds (load average {load_before[0]:.1f} -> {load_after[0]:.1f} "
        f"on {os.cpu_count()} cores)"
    )
    print(table(rows, list(rows[0])))
    print()
    print(table(parallel_rows, list(parallel_rows[0])))
    path = write_json(
        "decode",
        {
            "new_tokens": args.new_tokens,
            "threads_requested": args.threads,
            "rounds": rounds,
            "quick": args.quick,
            # this machine is shared: the 1-minute load average says how quiet it was
            "loadavg_before_after": [load_before[0], load_after[0]],
            "rows": rows,
            "parallel": parallel_rows,
            "samples": [
                {
                    "system": c[0],
                    "prompt": c[1],
                    "sequences": c[2],
                    "runs": [{k: x for k, x in run.items() if k != "tokens"} for run in v],
                }
                for c, v in samples.items()
            ],
        },
    )
    print(f"\nwrote {path}")
    if not args.no_plot:
        plot(rows, parallel_rows, RESULTS / "decode.png")
    return 0


def plot(rows: list[dict[str, Any]], parallel_rows: list[dict[str, Any]], path: Path) -> None:
    """Decode tok/s per prompt length per system, and aggregate tok/s per sequence count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for system in SYSTEMS:
        pts = [(r["prompt"], r["decode_tok_s"]) for r in rows if r["system"] == system]
        left.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=system)
    left.set_xscale("log", base=2)
    left.set_xlabel("prompt tokens")
    left.set_ylabel("decode tokens/s")
    left.set_title("SmolLM2-135M fp32 decode, batch 1")
    left.legend()
    right.bar(
        [str(r["sequences"]) for r in parallel_rows],
        [r["aggregate_decode_tok_s"] for r in parallel_rows],
    )
    right.set_xlabel("sequences decoding together (ours)")
    right.set_ylabel("aggregate decode tokens/s")
    right.set_title("one cache, one forward per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

"""Long context within a memory budget (issue 14): a RULER-style suite on SmolLM2-135M that
judges eviction presses composed with the K/V codecs.

Protocol (query-agnostic, as kvpress evaluates presses): for each sample of
``ruler_tasks`` (passkey, niah_single, niah_multikey, vt, cwe at 1k/2k/4k/8k tokens, haystacks
from the Debian license texts, the model's chat template), the context is prefilled into a
fresh cache (the press observing), the press evicts, then the question and the answer prefix
are fed and a short answer is decoded greedily. Score: RULER's string match.

Self-calibrated: the fp32 cache without a press runs first; only task x length cells where
it scores >= 70 % are kept, and every configuration (press x codec) reports
**retention** = its score / the fp32 score over the kept cells, and its **total compression**
= fp16 bytes of the context / bytes the cache holds after the press. Writes
benchmarks/results/long_context.json and long_context.png (retention against total
compression, one line per press x codec). Goals (issue 14), printed met / missed / not
measured: retention >= 97 % at 4x total compression and >= 90 % at 8x; at every ratio
>= 0.5 the best press beats StreamingLLM (same codec); pressing costs <= 10 % of the
prefill, where the cost is (prefill under ``observe`` + ``compress``) / the same codec's
plain prefill of the same samples - 1.

    python benchmarks/long_context.py --quick                        # 1k, 2k; 3 samples
    python benchmarks/long_context.py --presses none --codecs fp32 int8 kivi4
    python benchmarks/long_context.py --presses none snapkv:0.5 streaming:0.5 --tasks passkey

A press spec is ``NAME:RATIO`` (kvcache.press; RATIO = fraction of the context's cells
evicted) or ``none``; a codec spec is as in kv_quality.py (``int8``, ``int8/int4``,
``kivi4@post``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LICENSES, RESULTS, machine, table  # noqa: E402
from kv_quality import held_bytes, make_cache  # noqa: E402
from kvcache import Batch, CausalCache  # noqa: E402
from kvcache.models.llama import Llama  # noqa: E402
from kvcache.text.tokenizer import Tokenizer  # noqa: E402
from ruler_tasks import TASKS, Corpus, PromptFormat, Sample, make_sample, string_match_all  # noqa: E402

LENGTHS = [1024, 2048, 4096, 8192]
QUICK_LENGTHS = [1024, 2048]
PRESS_NAMES = ["streaming", "snapkv", "knorm", "tova", "expected", "adakv"]
RATIOS = [0.25, 0.5, 0.75]
CODECS = ["fp32", "int8", "kivi4", "turbo4"]
KEEP = 0.70  # a cell is kept when the fp32 cache without a press scores at least this
CHUNK = 1024  # prefill chunk (tokens per forward)
# goals of issue 14: (total compression at least, retention at least)
COMPRESSION_GOALS = [(4.0, 0.97), (8.0, 0.90)]
PRESS_COST_GOAL = 0.10  # pressing costs at most this fraction of the prefill it follows


@dataclass(frozen=True)
class Pressed:
    """What prefill + press did to one context."""

    prefill_s: float
    press_s: float
    compression: float | None  # fp16 bytes of the context / bytes held; None: no press


@dataclass(frozen=True)
class Config:
    press: str
    codec: str

    @property
    def name(self) -> str:
        return f"{self.press} x {self.codec}"

    @property
    def ratio(self) -> float:
        ratio = self.press.partition(":")[2].split(",")[0]  # "snapkv:0.5,window=32"
        return 0.0 if self.press == "none" else float(ratio or 0)

    @property
    def press_name(self) -> str:
        return self.press.partition(":")[0]


def fp16_bytes(model: Llama, tokens: int) -> int:
    """Bytes of ``tokens`` tokens' K and V in fp16, all layers: the compression's numerator
    (the context's, also after a press that compacts positions)."""
    c = model.config
    return tokens * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2


def prefill(model: Llama, cache: CausalCache, seq: int, ids: list[int]) -> None:
    """The context into ``seq``'s cells, CHUNK tokens per forward."""
    for start in range(0, len(ids), CHUNK):
        n = min(CHUNK, len(ids) - start)
        model.forward(ids[start : start + n], Batch.single(seq, start, n), cache, outputs=[])


def apply_press(
    spec: str, model: Llama, cache: CausalCache, seq: int, context_ids: list[int]
) -> Pressed:
    """Prefill ``context_ids`` and press them: the one place the harness touches a press."""
    if spec == "none":
        t0 = time.perf_counter()
        prefill(model, cache, seq, context_ids)
        return Pressed(time.perf_counter() - t0, 0.0, None)
    from kvcache.press import make_press

    press = make_press(spec)
    t0 = time.perf_counter()
    with press.observe(cache):
        prefill(model, cache, seq, context_ids)
    t1 = time.perf_counter()
    press.compress(cache, seq)
    t2 = time.perf_counter()
    return Pressed(t1 - t0, t2 - t1, fp16_bytes(model, len(context_ids)) / cache.held_bytes(seq))


def answer(
    model: Llama, cache: CausalCache, seq: int, question: list[int], limit: int, eos: int | None
) -> list[int]:
    """Greedy answer to ``question`` fed after whatever the cache holds for ``seq``."""
    pos = cache.next_position(seq)
    logits = model.forward(
        question, Batch.single(seq, pos, len(question)), cache, outputs=[len(question) - 1]
    )
    out: list[int] = []
    pos += len(question)
    while True:
        token = int(logits[-1].argmax())
        if token == eos or len(out) == limit:
            return out
        out.append(token)
        logits = model.forward([token], Batch.single(seq, pos, 1), cache)
        pos += 1


@dataclass
class Bench:
    """The model, the tokenizer and the samples of one run."""

    model: Llama
    tokenizer: Tokenizer
    samples: dict[tuple[str, int], list[Sample]]
    codec_bytes: dict[tuple[str, int], int]

    def run(self, config: Config, sample: Sample) -> dict[str, Any]:
        """One sample under ``config``: its score, answer, timings and total compression."""
        tok = self.tokenizer
        context = tok.encode(sample.context, add_bos=False)
        question = tok.encode(sample.question, add_bos=False)
        cache = make_cache(
            self.model, config.codec, len(context) + len(question) + sample.max_new_tokens
        )
        try:
            pressed = apply_press(config.press, self.model, cache, 0, context)
            ids = answer(self.model, cache, 0, question, sample.max_new_tokens, tok.eos_id)
        finally:
            cache.close()
        text = tok.decode(ids)
        compression = pressed.compression
        if compression is None:
            compression = fp16_bytes(self.model, len(context)) / self._held(
                config.codec, len(context)
            )
        return {
            "score": string_match_all(text, sample.answers),
            "output": text,
            "prefill_s": pressed.prefill_s,
            "press_s": pressed.press_s,
            "compression": compression,
        }

    def _held(self, codec: str, n: int) -> int:
        if (codec, n) not in self.codec_bytes:
            self.codec_bytes[codec, n] = held_bytes(self.model, codec, n)
        return self.codec_bytes[codec, n]


def evaluate(bench: Bench, config: Config, cells: list[tuple[str, int]]) -> dict[str, Any]:
    """Every sample of ``cells`` under ``config``: per-cell scores and totals."""
    todo = [(cell, s) for cell in cells for s in bench.samples[cell]]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {cell: [] for cell in cells}
    for cell, sample in tqdm(todo, desc=config.name, unit="sample", leave=False):
        runs[cell].append(bench.run(config, sample))
    flat = [r for rs in runs.values() for r in rs]
    return {
        "press": config.press,
        "codec": config.codec,
        "cells": {
            f"{t}@{n}": {
                "score": _mean(rs, "score"),
                "prefill_s": sum(r["prefill_s"] for r in rs),
                "press_s": sum(r["press_s"] for r in rs),
                "outputs": [r["output"] for r in rs],
            }
            for (t, n), rs in runs.items()
        },
        "score": _mean(flat, "score"),
        "compression": _mean(flat, "compression"),
    }


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(float(r[key]) for r in rows) / max(len(rows), 1)


def configs(presses: list[str], codecs: list[str]) -> Iterator[Config]:
    """fp32 without a press first (the calibration), then per codec: none, then the presses."""
    yield Config("none", "fp32")
    for codec in codecs:
        for press in ["none", *[p for p in presses if p != "none"]]:
            if (press, codec) != ("none", "fp32"):
                yield Config(press, codec)


def retention(row: dict[str, Any], base: dict[str, Any], kept: list[str]) -> float:
    """Score / fp32 score, summed over the kept cells."""
    cells, ref = row["cells"], base["cells"]
    num = sum(cells[c]["score"] for c in kept)
    den = sum(ref[c]["score"] for c in kept)
    return float(num / den)


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 14's goals, each met / missed / not measured, with the configuration that decides."""
    out: list[dict[str, Any]] = []
    for need_x, need_r in COMPRESSION_GOALS:
        fit = [r for r in rows if float(r["compression"]) >= need_x]
        best = max(fit, key=lambda r: float(r["retention"]), default=None)
        out.append(
            _goal(
                f"{need_x:g}x total compression -> retention >= {need_r:.0%}",
                None if best is None else float(best["retention"]) >= need_r,
                "no configuration reaches it"
                if best is None
                else f"best {best['press']} x {best['codec']}: {float(best['retention']):.1%} "
                f"at {float(best['compression']):.2f}x",
            )
        )
    out.append(_beats_streaming(rows))
    pressed = [r for r in rows if r["press"] != "none" and r.get("press_cost") is not None]
    worst = max(pressed, key=lambda r: float(r["press_cost"]), default=None)
    out.append(
        _goal(
            f"pressing costs <= {PRESS_COST_GOAL:.0%} of the prefill",
            None if worst is None else float(worst["press_cost"]) <= PRESS_COST_GOAL,
            "no press ran"
            if worst is None
            else f"worst {worst['press']} x {worst['codec']}: {float(worst['press_cost']):.1%}",
        )
    )
    return out


def _beats_streaming(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """At every ratio >= 0.5 (per codec), the best other press beats StreamingLLM."""
    checks = []
    for s in rows:
        cfg = Config(str(s["press"]), str(s["codec"]))
        if cfg.press_name != "streaming" or cfg.ratio < 0.5:
            continue
        rivals = [
            r
            for r in rows
            if r["codec"] == s["codec"]
            and Config(str(r["press"]), str(r["codec"])).ratio == cfg.ratio
            and Config(str(r["press"]), str(r["codec"])).press_name not in ("streaming", "none")
        ]
        best = max(rivals, key=lambda r: float(r["retention"]), default=None)
        if best is not None:
            checks.append((cfg, best, float(best["retention"]) > float(s["retention"])))
    lost = [f"{c.press} x {c.codec} vs {b['press']}" for c, b, ok in checks if not ok]
    return _goal(
        "best press beats StreamingLLM at every ratio >= 0.5",
        None if not checks else not lost,
        "streaming and another press not both run at a ratio >= 0.5"
        if not checks
        else ("all " + str(len(checks)) if not lost else "not beaten: " + ", ".join(lost)),
    )


def _goal(name: str, met: bool | None, detail: str) -> dict[str, Any]:
    status = "not measured" if met is None else ("met" if met else "missed")
    return {"goal": name, "status": status, "detail": detail}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_presses = ["none"]
    if importlib.util.find_spec("kvcache.press") is not None:
        default_presses += [f"{p}:{r}" for p in PRESS_NAMES for r in RATIOS]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, 3 samples per cell"
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=list(TASKS),
        choices=list(TASKS),
        metavar="TASK",
        help=f"of {list(TASKS)} (default all)",
    )
    parser.add_argument("--lengths", nargs="+", type=int, default=None, help=f"default {LENGTHS}")
    parser.add_argument(
        "--presses",
        nargs="+",
        default=default_presses,
        help="press specs NAME:RATIO or none (default: none, and with kvcache.press each of "
        f"{PRESS_NAMES} at {RATIOS})",
    )
    parser.add_argument("--codecs", nargs="+", default=CODECS, help=f"default {CODECS}")
    parser.add_argument("--samples", type=int, default=None, help="per task x length (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task generators")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--json", type=Path, default=RESULTS / "long_context.json", help="results file"
    )
    parser.add_argument(
        "--png", type=Path, default=RESULTS / "long_context.png", help="retention plot"
    )
    args = parser.parse_args(argv)
    if any(p != "none" for p in args.presses):
        if importlib.util.find_spec("kvcache.press") is None:
            parser.error("press specs need kvcache.press (issue 14), not in this checkout")
        from kvcache.press import make_press

        for spec in args.presses:  # a bad spec fails now, not after the calibration
            if spec != "none":
                make_press(spec)
    args.lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    args.samples = args.samples or (3 if args.quick else 10)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = Llama.from_gguf(), Tokenizer.from_gguf()
    files = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())
    corpus = Corpus(tokenizer, "".join(p.read_text(errors="replace") for p in files))
    fmt = PromptFormat(lambda c: tokenizer.apply_chat([{"role": "user", "content": c}]))
    cells = [(t, n) for t in args.tasks for n in args.lengths]
    samples = {
        (t, n): [make_sample(t, n, i, args.seed, corpus, fmt) for i in range(args.samples)]
        for t, n in cells
    }
    bench = Bench(model, tokenizer, samples, {})
    rows: list[dict[str, Any]] = []
    kept: list[str] = []
    with torch.inference_mode():
        for config in tqdm(list(configs(args.presses, args.codecs)), desc="configs"):
            if rows and not kept:
                break  # nothing to compare: the baseline scored below KEEP everywhere
            todo = cells if not rows else [c for c in cells if f"{c[0]}@{c[1]}" in kept]
            rows.append(evaluate(bench, config, todo))
            if len(rows) == 1:
                base = rows[0]["cells"]
                kept = [c for c, v in base.items() if v["score"] >= KEEP]
                print(_calibration(base, kept))
    report(args, rows, kept)
    return 0


def report(args: argparse.Namespace, rows: list[dict[str, Any]], kept: list[str]) -> None:
    """Retention and press cost per row, the table, the goals, JSON and PNG."""
    base = rows[0]
    for r in rows:  # every total over the kept cells, the ones all rows ran
        cells = [r["cells"][c] for c in kept]
        r["score_kept"] = sum(c["score"] for c in cells) / max(len(cells), 1)
        r["prefill_s"] = sum(c["prefill_s"] for c in cells)
        r["press_s"] = sum(c["press_s"] for c in cells)
        r["retention"] = retention(r, base, kept) if kept else None
    plain = {r["codec"]: r["prefill_s"] for r in rows if r["press"] == "none"}
    for r in rows:
        pressed = r["press"] != "none" and plain.get(r["codec"])
        r["press_cost"] = (
            (r["prefill_s"] + r["press_s"]) / plain[r["codec"]] - 1 if pressed else None
        )
    summary = [{k: v for k, v in r.items() if k != "cells"} for r in rows]
    columns = ["press", "codec", "compression", "score_kept", "retention", "prefill_s", "press_s"]
    print(table(summary, [*columns, "press_cost"]))
    results = goals(summary) if kept else []
    for g in results:
        print(f"[{g['status']}] {g['goal']}: {g['detail']}")
    payload = {
        "settings": {
            "tasks": args.tasks,
            "lengths": args.lengths,
            "samples": args.samples,
            "seed": args.seed,
            "keep_threshold": KEEP,
        },
        "kept_cells": kept,
        "rows": rows,
        "goals": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    print(f"wrote {args.json}")
    if kept:
        plot(summary, args.png)
        print(f"wrote {args.png}")


def _calibration(base: dict[str, dict[str, Any]], kept: list[str]) -> str:
    lines = [f"fp32 cache, no press (calibration; kept when >= {KEEP:.0%}):"]
    for cell, v in base.items():
        mark = "kept" if cell in kept else "dropped"
        lines.append(f"  {cell:>20}  {float(v['score']):.2f}  {mark}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Retention against total compression: one line per press x codec over its ratios, and
    one line through the codecs without a press."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        cfg = Config(str(r["press"]), str(r["codec"]))
        label = "codecs, no press" if cfg.press == "none" else f"{cfg.press_name} x {cfg.codec}"
        lines.setdefault(label, []).append((float(r["compression"]), 100 * float(r["retention"])))
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in sorted(lines.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, label=label, lw=1)
    for need_x, need_r in COMPRESSION_GOALS:
        ax.scatter([need_x], [100 * need_r], marker="*", s=80, color="black", zorder=5)
    ax.set(
        xscale="log",
        xlabel="total compression (fp16 bytes of the context / bytes held)",
        ylabel="retention (% of the fp32 score on the kept cells)",
        title="SmolLM2-135M, RULER-style tasks: presses x codecs (stars: issue-14 goals)",
    )
    ax.set_xticks([0.5, 1, 2, 4, 8, 16], ["0.5x", "1x", "2x", "4x", "8x", "16x"])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

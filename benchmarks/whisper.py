"""Whisper tiny.en on the cell cache vs no cache vs CTranslate2 float32 (same features, threads).

Questions answered, side by side in one run on this machine:

* decode tokens/s: cached steps (WhisperKVCache) vs uncached (``forward_decoder`` over the
  whole sequence every step) vs ``ctranslate2.models.Whisper.generate`` on the same encoder
  output; once on each input's natural greedy transcript and once forced to N tokens
  (end-of-text suppressed) so the ratio is measured at 100+ tokens;
* encoder time (ours vs ``ctranslate2 ... encode``);
* end-to-end real-time factor (log-mel + encoder + greedy decode, per audio second), ours and
  CTranslate2's (same log-mel features).

Inputs: the espeak-ng fixtures of tests/fixtures/audio and a 30 s clip made of all of them.
Goals (issue 4): cached >= 4x uncached at 100+ tokens; end-to-end within 2x of CTranslate2.

    .venv/bin/python benchmarks/whisper.py [--threads 2] [--repeats 3] [--forced-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "audio"
CLIP_SECONDS = 30.0
PAUSE_S = 0.3  # let the other runtime's OpenMP threads stop spinning before timing


@dataclass
class Row:
    """One input's measurements (times in seconds, rates in tokens/s)."""

    input: str
    audio_s: float
    tokens: int
    mel_s: float
    encoder_s: float
    ct2_encoder_s: float
    cached_tok_s: float
    uncached_tok_s: float
    ct2_tok_s: float
    e2e_s: float
    ct2_e2e_s: float
    rtf: float
    ct2_rtf: float
    same_tokens_as_ct2: bool
    text: str


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall time of ``repeats`` calls (after one warm-up call) and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    time.sleep(PAUSE_S)
    return statistics.median(times), out


def make_clip() -> np.ndarray:
    """All fixtures back to back with equal silences, at most 30 s of 16 kHz audio."""
    from kvcache.audio.io import load_audio

    names = json.loads((FIXTURES / "sentences.json").read_text())
    parts = [load_audio(FIXTURES / n) for n in names]
    total = sum(len(p) for p in parts)
    gap = max(0, int((CLIP_SECONDS * 16000 - total) / len(parts)) - 1)
    pieces = [x for p in parts for x in (p, np.zeros(gap, dtype=np.float32))]
    return np.concatenate(pieces)[: int(CLIP_SECONDS * 16000)]


class Bench:
    """Our model and CTranslate2's, loaded once, with the same threads."""

    def __init__(self, threads: int, repeats: int) -> None:
        import ctranslate2

        from kvcache.transcribe import Transcriber
        from kvcache.weights.ctranslate2 import bundled_whisper_dir

        torch.set_num_threads(threads)
        self.ct2mod = ctranslate2
        self.tr = Transcriber.load()
        self.ct2 = ctranslate2.models.Whisper(
            str(bundled_whisper_dir()), device="cpu", compute_type="float32", intra_threads=threads
        )
        self.repeats = repeats

    def _view(self, x: torch.Tensor) -> Any:
        return self.ct2mod.StorageView.from_array(np.ascontiguousarray(x.numpy()))

    def decode_rates(
        self,
        audio_states: torch.Tensor,
        ct2_states: Any,
        rules: Any,
        max_new: int,
        ct2_suppress: list[int],
    ) -> tuple[float, float, float, list[int], bool]:
        """tok/s cached, uncached, CTranslate2 on one window's encoder output."""
        from kvcache.transcribe import greedy_decode

        model, prompt = self.tr.model, self.tr.prompt(False)
        t_c, toks = median_time(
            lambda: greedy_decode(model, audio_states, prompt, rules, max_new), self.repeats
        )
        assert isinstance(toks, list)
        t_u, toks_u = median_time(
            lambda: greedy_decode(model, audio_states, prompt, rules, max_new, cached=False), 1
        )
        assert toks_u == toks, "cached and uncached greedy decoding disagree"

        def ct2_run() -> list[int]:
            r = self.ct2.generate(
                ct2_states,
                [prompt],
                beam_size=1,
                max_length=2 * max_new,
                suppress_tokens=ct2_suppress,
            )
            return list(r[0].sequences_ids[0])

        t_ct2, ct2_toks = median_time(ct2_run, self.repeats)
        n = max(1, len(toks))
        return n / t_c, n / t_u, len(ct2_toks) / t_ct2, toks, ct2_toks == toks

    def row(self, name: str, audio: np.ndarray) -> Row:
        from kvcache.audio.mel import whisper_features
        from kvcache.transcribe import DecodeOptions

        model = self.tr.model
        mel_s, feats = median_time(lambda: whisper_features(audio), self.repeats)
        assert isinstance(feats, torch.Tensor)

        def encode() -> torch.Tensor:
            with torch.inference_mode():
                return model.forward_encoder(feats[None])

        enc_s, states = median_time(encode, self.repeats)
        assert isinstance(states, torch.Tensor)
        fview = self._view(feats[None])
        ct2_enc_s, ct2_states = median_time(
            lambda: self.ct2.encode(fview, to_cpu=True), self.repeats
        )
        rules = self.tr.rules(False)
        cached, uncached, ct2_rate, toks, same = self.decode_rates(
            states, ct2_states, rules, 224, [-1]
        )

        def ours_e2e() -> str:
            return self.tr.tokenizer.decode(
                self.tr.decode_window(whisper_features(audio), DecodeOptions())
            )

        e2e_s, _ = median_time(ours_e2e, self.repeats)

        def ct2_e2e() -> object:
            return self.ct2.generate(
                self._view(whisper_features(audio)[None]), [self.tr.prompt(False)]
            )

        ct2_e2e_s, _ = median_time(ct2_e2e, self.repeats)
        seconds = len(audio) / 16000
        return Row(
            name, round(seconds, 2), len(toks), mel_s, enc_s, ct2_enc_s, cached, uncached, ct2_rate,
            e2e_s, ct2_e2e_s, e2e_s / seconds, ct2_e2e_s / seconds, same, self.tr.tokenizer.decode(toks).strip(),
        )  # fmt: skip

    def forced(self, audio: np.ndarray, n: int) -> dict[str, float | int | bool]:
        """Decode exactly ``n`` tokens (eot suppressed) of one window: the 100+ token ratio."""
        from kvcache.audio.mel import whisper_features
        from kvcache.transcribe import LogitRules

        feats = whisper_features(audio)
        with torch.inference_mode():
            states = self.tr.model.forward_encoder(feats[None])
        ct2_states = self.ct2.encode(self._view(feats[None]), to_cpu=True)
        sp = self.tr.tokenizer.special
        rules = LogitRules(
            sp,
            self.tr.model.config.n_vocab,
            [*self.tr.suppress, sp.eot],
            self.tr.suppress_begin,
            False,
        )
        cached, uncached, ct2_rate, toks, same = self.decode_rates(
            states, ct2_states, rules, n, [-1, sp.eot]
        )
        assert len(toks) == n, (len(toks), n)
        return {
            "tokens": n,
            "cached_tok_s": cached,
            "uncached_tok_s": uncached,
            "ct2_tok_s": ct2_rate,
            "cached_over_uncached": cached / uncached,
            "cached_over_ct2": cached / ct2_rate,
            "same_tokens_as_ct2": same,
        }


def print_table(rows: list[Row], forced: dict[str, Any]) -> None:
    head = (
        f"{'input':<14}{'audio s':>8}{'tok':>5}{'enc ms':>8}{'ct2 enc':>8}{'cached':>8}"
        f"{'uncached':>9}{'ct2':>7}{'c/u':>6}{'e2e s':>7}{'ct2 e2e':>8}{'RTF':>7}{'ours/ct2':>9}  ct2 tokens"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.input:<14}{r.audio_s:>8.2f}{r.tokens:>5}{1e3 * r.encoder_s:>8.0f}{1e3 * r.ct2_encoder_s:>8.0f}"
            f"{r.cached_tok_s:>8.1f}{r.uncached_tok_s:>9.1f}{r.ct2_tok_s:>7.1f}"
            f"{r.cached_tok_s / r.uncached_tok_s:>6.1f}{r.e2e_s:>7.2f}{r.ct2_e2e_s:>8.2f}{r.rtf:>7.3f}"
            f"{r.e2e_s / r.ct2_e2e_s:>9.2f}  {'same' if r.same_tokens_as_ct2 else 'differ'}"
        )
    f = forced
    print(
        f"\nforced {f['tokens']} tokens on the 30 s clip (eot suppressed): cached {f['cached_tok_s']:.1f} tok/s, "
        f"uncached {f['uncached_tok_s']:.1f} tok/s, CTranslate2 {f['ct2_tok_s']:.1f} tok/s; "
        f"cached/uncached {f['cached_over_uncached']:.1f}x (goal >= 4x), cached/ct2 {f['cached_over_ct2']:.2f}"
    )
    clip = rows[-1]
    print(
        f"30 s clip end to end: ours {clip.e2e_s:.2f} s, CTranslate2 {clip.ct2_e2e_s:.2f} s -> "
        f"{clip.e2e_s / clip.ct2_e2e_s:.2f}x (goal <= 2x)"
    )


def plot(rows: list[Row], forced: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r.input for r in rows] + [f"forced {forced['tokens']}"]
    x = np.arange(len(names))
    series = [
        ("cached", [r.cached_tok_s for r in rows] + [forced["cached_tok_s"]]),
        ("uncached", [r.uncached_tok_s for r in rows] + [forced["uncached_tok_s"]]),
        ("CTranslate2 fp32", [r.ct2_tok_s for r in rows] + [forced["ct2_tok_s"]]),
    ]
    for i, (label, ys) in enumerate(series):
        a.bar(x + (i - 1) * 0.27, ys, 0.27, label=label)
    a.set_xticks(x, names, rotation=30, ha="right")
    a.set_ylabel("decode tokens / s")
    a.set_title("Whisper tiny.en greedy decode")
    a.legend()
    xr = np.arange(len(rows))
    b.bar(xr - 0.2, [r.rtf for r in rows], 0.4, label="ours (kvcache)")
    b.bar(xr + 0.2, [r.ct2_rtf for r in rows], 0.4, label="CTranslate2 fp32")
    b.set_xticks(xr, [r.input for r in rows], rotation=30, ha="right")
    b.set_ylabel("real-time factor (lower is better)")
    b.set_title("end to end: log-mel + encoder + decode")
    b.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(
        description="Whisper tiny.en decode/encode/end-to-end speed: cached vs uncached vs CTranslate2 float32.",
    )
    p.add_argument(
        "--threads", type=int, default=2, help="torch and CTranslate2 threads (default 2)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed repeats per measurement, median kept (default 3)",
    )
    p.add_argument(
        "--forced-tokens", type=int, default=128, help="tokens of the forced decode (default 128)"
    )
    p.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks/results/whisper.json", help="JSON output"
    )
    p.add_argument(
        "--png", type=Path, default=ROOT / "benchmarks/results/whisper.png", help="plot output"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args()

    from kvcache.audio.io import load_audio

    load_before = os.getloadavg()
    bench = Bench(args.threads, args.repeats)
    names = json.loads((FIXTURES / "sentences.json").read_text())
    clip = make_clip()
    rows = [bench.row(Path(n).stem, load_audio(FIXTURES / n)) for n in names]
    rows.append(bench.row("clip_30s", clip))
    forced = bench.forced(clip, args.forced_tokens)
    print_table(rows, forced)
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "torch": torch.__version__,
        "ctranslate2": bench.ct2mod.__version__,
        "repeats": args.repeats,
        "rows": [asdict(r) for r in rows],
        "forced": forced,
        "goals": {
            "cached_over_uncached_at_100plus": forced["cached_over_uncached"],
            "e2e_ours_over_ct2_clip": rows[-1].e2e_s / rows[-1].ct2_e2e_s,
        },
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    if not args.no_plot:
        plot(rows, forced, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

"""Whisper tiny.en on the cell cache vs no cache vs CTranslate2 / faster-whisper (same threads).

Questions answered, side by side in one run on this machine (``--questions`` picks):

* longform: a 3-minute clip (scripts/make_long_clips.py) transcribed end to end, ours vs
  faster-whisper float32 and int8 on the same bundled CTranslate2 model, beam 1, with the
  WER of each against the spoken text (issue 13: ours <= 1.0x faster-whisper's time); each
  run in a fresh process of its own (model loaded and warmed up there, untimed), the
  contenders taking turns in every round: torch slows down in a process where CTranslate2
  has run;
* batch: 8 distinct files of 40-46 s decoded together in one cell cache vs one after
  another, in a process of their own: aggregate audio seconds per second (goal >= 2.2x),
  transcripts equal;
* batched: the 3-minute clip VAD-batched (``transcribe(..., batch_size=8)``: Silero VAD
  chunks of <= 28 s, 8 decoded together) vs our sequential long-form and faster-whisper's
  ``BatchedInferencePipeline`` (float32, batch 8), each run in a process of its own, taking
  turns: time ratios (goals: >= 2x our sequential, >= 1.0x faster-whisper's batched), WER
  (goal: within +0.02 of sequential) and the share of VAD speech regions each output covers;

* decode tokens/s: cached steps (WhisperKVCache) vs uncached (``forward_decoder`` over the
  whole sequence every step) vs ``ctranslate2.models.Whisper.generate`` on the same encoder
  output; once on each input's natural greedy transcript and once forced to N tokens
  (end-of-text suppressed) so the ratio is measured at 100+ tokens;
* encoder time (ours vs ``ctranslate2 ... encode``);
* end-to-end real-time factor (log-mel + encoder + greedy decode, per audio second), ours and
  CTranslate2's (same log-mel features).

Inputs (decode): the espeak-ng fixtures of tests/fixtures/audio and a 30 s clip made of all
of them. Goals (issue 4): cached >= 4x uncached at 100+ tokens; end-to-end within 2x of
CTranslate2.

    .venv/bin/python benchmarks/whisper.py [--threads 2] [--repeats 3] [--forced-tokens 128]
        [--questions decode longform batch batched] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness import paired_ratio, plot, spawn_worker, take_turns, worker_result, write_json

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "audio"
CLIP_SECONDS = 30.0
BATCH = 8  # chunks (batched question) decoded together
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


def whisper_reference() -> Any:
    """tests/models/whisper_reference.py (the uncached decoder), loaded from its file."""
    path = ROOT / "tests" / "models" / "whisper_reference.py"
    spec = importlib.util.spec_from_file_location("whisper_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

        from kvcache.transcription import Transcriber
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
        from kvcache.models.whisper_decode import WhisperKVCache
        from kvcache.transcription.search import SampleSearch, SearchSpec, run_search

        model, prompt = self.tr.model, self.tr.prompt(False)

        def cached() -> list[int]:
            search = SampleSearch(SearchSpec(prompt, rules, max_new), [0])
            return run_search(model, search, WhisperKVCache(model, audio_states)).tokens

        t_c, toks = median_time(cached, self.repeats)
        assert isinstance(toks, list)
        greedy_uncached = whisper_reference().greedy_uncached
        t_u, toks_u = median_time(
            lambda: greedy_uncached(model, audio_states, prompt, rules, max_new), 1
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
            return self.tr.tokenizer.decode(self.tr.decode_window(whisper_features(audio)))

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
        from kvcache.transcription.rules import LogitRules

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


def make_long_clips(out: Path) -> dict[str, tuple[np.ndarray, str]]:
    """The clips of scripts/make_long_clips.py: name -> (16 kHz samples, spoken text)."""
    from kvcache.audio.io import load_audio

    script = ROOT / "scripts" / "make_long_clips.py"
    subprocess.run([sys.executable, str(script), str(out)], check=True, capture_output=True)
    clips = {}
    for meta_file in sorted(out.glob("*.json")):
        meta = json.loads(meta_file.read_text())
        text = " ".join(s["text"] for s in meta["sentences"])
        clips[meta_file.stem] = (load_audio(meta_file.with_suffix(".wav")), text)
    return clips


def wer(reference: str, hypothesis: str) -> float:
    import jiwer
    from whisper_normalizer.english import EnglishTextNormalizer

    norm = EnglishTextNormalizer()
    return float(jiwer.wer(norm(reference), norm(hypothesis)))


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, Any]:
    """Each of ``fns`` once per round (after one warm-up round), ``repeats`` rounds, taking
    turns (``harness.take_turns``): the median time of each, the last result of each, and
    each round's times."""

    def clocked(fn: Callable[[], object]) -> Callable[[], tuple[float, object]]:
        def run() -> tuple[float, object]:
            t = time.perf_counter()
            out = fn()
            return time.perf_counter() - t, out

        return run

    runs = take_turns({name: clocked(fn) for name, fn in fns.items()}, repeats, warm=1)
    time.sleep(PAUSE_S)
    times = {name: [t for t, _ in r] for name, r in runs.items()}
    return {
        "median": {name: statistics.median(ts) for name, ts in times.items()},
        "result": {name: r[-1][1] for name, r in runs.items()},
        "rounds": times,
    }


def round_ratio(run: dict[str, Any], num: str, den: str) -> float:
    """The median over rounds of ``num``'s time / ``den``'s time in the same round."""
    return paired_ratio(run["rounds"][num], run["rounds"][den])


# ---- long-form and batch: each contender in a process of its own -------------------------
# A process that has run CTranslate2 slows torch down (ours took 5.3-5.4 s for the 3-min clip
# alone and 7.2-7.6 s in the same process after faster-whisper had run: their OpenMP thread
# pools meet), so the two are never timed in one process, as users never run them so.
CONTENDERS = ("ours", "fw_float32", "fw_int8")
BATCHED = ("ours", "ours_batched", "fw_batched")  # the batched question's contenders
Spans = list[tuple[float, float]]


def transcriber(name: str, threads: int) -> Callable[[np.ndarray], tuple[str, Spans]]:
    """``name``'s transcribe function (loaded, not yet warmed up): beam 1, ``threads``; it
    returns the text and the segments' (start, end)."""
    torch.set_num_threads(threads)
    if name.startswith("ours"):
        from kvcache.transcription import TranscribeOptions, Transcript
        from kvcache.transcription.transcriber import bundled

        tr, opts = bundled(), TranscribeOptions()

        def ours(audio: np.ndarray) -> tuple[str, Spans]:
            t: Transcript = (
                tr.transcribe_chunks(audio, opts, BATCH)
                if name == "ours_batched"
                else tr.transcribe(audio, opts)
            )
            return t.text, [(s.start, s.end) for s in t.segments]

        return ours
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    from kvcache.weights.ctranslate2 import bundled_whisper_dir

    compute = "float32" if name == "fw_batched" else name.removeprefix("fw_")
    fw = WhisperModel(
        str(bundled_whisper_dir()), device="cpu", compute_type=compute, cpu_threads=threads
    )
    pipe = BatchedInferencePipeline(fw) if name == "fw_batched" else None

    def theirs(audio: np.ndarray) -> tuple[str, Spans]:
        if pipe is not None:
            segments = list(pipe.transcribe(audio, beam_size=1, batch_size=BATCH)[0])
        else:
            segments = list(fw.transcribe(audio, beam_size=1)[0])
        return " ".join(s.text for s in segments), [(s.start, s.end) for s in segments]

    return theirs


def worker(args: argparse.Namespace) -> None:
    """``--worker NAME --input FILE``: load, warm up on the first 20 s, time one call, print
    JSON. NAME is a contender (one clip: its time and text) or "batch" (files together vs
    one after another, taking turns for ``--repeats`` rounds)."""
    data = np.load(args.input)
    if args.worker == "batch":
        files = [data[k] for k in sorted(data.files, key=lambda k: int(k[1:]))]  # f0, f1, ...
        worker_result(batch(files, args.threads, args.repeats))
        return
    audio = data["audio"]
    fn = transcriber(args.worker, args.threads)
    fn(audio[: 20 * 16000])
    t = time.perf_counter()
    text, spans = fn(audio)
    worker_result({"seconds": time.perf_counter() - t, "text": text, "spans": spans})


def in_process(name: str, arrays: dict[str, np.ndarray], threads: int, repeats: int) -> Any:
    """Run ``--worker name`` on ``arrays`` (saved to a temporary .npz); its JSON answer."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.npz"
        np.savez(path, **arrays)  # type: ignore[arg-type]
        args = ["--worker", name, "--input", str(path)]
        args += ["--threads", str(threads), "--repeats", str(repeats)]
        return spawn_worker(__file__, args, threads, name)


def longform(audio: np.ndarray, text: str, threads: int, repeats: int) -> dict[str, Any]:
    """One long clip end to end: ours vs faster-whisper float32 and int8, beam 1, each run
    in a fresh process (loaded and warmed up there, untimed), taking turns in every round."""
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    texts: dict[str, str] = {}
    for _ in range(repeats):
        for name in CONTENDERS:
            got = in_process(name, {"audio": audio}, threads, 1)
            times[name].append(got["seconds"])
            texts[name] = got["text"]
    row: dict[str, Any] = {"audio_s": len(audio) / 16000, "separate_processes": True}
    for name in CONTENDERS:
        row[f"{name}_s"] = statistics.median(times[name])
        row[f"{name}_wer"] = wer(text, texts[name])
    row["rounds_s"] = times
    row["ours_over_fw_float32"] = statistics.median(
        a / b for a, b in zip(times["ours"], times["fw_float32"], strict=True)
    )
    return row


def covered(regions: list[tuple[int, int]], spans: Spans) -> float:
    """The share of VAD speech regions (samples) that some segment (seconds) overlaps."""
    hit = [any(s < b / 16000 and e > a / 16000 for s, e in spans) for a, b in regions]
    return sum(hit) / max(1, len(hit))


def batched(audio: np.ndarray, text: str, threads: int, repeats: int) -> dict[str, Any]:
    """One long clip: ours VAD-batched vs ours sequential vs faster-whisper's batched
    pipeline, each run in a fresh process, taking turns in every round."""
    from kvcache.audio.vad import detect_speech
    from kvcache.transcription.transcriber import BATCHED_VAD

    regions = detect_speech(audio, BATCHED_VAD)
    runs = take_turns(
        {
            name: lambda name=name: in_process(name, {"audio": audio}, threads, 1)
            for name in BATCHED
        },
        repeats,
    )
    row: dict[str, Any] = {
        "audio_s": len(audio) / 16000,
        "batch_size": BATCH,
        "vad_regions": len(regions),
    }
    for name in BATCHED:
        row[f"{name}_s"] = statistics.median(r["seconds"] for r in runs[name])
        row[f"{name}_wer"] = wer(text, runs[name][-1]["text"])
        row[f"{name}_regions_covered"] = covered(regions, runs[name][-1]["spans"])
    times = {name: [r["seconds"] for r in runs[name]] for name in BATCHED}
    row["rounds_s"] = times
    row["batched_speedup_over_sequential"] = paired_ratio(times["ours"], times["ours_batched"])
    row["batched_speedup_over_fw_batched"] = paired_ratio(
        times["fw_batched"], times["ours_batched"]
    )
    row["wer_batched_minus_sequential"] = row["ours_batched_wer"] - row["ours_wer"]
    return row


def batch(files: list[np.ndarray], threads: int, repeats: int) -> dict[str, Any]:
    """Files decoded together in one cell cache vs one after another, taking turns (run
    by ``--worker batch``, in a process where CTranslate2 never ran)."""
    from kvcache.transcription import TranscribeOptions
    from kvcache.transcription.transcriber import bundled

    torch.set_num_threads(threads)
    tr, opts = bundled(), TranscribeOptions()
    audio_s = sum(len(f) for f in files) / 16000
    r = interleaved(
        {
            "one_after_another": lambda: [tr.transcribe(f, opts).text for f in files],
            "together": lambda: [t.text for t in tr.transcribe_many(files, opts)],
        },
        repeats,
    )
    t_seq, t_batch = r["median"]["one_after_another"], r["median"]["together"]
    return {
        "files": len(files),
        "seconds_each": [round(len(f) / 16000, 2) for f in files],
        "audio_s": audio_s,
        "one_after_another_s": t_seq,
        "together_s": t_batch,
        "rounds_s": r["rounds"],
        "one_after_another_audio_s_per_s": audio_s / t_seq,
        "together_audio_s_per_s": audio_s / t_batch,
        "speedup": round_ratio(r, "one_after_another", "together"),
        "same_transcripts": r["result"]["one_after_another"] == r["result"]["together"],
    }


def eight_files(clips: dict[str, tuple[np.ndarray, str]], seconds: float) -> list[np.ndarray]:
    """8 distinct files of up to ``seconds``: the long clips cut into pieces (no overlap)."""
    pieces = []
    for name in ("long180", "long90", "long45", "slt40"):
        audio = clips[name][0]
        n = int(seconds * 16000)
        pieces += [audio[i : i + n] for i in range(0, len(audio) - 30 * 16000, n)]
    return pieces[:8]


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


def draw(rows: list[Row], forced: dict[str, Any], fig: Any, axes: Any) -> None:
    """The decode-speed bars and the real-time factors, side by side."""
    a, b = axes
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


def main() -> None:
    p = argparse.ArgumentParser(
        description="Whisper tiny.en: decode speed (cached/uncached/CTranslate2), long-form vs "
        "faster-whisper, several files together vs one after another.",
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
        "--questions",
        nargs="+",
        choices=["decode", "longform", "batch", "batched"],
        default=["decode", "longform", "batch", "batched"],
        help="what to measure (default: all)",
    )
    p.add_argument("--quick", action="store_true", help="1 repeat, 45 s clip, 30 s files")
    p.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks/results/whisper.json", help="JSON output"
    )
    p.add_argument(
        "--png", type=Path, default=ROOT / "benchmarks/results/whisper.png", help="plot output"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--worker", choices=[*CONTENDERS, *BATCHED[1:], "batch"], help=argparse.SUPPRESS)
    p.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.repeats = 1

    from kvcache.audio.io import load_audio

    result: dict[str, Any] = {"threads": args.threads, "repeats": args.repeats}
    if "decode" in args.questions:
        bench = Bench(args.threads, args.repeats)
        names = json.loads((FIXTURES / "sentences.json").read_text())
        clip = make_clip()
        rows = [bench.row(Path(n).stem, load_audio(FIXTURES / n)) for n in names]
        rows.append(bench.row("clip_30s", clip))
        forced = bench.forced(clip, args.forced_tokens)
        print_table(rows, forced)
        result["ctranslate2"] = bench.ct2mod.__version__
        result["rows"] = [asdict(r) for r in rows]
        result["forced"] = forced
        result["goals"] = {
            "cached_over_uncached_at_100plus": forced["cached_over_uncached"],
            "e2e_ours_over_ct2_clip": rows[-1].e2e_s / rows[-1].ct2_e2e_s,
        }
        if not args.no_plot:
            plot(args.png, lambda fig, ax: draw(rows, forced, fig, ax), figsize=(13, 4.5), ncols=2)
    if {"longform", "batch", "batched"} & set(args.questions):
        with tempfile.TemporaryDirectory() as tmp:
            clips = make_long_clips(Path(tmp))
        name = "long45" if args.quick else "long180"  # the long clip of both questions
        if "longform" in args.questions:
            lf = longform(*clips[name], args.threads, args.repeats)
            lf["clip"] = name
            result["longform"] = lf
            print(
                f"\nlong-form {name} ({lf['audio_s']:.0f} s): ours {lf['ours_s']:.2f} s "
                f"(WER {lf['ours_wer']:.3f}), faster-whisper float32 {lf['fw_float32_s']:.2f} s "
                f"(WER {lf['fw_float32_wer']:.3f}), int8 {lf['fw_int8_s']:.2f} s "
                f"(WER {lf['fw_int8_wer']:.3f}); ours / fw float32 = "
                f"{lf['ours_over_fw_float32']:.2f}x (goal <= 1.0x)"
            )
        if "batch" in args.questions:
            files = eight_files(clips, 30.0 if args.quick else 46.0)
            arrays = {f"f{i}": f for i, f in enumerate(files)}
            b = in_process("batch", arrays, args.threads, args.repeats)
            result["batch"] = b
            print(
                f"\n{b['files']} files ({b['audio_s']:.0f} s of audio): together "
                f"{b['together_audio_s_per_s']:.1f} audio s/s, one after another "
                f"{b['one_after_another_audio_s_per_s']:.1f} audio s/s -> {b['speedup']:.2f}x "
                f"(goal >= 2.2x); same transcripts: {b['same_transcripts']}"
            )
        if "batched" in args.questions:
            result["batched"] = bt = {
                "clip": name,
                **batched(*clips[name], args.threads, args.repeats),
            }
            print(
                f"\nVAD-batched {name} ({bt['audio_s']:.0f} s, {bt['vad_regions']} VAD regions, "
                f"batch {BATCH}): ours batched {bt['ours_batched_s']:.2f} s (WER "
                f"{bt['ours_batched_wer']:.3f}, regions covered {bt['ours_batched_regions_covered']:.2f}), "
                f"ours sequential {bt['ours_s']:.2f} s (WER {bt['ours_wer']:.3f}), faster-whisper "
                f"batched {bt['fw_batched_s']:.2f} s (WER {bt['fw_batched_wer']:.3f}, regions "
                f"covered {bt['fw_batched_regions_covered']:.2f}); speedup over sequential "
                f"{bt['batched_speedup_over_sequential']:.2f}x (goal >= 2x), over faster-whisper "
                f"batched {bt['batched_speedup_over_fw_batched']:.2f}x (goal >= 1.0x)"
            )
    write_json(args.json, result)


if __name__ == "__main__":
    main()

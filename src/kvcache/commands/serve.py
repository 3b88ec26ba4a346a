"""`kvcache serve`: an OpenAI-compatible HTTP server over the continuous-batching engine."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.commands.options import (
    add_kv_codec,
    add_press,
    add_weights,
    check_kv_codec,
    check_press,
    weights_kind,
)

if TYPE_CHECKING:
    from kvcache.engine.events import KVEvents
    from kvcache.engine.params import EngineConfig
    from kvcache.engine.scheduler import Engine
    from kvcache.engine.store import BlockStore
    from kvcache.models.llama import Llama, WeightKind
    from kvcache.text.tokenizer import Tokenizer

EPILOG = """\
endpoints:
  POST /v1/completions, POST /v1/chat/completions   (OpenAI shapes; "stream": true = SSE)
  GET /v1/models, GET /health, GET /metrics          (Prometheus text; vLLM's load gauges too)
  GET /server_info, /model_info, /get_load, /health_generate, /version
                                                      (what sglang-router / vllm-router probe)
  POST /reset_prefix_cache (or /flush_cache)          empty the prefix cache when idle

KV events (--kv-events): vLLM's schema; see kvcache.engine.events for the wire format.

examples:
  kvcache serve                                       SmolLM2 on http://127.0.0.1:8000
  kvcache serve --port 8001 --prefix-store redis://127.0.0.1:6379/0
                                                      a replica sharing prefix blocks via Redis
  kvcache serve --max-sequences 16 --pool-sequences 8 --spill disk:/tmp/kv-spill
                                                      16 requests over cells for 8: preempted
                                                      requests' K/V wait on disk, not recomputed
  kvcache serve --kv-events tcp://127.0.0.1:5557 --kv-events-replay tcp://127.0.0.1:5558
                                                      KV events for a KV-aware router
  curl -s 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}]}'

Prefix blocks are shared only between servers whose model identity matches: a digest of the
model file (name, size, first MiB) and the dtype.
"""

IDENTITY_BYTES = 1 << 20  # the model file's head that goes into its identity


def register(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvcache serve`."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "--model",
        default=None,
        metavar="FILE",
        help="a GGUF file (architecture llama or gemma3) or a bundled model: smollm2 (default), "
        "gemma3",
    )
    parser.add_argument("--name", default=None, help="served model name (default: file stem)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (8000)")
    parser.add_argument(
        "--max-sequences", type=int, default=8, metavar="N", help="requests running at once (8)"
    )
    parser.add_argument(
        "--capacity", type=int, default=2048, metavar="T", help="context per request (2048)"
    )
    parser.add_argument(
        "--max-batch", type=int, default=256, metavar="B", help="tokens per forward (256)"
    )
    parser.add_argument(
        "--prefix-store",
        default="memory",
        metavar="SPEC",
        help="where prefix blocks outlive the pool: memory | disk:PATH | redis://HOST:PORT/DB | "
        "none (reuse only cells still in the pool; evicted prefixes are recomputed) "
        "(default memory)",
    )
    parser.add_argument(
        "--no-prefix-cache", action="store_true", help="compute every prompt in full"
    )
    parser.add_argument(
        "--pool-sequences",
        type=int,
        default=None,
        metavar="P",
        help="cells for P requests' context (default --max-sequences); fewer oversubscribe "
        "the pool: requests are preempted when it is full",
    )
    parser.add_argument(
        "--spill",
        default="memory",
        metavar="SPEC",
        help="where a preempted request's K/V waits: memory | disk:PATH | off (recompute it "
        "when it resumes) (default memory)",
    )
    add_weights(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="publish KV events (vLLM's schema: BlockStored / BlockRemoved / "
        "AllBlocksCleared, msgpack over ZMQ PUB) on this bound endpoint, e.g. "
        "tcp://127.0.0.1:5557",
    )
    parser.add_argument(
        "--kv-events-replay",
        default=None,
        metavar="ENDPOINT",
        help="answer replay requests for recent event batches here (vLLM's replay socket)",
    )
    parser.add_argument(
        "--kv-events-topic", default="", metavar="TOPIC", help="ZMQ topic of the events ('')"
    )
    add_kv_codec(parser)
    add_press(parser)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="server log level (info)",
    )


def model_identity(path: Path, dtype: str) -> str:
    """Names the K/V a model computes: same file (name, size, first MiB) and same weight
    kind or dtype (``native``, ``fp32``, ``bf16``).

    Hashing the head, not the whole file, keeps start-up fast; with the size and name it
    tells apart every model and quantization one would serve side by side.
    """
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(IDENTITY_BYTES))
    digest.update(f"|{path.stat().st_size}|{path.name}".encode())
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)  # store keys use ':' as separator
    return f"{stem}-{digest.hexdigest()[:16]}-{dtype}"


def run(args: argparse.Namespace) -> int:
    """Check the options, load the model, serve until interrupted."""
    import torch

    from kvcache.errors import KVCacheError
    from kvcache.models.llama import Llama

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        config = _engine_config(args)  # bad options fail before the weights load
        store = None if args.no_prefix_cache else _open_store(args.prefix_store)
        path = _model_path(args.model)
        weights = weights_kind(args)
        model, tokenizer = _load(path, weights)
        _check_context(config, model)
        if not isinstance(model, Llama) and args.prefix_store == "memory":
            store = None  # a hybrid model reuses prefixes from checkpoints, not stored blocks
    except KVCacheError as exc:
        print(f"kvcache serve: error: {exc}", file=sys.stderr)
        return 2
    from kvcache.engine.scheduler import Engine

    identity = model_identity(path, weights)
    try:
        engine = Engine(model, tokenizer, config, model_id=identity, store=store)
    except KVCacheError as exc:
        print(f"kvcache serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        events = _publish_events(engine, args)
    except KVCacheError as exc:
        engine.close()
        print(f"kvcache serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        _serve(engine, tokenizer, args.name or path.stem, args, path)
    finally:
        events.close()
    return 0


def _publish_events(engine: Engine, args: argparse.Namespace) -> KVEvents:
    """The KV-events publisher of ``--kv-events`` (a null one without), watching the engine."""
    from kvcache.engine.events import NoEvents, ZmqEventPublisher

    if args.kv_events is None:
        return NoEvents()
    publisher = ZmqEventPublisher(
        args.kv_events,
        replay_endpoint=args.kv_events_replay,
        topic=args.kv_events_topic,
        block_size=engine.config.block_size,
    )
    engine.reuse.watch(publisher)
    return publisher


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    from kvcache.engine.params import EngineConfig
    from kvcache.errors import InvalidArgumentError

    if not 0 <= args.port < 65536:
        raise InvalidArgumentError("--port", args.port, "a port number in [0, 65535]")
    check_kv_codec(args.kv_codec)  # a bad spec fails before the weights load
    check_press(args.press, args.press_cells, args.press_every)
    _check_events(args)
    return EngineConfig(
        capacity=args.capacity,
        max_sequences=args.max_sequences,
        max_batch=args.max_batch,
        prefix_cache=not args.no_prefix_cache,
        codec=args.kv_codec,
        pool_sequences=args.pool_sequences,
        preemption="recompute" if args.spill == "off" else "spill",
        spill="memory" if args.spill == "off" else args.spill,
        press=args.press,
        press_cells=args.press_cells,
        press_every=args.press_every,
    )


def _check_events(args: argparse.Namespace) -> None:
    from kvcache.engine.events import check_endpoint
    from kvcache.errors import InvalidArgumentError

    if args.kv_events is not None:
        check_endpoint("--kv-events", args.kv_events)
        if args.no_prefix_cache:
            raise InvalidArgumentError(
                "--kv-events", args.kv_events, "used with the prefix cache (no --no-prefix-cache)"
            )
    if args.kv_events_replay is not None:
        check_endpoint("--kv-events-replay", args.kv_events_replay)
        if args.kv_events is None:
            raise InvalidArgumentError(
                "--kv-events-replay", args.kv_events_replay, "used with --kv-events"
            )


def _open_store(spec: str) -> BlockStore | None:
    """The block store, reachable now (a Redis that does not answer fails at start-up);
    None for ``none``: prefixes are reused from the pool's idle holders only."""
    from kvcache.engine.store import open_store
    from kvcache.errors import InvalidArgumentError, KVCacheError

    if spec == "none":
        return None
    try:
        return open_store(spec)
    except KVCacheError:
        raise
    except Exception as e:  # redis / filesystem errors: say which store and why
        raise InvalidArgumentError("--prefix-store", spec, f"a usable store ({e})") from e


def _model_path(model: str | None) -> Path:
    """A GGUF file or a bundled model's name (smollm2, the default, gemma3) -> the file."""
    from kvcache.errors import InvalidArgumentError
    from kvcache.weights.bundled import BUNDLED, resolve_model

    try:
        return resolve_model(model)
    except InvalidArgumentError:
        raise InvalidArgumentError(
            "--model", str(model), f"an existing GGUF file or one of {sorted(BUNDLED)}"
        ) from None


def _load(path: Path, weights: WeightKind) -> tuple[Llama, Tokenizer]:
    """Tokenizer then weights (of kind ``weights``) from one read of the GGUF; the model
    its architecture names (llama, gemma3: a typed error for another)."""
    from kvcache.generate import load_model

    model, tokenizer = load_model(path, weights=weights)
    return model, tokenizer


def _check_context(config: EngineConfig, model: Llama) -> None:
    from kvcache.errors import InvalidArgumentError

    limit = model.config.context_length
    if config.capacity > limit:
        raise InvalidArgumentError("--capacity", config.capacity, f"at most {limit} (the model's)")


def _tokenizer_file(tokenizer: Tokenizer, identity: str) -> str | None:
    """The tokenizer as a ``tokenizer.json`` (what sglang-router loads for a worker's model:
    it cannot read a GGUF), written once under the cache folder; None if it cannot be."""
    save = getattr(getattr(tokenizer, "backend", None), "save", None)  # a tokenizers pipeline
    if save is None:
        return None
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcache"
    path = folder / "tokenizers" / identity / "tokenizer.json"
    try:
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            save(str(tmp))
            os.replace(tmp, path)
    except OSError:
        return None
    return str(path)


def _serve(
    engine: Engine, tokenizer: Tokenizer, name: str, args: argparse.Namespace, path: Path
) -> None:
    """Run uvicorn over the engine loop; stop the engine however the server ends."""
    import uvicorn

    from kvcache.engine.loop import EngineLoop
    from kvcache.engine.server import create_app

    loop = EngineLoop(engine)
    events: dict[str, object] = {"enable_kv_cache_events": args.kv_events is not None}
    if args.kv_events is not None:
        events |= {
            "publisher": "zmq",
            "endpoint": args.kv_events,
            "replay_endpoint": args.kv_events_replay,
            "topic": args.kv_events_topic,
        }
    tokenizer_file = _tokenizer_file(tokenizer, model_identity(path, weights_kind(args)))
    info = {
        # SGLang's model_path is a folder a router can load a tokenizer from: the
        # tokenizer's own (the weights are a GGUF file, under weights_path)
        "model_path": str(Path(tokenizer_file).parent) if tokenizer_file else str(path),
        "tokenizer_path": tokenizer_file,
        "weights_path": str(path),
        "kv_events_config": events,
    }
    try:
        app = create_app(loop, tokenizer, model_name=name, info=info)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        loop.close()
        engine.close()

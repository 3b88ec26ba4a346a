"""The OpenAI-compatible HTTP server: FastAPI routes over one :class:`EngineLoop`.

Threads and the bridge between them::

    event loop (uvicorn)                       engine thread (EngineLoop)
    handler: submit(ids, params, listener) --> inbox -> step() -> Request.events.put(e)
             await ready <-- call_soon_threadsafe(ready.set) <-- listener(e)
             drain Request.events, send text / SSE chunks

The listener only wakes the handler; events are read from the request's own thread-safe
queue, so none is lost even if one is emitted before the listener is attached. A client
that goes away (stream or not) has its request cancelled, which frees its cells at the
engine's next step. An engine failure ends the request with an ``error`` event -> HTTP 500
(or an error chunk once a stream has started); a dead engine thread is noticed within
``LIVENESS_S`` -> 500, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvcache import __version__
from kvcache.engine import metrics
from kvcache.engine.loop import EngineLoop
from kvcache.engine.params import RequestParams
from kvcache.engine.protocol import (
    FINISH_REASONS,
    APIError,
    BadRequestError,
    ChatCompletionRequest,
    ChatReply,
    CompletionReply,
    CompletionRequest,
    EngineError,
    EngineUnavailableError,
    NotFoundError,
    Reply,
    SamplingRequest,
    model_list,
    now,
    usage,
)
from kvcache.engine.request import Event
from kvcache.engine.request import Request as EngineRequest
from kvcache.errors import InvalidArgumentError, KVCacheError
from kvcache.models.sampling import SamplingParams
from kvcache.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ENGINE_CALL_S = 30.0  # how long a call run on the engine thread (a reset) may take
LIVENESS_S = 1.0  # how often a waiting handler checks that the engine thread still runs
SAMPLE_S = 1.0  # how often the tokens/s meter samples the engine counters
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    """What the handlers share: the engine loop, the tokenizer, the served name, meters."""

    loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    info: Mapping[str, Any] = field(default_factory=dict)  # extra /server_info fields
    created: int = field(default_factory=now)
    rates: metrics.RateMeter = field(default_factory=metrics.RateMeter)
    prometheus: metrics.ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.prometheus = metrics.ServerMetrics(
            lambda: self.loop.snapshot, self.rates, lambda: self.loop.alive, self.model_name
        )

    @property
    def capacity(self) -> int:
        return self.loop.engine.config.capacity


# ---- the bridge --------------------------------------------------------------------------
class Submission:
    """One engine request as seen from the event loop."""

    def __init__(
        self, state: ServerState, ids: list[int], params: RequestParams, prompt_param: str
    ) -> None:
        self._state = state
        self._aio = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self.prompt_tokens = len(ids)
        if not state.loop.alive:
            raise EngineUnavailableError("the engine is not running")
        try:
            self.request: EngineRequest = state.loop.submit(ids, params, self._listener)
        except InvalidArgumentError as e:
            param = prompt_param if e.name == "prompt" else e.name
            raise BadRequestError(str(e), param=param) from e

    def _listener(self, event: Event) -> None:
        """Engine thread: count how the request ended, wake the handler."""
        if event.finished:
            reason = event.finish_reason or "unknown"
            self._state.prometheus.finish("error" if reason.startswith("error") else reason)
        with contextlib.suppress(RuntimeError):  # event loop closed: the server stopped
            self._aio.call_soon_threadsafe(self._ready.set)

    async def events(self) -> AsyncIterator[Event]:
        """The request's events up to its finished one; cancels the request if left early."""
        finished = False
        try:
            while not finished:
                self._ready.clear()
                for event in _drain(self.request.events):
                    finished = event.finished  # before the yield: the consumer may stop there
                    yield event
                    if finished:
                        break
                if not finished:
                    await self._wait()
        finally:
            if not finished:
                self.cancel()

    async def _wait(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._ready.wait(), LIVENESS_S)
                return
            except TimeoutError:
                if not self._state.loop.alive:
                    raise EngineError("the engine stopped while serving this request") from None

    def cancel(self) -> None:
        """Stop the request and free its cells (idempotent; a finished request is left)."""
        if not self.request.done:
            self.request.cancel()
            self._state.loop.wake()

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage counts, with the prompt tokens reused from the prefix cache."""
        cached = self.request.cached_tokens or 0
        return usage(self.prompt_tokens, len(self.request.generated), cached)

    def report(self) -> dict[str, Any]:
        """kvcache's counts beside OpenAI's usage (the ``kvcache`` field of the response or
        the usage chunk): how often the request was preempted for room, and how long it
        waited in the queue before it first started (its time to first token less this is
        what computing, loading or restoring its context took)."""
        r = self.request
        return {"preemptions": r.preemptions, "queued_s": round(r.queued_seconds, 6)}


def _drain(events: queue.SimpleQueue[Event]) -> list[Event]:
    out = []
    while True:
        try:
            out.append(events.get_nowait())
        except queue.Empty:
            return out


def _finish_reason(event: Event) -> str:
    """OpenAI's finish_reason of an engine end, or the error that ended it."""
    reason = event.finish_reason or ""
    if reason in FINISH_REASONS:
        return FINISH_REASONS[reason]
    if reason.startswith("error"):
        raise EngineError(f"the engine failed: {reason.removeprefix('error: ')}")
    raise EngineError(f"the request ended unexpectedly ({reason or 'no reason'})")


# ---- requests -> engine --------------------------------------------------------------
def _check_model(state: ServerState, body: SamplingRequest) -> None:
    if body.model != state.model_name:
        raise BadRequestError(
            f"The model {body.model!r} does not exist; this server runs {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _request_params(
    state: ServerState,
    body: SamplingRequest,
    prompt_tokens: int,
    prompt_param: str,
    default_max: int | None,
) -> RequestParams:
    """Engine parameters; a prompt + max_tokens that cannot fit the context is a 400."""
    room = state.capacity - prompt_tokens
    asked = body.requested_max_tokens()
    max_tokens = asked if asked is not None else (default_max or room)
    if room < 1 or max_tokens > room:
        param = prompt_param if asked is None or room < 1 else "max_tokens"
        raise BadRequestError(
            f"This model's maximum context length is {state.capacity} tokens; the request "
            f"has {prompt_tokens} prompt tokens and asks for {max_tokens} completion tokens",
            param=param,
            code="context_length_exceeded",
        )
    try:
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        return RequestParams(
            max_tokens=max_tokens,
            sampling=sampling,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
            cache_salt=body.cache_salt,
        )
    except InvalidArgumentError as e:
        raise BadRequestError(str(e), param=e.name) from e


def _completion_ids(state: ServerState, body: CompletionRequest) -> list[int]:
    if isinstance(body.prompt, str):
        return state.tokenizer.encode(body.prompt)
    return list(body.prompt)


def _chat_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    try:
        text = state.tokenizer.apply_chat([m.template_message() for m in body.messages])
    except KVCacheError as e:
        raise BadRequestError(str(e), param="messages") from e
    return state.tokenizer.encode(text)


# ---- responses -----------------------------------------------------------------------
def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def _stream(sub: Submission, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: text deltas, the finish chunk, [usage], ``[DONE]``."""
    for chunk in reply.opening():
        yield _sse(chunk)
    try:
        async for event in sub.events():
            if event.text:
                yield _sse(reply.delta(event.text))
            if event.finished:
                yield _sse(reply.closing(_finish_reason(event)))
    except APIError as e:  # headers are sent: the error travels as a chunk
        log.error("stream %s failed: %s", reply.id, e)
        yield _sse(e.body())
        return
    if include_usage:
        yield _sse({**reply.usage_chunk(sub.usage()), "kvcache": sub.report()})
    yield _sse("[DONE]")


async def _collect(sub: Submission) -> tuple[str, Event]:
    parts: list[str] = []
    async for event in sub.events():
        parts.append(event.text)
        if event.finished:
            return "".join(parts), event
    raise EngineError("the request's events ended without a finish")


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_gone(sub: Submission, request: Request) -> tuple[str, Event] | None:
    """The whole text, or None if the client went away first (the request is cancelled)."""
    consume = asyncio.ensure_future(_collect(sub))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({consume, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not consume.done():
            consume.cancel()
            sub.cancel()
    return consume.result() if consume.done() and not consume.cancelled() else None


async def _respond(
    state: ServerState,
    request: Request,
    body: SamplingRequest,
    ids: list[int],
    reply: Reply,
    prompt_param: str,
    default_max: int | None,
) -> Response:
    """Submit to the engine, then stream or collect the answer."""
    params = _request_params(state, body, len(ids), prompt_param, default_max)
    sub = Submission(state, ids, params, prompt_param)
    if body.stream:
        return StreamingResponse(
            _stream(sub, reply, body.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(sub.cancel),  # runs after a disconnect too
        )
    result = await _collect_unless_gone(sub, request)
    if result is None:
        return Response(status_code=499)  # nobody is listening any more
    text, last = result
    finish = _finish_reason(last)
    return JSONResponse({**reply.full(text, finish, sub.usage()), "kvcache": sub.report()})


# ---- errors --------------------------------------------------------------------------
def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter of pydantic's first error."""
    errors = exc.errors()
    err: dict[str, Any] = dict(errors[0]) if errors else {"msg": "invalid request", "loc": ()}
    if err.get("type") == "json_invalid":
        ctx = err.get("ctx") or {}
        return f"The request body is not valid JSON: {ctx.get('error', '')}", None
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    where = f"{'.'.join(loc)}: " if loc else ""
    return f"{where}{err.get('msg', 'invalid value')}", (loc[0] if loc else None)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error answers with OpenAI's body; validation errors are 400, not FastAPI's 422."""

    def as_json(error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError), type(exc)
        return as_json(exc)

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError), type(exc)
        message, param = _validation_message(exc)
        return as_json(BadRequestError(message, param=param))

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException), type(exc)
        kind = NotFoundError if exc.status_code == 404 else BadRequestError
        error = kind(str(exc.detail)) if exc.status_code < 500 else APIError(str(exc.detail))
        error.status = exc.status_code
        return as_json(error)

    async def on_crash(_: Request, exc: Exception) -> Response:
        log.exception("request failed", exc_info=exc)
        return as_json(EngineError(f"internal error: {type(exc).__name__}: {exc}"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_crash)


# ---- what routers probe ------------------------------------------------------------------
def server_info(state: ServerState) -> dict[str, Any]:
    """``/server_info`` (SGLang's, which sglang-router and vllm-router read at registration),
    with vLLM's cache and KV-events settings under ``vllm_config``."""
    engine = state.loop.engine
    c = engine.config
    events = dict(state.info.get("kv_events_config", {"enable_kv_cache_events": False}))
    return {
        "model_path": state.info.get("model_path", state.model_name),
        "tokenizer_path": state.info.get("tokenizer_path"),
        "weights_path": state.info.get("weights_path"),
        "served_model_name": state.model_name,
        "is_generation": True,
        "tp_size": 1,
        "dp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null",
        "max_running_requests": c.max_sequences,
        "max_batch_size": c.max_sequences,
        "max_num_reqs": c.max_sequences,
        "max_prefill_tokens": c.max_batch,
        "max_total_num_tokens": engine.cache.num_cells,
        "context_length": c.capacity,
        "page_size": c.block_size,
        "enable_prefix_caching": c.prefix_cache,
        "kv_codec": c.codec,
        "version": __version__,
        "vllm_config": {
            "cache_config": {"block_size": c.block_size, "enable_prefix_caching": c.prefix_cache},
            "kv_events_config": events,
        },
        "kv_events_config": events,
    }


def model_info(state: ServerState) -> dict[str, Any]:
    """``/model_info`` (SGLang's): what the served model is."""
    config = state.loop.engine.model.config
    return {
        "model_path": state.info.get("model_path", state.model_name),
        "tokenizer_path": state.info.get("tokenizer_path"),
        "served_model_name": state.model_name,
        "is_generation": True,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "max_context_length": state.capacity,
        "vocab_size": config.vocab_size,
        "eos_token_ids": sorted(state.tokenizer.stop_ids),
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "preferred_sampling_params": None,
    }


def load(state: ServerState) -> list[dict[str, Any]]:
    """``/get_load`` (SGLang's, one entry per data-parallel rank): what this replica runs."""
    snap = state.loop.snapshot
    queued, running = int(snap.get("queued", 0)), int(snap.get("running", 0))
    return [
        {
            "dp_rank": 0,
            "num_reqs": queued + running,
            "num_waiting_reqs": queued,
            "num_tokens": int(snap.get("cells_running", 0)),
        }
    ]


async def _on_engine(state: ServerState, fn: Callable[[], Any]) -> Any:
    """``fn``'s result, run on the engine thread; 503 if the engine does not answer."""
    if not state.loop.alive:
        raise EngineUnavailableError("the engine is not running")
    try:
        return await asyncio.wait_for(asyncio.wrap_future(state.loop.call(fn)), ENGINE_CALL_S)
    except TimeoutError:
        raise EngineUnavailableError("the engine did not answer in time") from None


async def reset_prefix_cache(state: ServerState) -> dict[str, Any]:
    """Empty the prefix cache (vLLM's ``/reset_prefix_cache``, SGLang's ``/flush_cache``):
    400, changing nothing, while requests are queued or running."""
    engine = state.loop.engine
    if not await _on_engine(state, lambda: not engine.busy and engine.reuse.reset()):
        raise BadRequestError(
            "The prefix cache was not reset: requests are running; retry when idle",
            code="cache_in_use",
        )
    return {"success": True, "message": "prefix cache reset"}


async def health_generate(state: ServerState) -> dict[str, str]:
    """One generated token end to end (SGLang's ``/health_generate``)."""
    ids = state.tokenizer.encode("Hi")
    sub = Submission(state, ids, RequestParams(max_tokens=1), "prompt")
    _, last = await _collect(sub)
    _finish_reason(last)  # raises on an engine failure
    return {"status": "ok", "model": state.model_name}


# ---- the app -------------------------------------------------------------------------
def _lifespan(
    state: ServerState,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Samples the engine counters every second (for the tokens/s gauges) while serving."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def sample() -> None:
            while True:
                state.rates.observe(state.loop.snapshot)
                await asyncio.sleep(SAMPLE_S)

        task = asyncio.create_task(sample())
        try:
            yield
        finally:
            task.cancel()

    return lifespan


def create_app(
    loop: EngineLoop,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    info: Mapping[str, Any] | None = None,
) -> FastAPI:
    """The HTTP app over a running engine loop (the caller starts and closes the loop);
    ``info`` adds ``model_path`` and ``kv_events_config`` to ``/server_info``."""
    state = ServerState(loop, tokenizer, model_name, dict(info or {}))
    app = FastAPI(title="kvcache", lifespan=_lifespan(state))
    app.state.kvcache = state
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        if not state.loop.alive:
            raise EngineUnavailableError("the engine is not running")
        return {"status": "ok", "model": state.model_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return model_list(state.model_name, state.created)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(state.prometheus.render(), media_type=metrics.CONTENT_TYPE)

    # what sglang-router and vllm-router probe (SGLang's names, then their older get_ ones)
    app.get("/server_info")(lambda: server_info(state))
    app.get("/get_server_info")(lambda: server_info(state))
    app.get("/model_info")(lambda: model_info(state))
    app.get("/get_model_info")(lambda: model_info(state))
    app.get("/get_load")(lambda: load(state))
    app.get("/version")(lambda: {"version": __version__})

    @app.post("/reset_prefix_cache")
    @app.post("/flush_cache")
    async def reset() -> dict[str, Any]:
        return await reset_prefix_cache(state)

    @app.get("/health_generate")
    async def health_gen() -> dict[str, str]:
        return await health_generate(state)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body)
        ids = _completion_ids(state, body)
        reply = CompletionReply(state.model_name)
        return await _respond(
            state, request, body, ids, reply, "prompt", COMPLETION_DEFAULT_MAX_TOKENS
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body)
        ids = _chat_ids(state, body)
        return await _respond(
            state, request, body, ids, ChatReply(state.model_name), "messages", None
        )

    return app

"""The OpenAI wire format the server speaks: request models, response bodies, errors.

Requests are pydantic models in strict mode, so a wrong JSON type (``"max_tokens": "5"``)
is an error instead of being coerced. Fields the engine cannot honour (``n > 1``,
penalties, ``logprobs``, ...) are accepted only at their no-op values: a client asking for
them gets a 400 naming the field, never a silently different answer. ``ignore_eos`` is the
vLLM extension (benchmarks use it to generate exactly ``max_tokens``), and so is
``cache_salt`` (a tenant's prefix-cache namespace; a non-string or one over 256 characters
is a 400).

Every error body is OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvcache.engine.params import MAX_CACHE_SALT
from kvcache.errors import KVCacheError

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_SEED = 2**63 - 1
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # engine -> OpenAI

# Fields the engine cannot honour -> the values that mean "off" (anything else is a 400).
NO_OP_VALUES: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
}
COMPLETION_NO_OP_VALUES: dict[str, tuple[object, ...]] = {
    "echo": (False,),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class APIError(KVCacheError):
    """An error the server answers with: HTTP status plus OpenAI's error fields."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequestError(APIError):
    """The request cannot be served as asked (400): the client must change it."""

    status = 400
    type = "invalid_request_error"


class NotFoundError(APIError):
    """No such route (404)."""

    status = 404
    type = "not_found_error"


class EngineError(APIError):
    """The engine failed or stopped while serving the request (500)."""


class EngineUnavailableError(APIError):
    """The engine thread is not running: nothing submitted now would be served (503)."""

    status = 503
    type = "service_unavailable"


# ---- requests ------------------------------------------------------------------------
class StreamOptions(BaseModel):
    """``stream_options``: ask for a final chunk carrying the usage counts."""

    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields both endpoints share: model, length, sampling, stop strings, streaming."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # vLLM's extension: prefix blocks shared only between requests with the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)
    user: str | None = None
    # accepted only at their no-op values (NO_OP_VALUES)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
        return v

    @field_validator(*NO_OP_VALUES)
    @classmethod
    def _no_op_only(cls, v: object, info: ValidationInfo) -> object:
        if v not in NO_OP_VALUES[str(info.field_name)]:
            raise ValueError(f"{info.field_name}={v!r} is not supported by this server")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a text prompt (or token ids)."""

    prompt: str | list[int]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator(*COMPLETION_NO_OP_VALUES)
    @classmethod
    def _completion_no_op_only(cls, v: object, info: ValidationInfo) -> object:
        if v not in COMPLETION_NO_OP_VALUES[str(info.field_name)]:
            raise ValueError(f"{info.field_name}={v!r} is not supported by this server")
        return v


class TextPart(BaseModel):
    """One part of a multi-part message; only text is understood."""

    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn; ``developer`` is the newer spelling of ``system``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def template_message(self) -> dict[str, str]:
        """The {role, content} mapping the chat template renders."""
        text = (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: a conversation rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


# ---- responses -----------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``: ``prompt_tokens_details.cached_tokens`` counts the prompt tokens
    taken from the prefix cache (or the block store) instead of computed."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def model_list(model: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model this server runs."""
    card = {"id": model, "object": "model", "created": created, "owned_by": "kvcache"}
    return {"object": "list", "data": [card]}


class Reply:
    """One response's identity (id, creation time, model) and its body shapes.

    Subclasses give the two endpoints' shapes; the streaming and collecting code is shared.
    """

    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, model: str) -> None:
        self.id = new_id(self.id_prefix)
        self.created = now()
        self.model = model

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, text: str, finish: str, counts: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming body."""
        return {**self._envelope(self.object, [self._choice(text, finish)]), "usage": counts}

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before any text (chat announces the assistant role)."""
        return []

    def delta(self, text: str) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [self._delta_choice(text, None)])

    def closing(self, finish: str) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [self._delta_choice(None, finish)])

    def usage_chunk(self, counts: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": counts}

    def _choice(self, text: str, finish: str) -> dict[str, Any]:
        raise NotImplementedError

    def _delta_choice(self, text: str | None, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError


class CompletionReply(Reply):
    """``text_completion`` bodies: the text sits in ``choices[0].text``."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def _choice(self, text: str, finish: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def _delta_choice(self, text: str | None, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


class ChatReply(Reply):
    """``chat.completion`` bodies: the text is the assistant message's content."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _choice(self, text: str, finish: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}

    def opening(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return [self._envelope(self.chunk_object, [choice])]

    def _delta_choice(self, text: str | None, finish: str | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

"""Chat templates: the jinja2 source a GGUF ships in ``tokenizer.chat_template``.

Rendered like HuggingFace's ``apply_chat_template``: a sandboxed environment with
``trim_blocks`` / ``lstrip_blocks``, variables ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` and the helper ``raise_exception``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvcache.errors import InvalidArgumentError

Message = Mapping[str, str]  # {"role": "user" | "system" | "assistant", "content": "..."}


def _raise(message: str) -> NoReturn:
    raise InvalidArgumentError(
        "messages", "<conversation>", f"what the chat template accepts: {message}"
    )


class ChatTemplate:
    """A compiled chat template with the model's BOS/EOS spellings."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidArgumentError(
                "source", source[:60] + "...", f"a valid jinja2 template ({exc})"
            ) from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """Prompt text for ``messages`` (each a mapping with str ``role`` and ``content``)."""
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
            raise InvalidArgumentError("messages", messages, "a non-empty list of {role, content}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not all(
                isinstance(m.get(key), str) for key in ("role", "content")
            ):
                raise InvalidArgumentError(
                    f"messages[{i}]", m, "a mapping with str role and content"
                )
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

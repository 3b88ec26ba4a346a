"""A tokenizer rebuilt from a GGUF's own vocabulary, merges and special tokens (no hub).

GGUF ``tokenizer.ggml.model == "gpt2"`` is byte-level BPE: tokens are spelled in GPT-2's
byte alphabet (``Ġ`` = space), merges are ``"a b"`` strings in rank order, and token types
mark control tokens (``<|im_start|>`` ...) that must stay whole. ``tokenizer.ggml.pre`` names
how text is split before BPE; :data:`PRE_TOKENIZERS` maps the names we know to the
``tokenizers`` pipeline that reproduces it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from kvcache.errors import InvalidArgumentError, NotSupportedError
from kvcache.text.chat import ChatTemplate, Message
from kvcache.text.sentencepiece import sentencepiece_backend
from kvcache.text.templates import BUILTIN
from kvcache.weights.gguf import GGUFFile, smollm2_path

CONTROL = 3  # llama.cpp token type of special tokens (user-defined is 4)
USER_DEFINED = 4

# Names of end-of-turn tokens that stop generation besides the file's EOS.
END_OF_TURN = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # SmolLM/StarCoder: every digit alone, then GPT-2's split
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _llama3() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> pre-tokenizer (llama.cpp's names)
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "smollm": _smollm,
    "starcoder": _smollm,
    "llama3": _llama3,
    "llama-bpe": _llama3,
}


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str]) -> Backend:
    """GPT-2's byte-level BPE from the file's merges, split as ``tokenizer.ggml.pre`` says."""
    pre = str(gguf.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise NotSupportedError(
            f"{gguf.path.name}: tokenizer.ggml.pre={pre!r} is not supported; "
            f"expected one of {sorted(PRE_TOKENIZERS)}"
        )
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
    backend = Backend(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(gguf: GGUFFile, tokens: list[str]) -> Backend:
    del gguf  # everything it needs is in the vocabulary
    return sentencepiece_backend(tokens)


# tokenizer.ggml.model -> the tokenizers pipeline of its vocabulary
BACKENDS: dict[str, Callable[[GGUFFile, list[str]], Backend]] = {
    "gpt2": _byte_level_bpe,
    "llama": _sentencepiece,
}


class Tokenizer:
    """Text <-> token ids for a GGUF model, plus its special tokens and chat template."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        vocab = backend.get_vocab(with_added_tokens=True)
        ends = {vocab[name] for name in END_OF_TURN if name in vocab}
        self.stop_ids: frozenset[int] = frozenset(
            ends | ({eos_id} if eos_id is not None else set())
        )

    @classmethod
    def from_gguf(cls, path: str | Path | GGUFFile | None = None) -> Tokenizer:
        """The tokenizer a GGUF describes (None = the bundled SmolLM2)."""
        if isinstance(path, GGUFFile):
            return cls._build(path)
        with GGUFFile(smollm2_path() if path is None else path) as gguf:
            return cls._build(gguf)

    @classmethod
    def _build(cls, gguf: GGUFFile) -> Tokenizer:
        kind = gguf.get("tokenizer.ggml.model")
        build = BACKENDS.get(kind)
        if build is None:
            raise NotSupportedError(
                f"{gguf.path.name}: tokenizer.ggml.model={kind!r} is not supported; "
                f"expected one of {sorted(BACKENDS)} (byte-level BPE, SentencePiece)"
            )
        tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
        backend = build(gguf, tokens)
        types = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == CONTROL
            ]
        )
        # user-defined tokens stay whole where the model's vocabulary spells them as the file
        # does (Gemma's runs of spaces are respelled as ▁ runs and merge instead)
        vocab = backend.get_vocab(with_added_tokens=False)
        backend.add_tokens(
            [
                AddedToken(t, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == USER_DEFINED and t in vocab
            ]
        )
        bos, eos = gguf.get("tokenizer.ggml.bos_token_id"), gguf.get("tokenizer.ggml.eos_token_id")
        source = gguf.get("tokenizer.chat_template") or BUILTIN.get(gguf.architecture)
        template = None
        if source is not None:
            template = ChatTemplate(
                source,
                bos_token=tokens[bos] if bos is not None else "",
                eos_token=tokens[eos] if eos is not None else "",
            )
        return cls(
            backend,
            bos_id=None if bos is None else int(bos),
            eos_id=None if eos is None else int(eos),
            add_bos=bool(gguf.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=template,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) stay whole.
        A text that starts with BOS itself (a chat template writes it) gets no second one."""
        if not isinstance(text, str):
            raise InvalidArgumentError("text", type(text).__name__, "a str")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.add_bos if add_bos is None else add_bos
        if bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return list(ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids`` (invalid UTF-8 at the edges becomes U+FFFD)."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special))

    def token_id(self, token: str) -> int | None:
        """Id of a token spelled as in the vocabulary, or None."""
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def apply_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, rendered by the model's own chat template."""
        if self.chat_template is None:
            raise NotSupportedError("this GGUF has no tokenizer.chat_template: use a plain prompt")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

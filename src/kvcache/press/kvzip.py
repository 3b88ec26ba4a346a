"""KVzip (Kim et al., 2025), as kvpress's ``KVzipPress``: a cell is worth keeping when the
model needs it to *repeat* the context. Query-agnostic by construction: the scores come from
the context itself, not from the newest prompt rows (SnapKV) or a guess of future queries.

After the prefill, the context is fed again behind a request to repeat it, chunk by chunk
(``chunk`` context tokens at a time), into the same sequence at the positions after the
context; each chunk's repeat is removed before the next. Per layer and KV head, a context
cell scores the largest attention any query of its chunk's repeat gives it, the softmax taken
over the sinks, the chunk's own cells and the repeat so far (kvpress's subsampled keys)::

    repeat i   first (i = 0) | later + the previous chunk's last 8 tokens (i > 0),
               then suffix (the chat template's turn change), then context[a:b]
    attn       [Hkv, G, r, s + c + r]  softmax(q . k / sqrt(D)) over the s sinks (positions
               < min(sinks, a)), the c = b - a cells of the chunk, the repeat's r cells
               (causal among themselves)
    scores     [Hkv, c]                attn[..., s:s + c] max over G and r
               sinks and the template prefix (``skip`` cells, never repeated): 1, the top

One decision per cell then as every press here (``base.py``), or by whole chunks of cells:
``chunkkv:0.5,inner=kvzip``, the better on SmolLM2-135M's needles (docs/results/index.md).

What it needs beyond a press: the model and its prompt tokens, bound once
(``press.bind(Reconstruction(...))`` or ``Reconstruction.for_template``), and the context's
tokens at compress time (``press.compress(cache, seq, tokens=ids)``); the sequence must hold
exactly positions 0..n-1 (a fresh prefill, not pressed yet), and the pool room for one
chunk's repeat (``chunk`` + the prompt's tokens; else CacheFullError, the sequence as it was).
Cost: a second prefill of the context, with the longer attention span of the repeat (the
paper's 2-3x of the prefill with chunks); it presses once after a prefill, never during
decode. The repeat passes the context's newest rows out of a quantizing codec's fp16 window:
after the press they are codes (and held in fewer bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from kvcache.batch import Batch
from kvcache.errors import CallOrderError, InvalidArgumentError, NotSupportedError
from kvcache.press.base import Press, Scoring
from kvcache.press.queries import QueryWindow

CHUNK = 2048  # context tokens repeated per forward pass (kvpress's chunk_size)
SINKS = 4  # kvpress's n_sink
OVERLAP = 8  # tokens of the previous chunk quoted by the later prompt (prev_postfix_size)
FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
SENTINEL = "\x00context\x00"  # stands for the user's content in a chat template
ROWS = 1024  # query rows scored at a time (memory: ROWS x G x keys floats per KV head)


class Forwarder(Protocol):
    def forward(
        self, tokens: Sequence[int], batch: Batch, cache: Any, *, outputs: Sequence[int] | None
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Reconstruction:
    """The model and the prompt tokens of a repeat (module docstring)."""

    model: Forwarder
    first: list[int]  # the request to repeat, before the first chunk
    later: list[int]  # ... before a later chunk (then the previous chunk's last tokens)
    suffix: list[int] = field(default_factory=list)  # the template's end of turn
    skip: int = 0  # leading context tokens never repeated (the template's prefix): kept

    @classmethod
    def for_template(
        cls, model: Forwarder, encode: Callable[[str], list[int]], prefix: str, suffix: str
    ) -> Reconstruction:
        """Prompts for a context that starts with a chat template's ``prefix`` (the text
        before the user's content) and a turn that ends with ``suffix`` (the text after it,
        up to the assistant's turn): ``encode`` turns text into ids without a BOS."""
        return cls(model, encode(FIRST), encode(LATER), encode(suffix), len(encode(prefix)))

    @classmethod
    def for_chat(cls, model: Forwarder, tokenizer: Any) -> Reconstruction:
        """``for_template`` with the parts of ``tokenizer``'s chat template around one user
        turn (``apply_chat``; a newline closes the request when it has none, as kvpress)."""
        try:
            whole = tokenizer.apply_chat([{"role": "user", "content": SENTINEL}])
            prefix, _, suffix = whole.partition(SENTINEL)
        except NotSupportedError:  # no chat template
            prefix, suffix = "", "\n"
        return cls.for_template(
            model, lambda text: tokenizer.encode(text, add_bos=False), prefix, suffix
        )


class KVzip(Press):
    """Keeps the cells the model attends to most while repeating the context."""

    name = "kvzip"

    def __init__(
        self, ratio: float, compact: bool = False, chunk: int = CHUNK, sinks: int = SINKS
    ) -> None:
        super().__init__(ratio, compact)
        self.chunk = chunk
        self.sinks = sinks
        self.reconstruction: Reconstruction | None = None

    @property
    def reconstructs(self) -> bool:
        return True

    def bind(self, reconstruction: Any) -> KVzip:
        if not isinstance(reconstruction, Reconstruction):
            raise InvalidArgumentError(
                "reconstruction", type(reconstruction).__name__, "a kvzip.Reconstruction"
            )
        self.reconstruction = reconstruction
        return self

    def extra_cells(self, n: int) -> int:
        """The longest repeat of an ``n``-token context: its chunk and prompt."""
        rec = self.reconstruction
        if rec is None:
            return 0
        return (
            max(
                (len(self._head(a, None)) + len(rec.suffix) + min(self.chunk, n - a))
                for a in range(rec.skip, n, self.chunk)
            )
            if n > rec.skip
            else 0
        )

    def _head(self, a: int, tokens: np.ndarray | None) -> list[int]:
        """The prompt before the chunk at ``a``: the first, or a later one quoting the 8
        tokens before it (placeholders when ``tokens`` is None: only its length counts)."""
        rec = self.reconstruction
        assert rec is not None
        if a == rec.skip:
            return rec.first
        quoted = (
            tokens[max(0, a - OVERLAP) : a].tolist()
            if tokens is not None
            else [0] * min(a, OVERLAP)
        )
        return [*rec.later, *quoted]

    def scores(self, ctx: Scoring) -> torch.Tensor:
        rec = self.reconstruction
        if rec is None:
            raise CallOrderError(
                "press 'kvzip' repeats the context through the model: bind it first "
                "(press.bind(Reconstruction(model, ...)))"
            )
        n = len(ctx.cells)
        tokens = ctx.tokens
        if tokens is None or len(tokens) != n or not np.array_equal(ctx.pos, np.arange(n)):
            raise InvalidArgumentError(
                "tokens",
                None if tokens is None else f"{len(tokens)} tokens for {n} cells",
                "the context's token ids, one per position 0..n-1 of a sequence not pressed "
                "yet: compress(cache, seq, tokens=ids)",
            )
        layers = ctx.layers()
        out: torch.Tensor | None = None
        kept = min(max(rec.skip, self.sinks), n)
        for a in range(min(rec.skip, n), n, self.chunk):
            b = min(a + self.chunk, n)
            rep = [*self._head(a, tokens), *rec.suffix, *tokens[a:b].tolist()]
            got = self._chunk(ctx, rep, a, b, layers)
            if out is None:
                out = torch.zeros((len(layers), got.shape[1], n), dtype=got.dtype)
            out[:, :, a:b] = got
        if out is None:  # nothing repeated: every cell is a sink or the template's
            hkv = ctx.cache.layer_shapes(layers[0])[0][0]
            out = torch.zeros((len(layers), hkv, n))
        out[:, :, :kept] = 1.0
        return out

    def _chunk(
        self, ctx: Scoring, rep: list[int], a: int, b: int, layers: list[int]
    ) -> torch.Tensor:
        """Scores [L, Hkv, b - a] of the cells at positions a..b-1 from one repeat."""
        rec = self.reconstruction
        assert rec is not None
        cache, seq, n = ctx.cache, ctx.seq, len(ctx.cells)
        window = QueryWindow(cache, len(rep))
        try:
            with window:
                for s in range(0, len(rep), cache.max_batch):
                    m = min(cache.max_batch, len(rep) - s)
                    rec.model.forward(
                        rep[s : s + m], Batch.single(seq, n + s, m), cache, outputs=[]
                    )
            sink = min(self.sinks, a)
            keys = np.concatenate([ctx.cells[:sink], ctx.cells[a:b], cache.cells_of(seq)[n:]])
            return torch.stack(
                [repeat_attention(window, cache, seq, layer, keys, sink, b - a) for layer in layers]
            )
        finally:
            cache.remove(seq, n)


def repeat_attention(
    window: QueryWindow, cache: Any, seq: int, layer: int, keys: np.ndarray, sink: int, c: int
) -> torch.Tensor:
    """[Hkv, c]: the largest attention the repeat's queries give each of the c chunk cells,
    over ``keys`` = sinks, the chunk's cells, the repeat's cells (module docstring)."""
    q, _ = window.queries(seq, layer)  # [r, Hq, D]
    k = cache.read_keys(layer, torch.from_numpy(keys))  # [s + c + r, Hkv, D]
    k = k.to(torch.promote_types(k.dtype, torch.float32))
    q = q.to(k.dtype)
    (r, hq, d), hkv = q.shape, k.shape[1]
    g = hq // hkv
    qg = q.view(r, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, r * g, d)  # rows (row, group)
    kt = k.permute(1, 2, 0)  # [Hkv, D, s + c + r]
    best = torch.zeros((hkv, c), dtype=k.dtype, device=k.device)
    before = sink + c
    for i in range(0, r, ROWS):
        j = min(r, i + ROWS)
        logits = (qg[:, i * g : j * g] @ kt) / math.sqrt(d)  # [Hkv, (j - i) * G, s + c + r]
        row = torch.arange(i, j, device=k.device).repeat_interleave(g)  # each row's repeat row
        late = torch.arange(r, device=k.device)[None, :] > row[:, None]  # keys after the row
        logits[:, :, before:].masked_fill_(late, float("-inf"))
        attn = torch.softmax(logits, dim=-1)[:, :, sink:before]
        best = torch.maximum(best, attn.amax(dim=1))
    return best

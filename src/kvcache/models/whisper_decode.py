"""Whisper's cached decoding on the library's caches: several sequences, several audio windows.

:class:`WhisperKVCache` is a :class:`~kvcache.WrapperCache` of::

    layer type 0 (CROSS): EncoderCache  keys/values[layer] : [A, H, 1500, D]  (A audio windows)
    layer type 1 (SELF) : CausalCache   cells [N, H, D], one cell per decoded token

Window ``a`` is one audio window's cross K/V (e.g. the current 30 s of one file among several
decoded together); each sequence reads one window (``attach``), and ``set_audio`` replaces a
window in place when its file moves on. The self-attention cells of every sequence share one
pool, so one :func:`forward_decoder_step` decodes rows of many sequences (prompts and single
tokens mixed) reading different windows. Cross K/V are projected once per window; a step
embeds only its new tokens, writes their self K/V into free cells and reads views back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.encoder import EncoderCache
from kvcache.errors import DimensionMismatchError, InvalidArgumentError
from kvcache.kernels.dense import dense_attention
from kvcache.kernels.linear import linear
from kvcache.models.whisper import Whisper
from kvcache.validate import int_arg
from kvcache.wrapper import WrapperCache

CROSS, SELF = 0, 1  # layer types of WhisperKVCache's wrapper


class WhisperKVCache:
    """Self K/V in a CausalCache and cross K/V in an EncoderCache, routed by a WrapperCache.

    ``audio`` is one window's encoder output [S, n] / [1, S, n] or several windows [A, S, n];
    sequence ``s`` reads window ``s`` when there are several (or the window it was attached
    to; ``copy_prefix`` children inherit their parent's), window 0 otherwise. ``capacity`` is
    cells per sequence (the pool holds ``max_sequences * capacity`` cells, shared by all);
    ``codec`` stores the self K/V compressed (e.g. "int8", see :mod:`kvcache.codecs`).
    """

    def __init__(
        self,
        model: Whisper,
        audio: torch.Tensor,
        *,
        max_sequences: int = 1,
        capacity: int | None = None,
        codec: str | None = None,
    ) -> None:
        cfg = model.config
        if audio.dim() == 2:
            audio = audio.unsqueeze(0)
        self._check_audio(model, audio)
        self.model = model
        self.config = cfg
        self.n_audio = int(audio.shape[0])
        self.cross = EncoderCache()
        self.self_attn = CausalCache(
            cfg.n_text_ctx if capacity is None else capacity,
            max_sequences=max_sequences,
            dtype=model.dtype,
            codec=codec,
        )
        self.cache = WrapperCache(self.cross, self.self_attn)  # layer types CROSS, SELF
        self.lengths: dict[int, int] = {}  # sequence -> tokens stored (= next position)
        self.audio_of: dict[int, int] = {}  # sequence -> encoder window it attends to
        self.cross.start_forward(Batch([0], [0], encoder_inputs=[0]))
        with torch.inference_mode():  # every layer's K and V in one [A*S, n] x [n, L*2n]
            for layer, (k, v) in enumerate(model.cross_kv_layers(audio)):  # [A, H, S, D]
                self.cross.put(layer, k, v)

    @staticmethod
    def _check_audio(model: Whisper, audio: torch.Tensor) -> None:
        n = model.config.n_text_state
        if audio.dim() != 3 or audio.shape[2] != n:
            raise DimensionMismatchError(f"[A, S, {n}]", tuple(audio.shape), "audio states")

    def set_audio(self, window: int, audio: torch.Tensor) -> None:
        """Replace window ``window``'s cross K/V by those of ``audio`` [S, n] / [1, S, n] in
        place (a file moved to its next 30 s); the sequences reading it see the new audio."""
        window = int_arg("window", window)
        if window >= self.n_audio:
            raise InvalidArgumentError("window", window, f"an index < {self.n_audio}")
        audio = audio.unsqueeze(0) if audio.dim() == 2 else audio
        self._check_audio(self.model, audio)
        if audio.shape[0] != 1:
            raise DimensionMismatchError("[1, S, n]", tuple(audio.shape), "audio states")
        with torch.inference_mode():
            for layer, (k, v) in enumerate(self.model.cross_kv_layers(audio)):  # [1, H, S, D]
                self.cross.put_item(layer, window, k[0], v[0])

    def attach(self, seq: int, window: int) -> None:
        """Make ``seq`` (holding no tokens yet) read window ``window``."""
        seq, window = int_arg("seq", seq), int_arg("window", window)
        if window >= self.n_audio:
            raise InvalidArgumentError("window", window, f"an index < {self.n_audio}")
        if self.length(seq):
            raise InvalidArgumentError(
                "seq", seq, f"a sequence holding no tokens (it holds {self.length(seq)})"
            )
        self.audio_of[seq] = window

    @property
    def step(self) -> int:
        """Tokens decoded so far (the longest sequence's length)."""
        return max(self.lengths.values(), default=0)

    def length(self, seq: int) -> int:
        """Tokens stored for ``seq`` (= the position of its next token)."""
        return self.lengths.get(int_arg("seq", seq), 0)

    def window(self, seq: int) -> int:
        """The encoder window sequence ``seq`` attends to."""
        seq = int_arg("seq", seq)
        return self.audio_of.get(seq, seq if self.n_audio > 1 else 0)

    def plan(self, seqs: Sequence[int]) -> Batch:
        """The batch of one step: tokens of a sequence take its next consecutive positions."""
        nxt: dict[int, int] = {}
        positions = []
        for s in seqs:
            p = nxt.get(s, self.lengths.get(s, 0))
            positions.append(p)
            nxt[s] = p + 1
        if max(nxt.values(), default=0) > self.config.n_text_ctx:
            raise InvalidArgumentError(
                "seqs", list(seqs), f"sequences of at most {self.config.n_text_ctx} tokens"
            )
        for s in nxt:
            if self.window(s) >= self.n_audio:
                raise InvalidArgumentError(
                    "seqs", s, f"a sequence whose window is < {self.n_audio}"
                )
        return Batch(positions, list(seqs))

    def commit(self, batch: Batch) -> None:
        """Advance the counters after a successful forward."""
        for s, p in zip(batch.sequences, batch.positions, strict=True):
            self.lengths[s] = max(self.lengths.get(s, 0), p + 1)

    def unwind(self, batch: Batch) -> None:
        """Drop the cells a failed forward placed (its tokens are the last of their sequences)."""
        first: dict[int, int] = {}
        for s, p in zip(batch.sequences, batch.positions, strict=True):
            first[s] = min(p, first.get(s, p))
        for s, p in first.items():
            self.self_attn.remove(s, p)

    def copy_prefix(self, src: int, dst: int, length: int | None = None) -> None:
        """``dst`` shares ``src``'s first ``length`` tokens (all by default) without copying K/V."""
        n = self.length(src) if length is None else int_arg("length", length)
        if n > self.length(src):
            raise InvalidArgumentError(
                "length", n, f"<= {self.length(src)} (tokens of sequence {src})"
            )
        window = self.window(src)
        self.cache.copy_prefix(src, dst, n)
        self.lengths[dst] = n
        self.audio_of[dst] = window

    def remove(self, seq: int) -> None:
        """Free ``seq``'s cells (shared ones stay for their other users).

        Only the causal cache is told: the cross K/V belong to the audio window, not to a
        sequence (the encoder cache would otherwise drop them for every sequence).
        """
        self.self_attn.remove(int_arg("seq", seq), 0)
        self.lengths.pop(seq, None)
        self.audio_of.pop(seq, None)

    def memory_usage_bytes(self) -> int:
        return self.cache.memory_usage_bytes()

    def close(self) -> None:
        self.cache.close()


# ---- cached decoding ---------------------------------------------------------------------
def forward_decoder_step(
    model: Whisper,
    tokens: Sequence[int] | torch.Tensor,
    seqs: Sequence[int],
    cache: WhisperKVCache,
    logits_rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """Logits [T, n_vocab] of T new tokens of several sequences in one forward.

    Token i belongs to sequence ``seqs[i]``; a sequence's tokens take its next positions in
    order (so a prompt can be fed in one call). ``logits_rows`` projects only those rows to
    the vocabulary (a prompt needs one or two of its rows): [len(logits_rows), n_vocab].
    The counters advance only after every layer ran: on error the cache is unchanged.
    """
    cfg = model.config
    ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)  # [T]
    if ids.numel() != len(seqs) or ids.numel() == 0:
        raise InvalidArgumentError(
            "seqs", list(seqs), f"{ids.numel()} sequence ids, one per token (>= 1)"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.n_vocab:
        raise InvalidArgumentError("tokens", ids.tolist(), f"ids in 0..{cfg.n_vocab - 1}")
    rows = None if logits_rows is None else torch.as_tensor(logits_rows, dtype=torch.int64)
    if rows is not None and rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < len(ids):
        raise InvalidArgumentError("logits_rows", rows.tolist(), f"rows in 0..{len(ids) - 1}")
    batch = cache.plan(seqs)
    cache.cache.start_forward(batch)
    try:
        with torch.inference_mode():
            pos = torch.tensor(batch.positions, dtype=torch.int64)
            x = model.token_emb[ids] + model.text_pos[pos]  # [T, n]
            windows = [cache.window(s) for s in batch.sequences]
            x = _decode_layers(model, x, cache, windows)  # [T, n]
            if rows is not None:
                x = x[rows]  # [R, n]
            logits = linear(model.decoder_ln(x), model.token_emb)  # [T, n_vocab]: kernels.linear
    except BaseException:
        cache.unwind(batch)
        raise
    cache.commit(batch)
    return logits


def _decode_layers(
    model: Whisper, x: torch.Tensor, cache: WhisperKVCache, windows: list[int]
) -> torch.Tensor:
    """The decoder blocks over the step's rows x [T, n] -> [T, n]."""
    cfg = model.config
    h, t = cfg.n_text_head, x.shape[0]
    scale = 1.0 / math.sqrt(cfg.n_text_state // h)
    for layer, blk in enumerate(model.decoder):
        q, k, v = blk.qkv(blk.attn_ln(x)).view(t, 3, h, -1).unbind(1)  # each [T, H, D]
        x = x + blk.out(_self_attention(cache, layer, q, k, v, scale))
        cache.cache.set_layer_type(CROSS)
        ck, cv, _ = cache.cache.get(layer)  # [A, H, S, D]
        x = x + blk.cross_out(
            _cross_attention(blk.cross_q(blk.cross_ln(x)).view(t, h, -1), ck, cv, windows, scale)
        )
        x = x + blk.fc2(F.gelu(blk.fc1(blk.mlp_ln(x))))
    return x


def _self_attention(
    cache: WhisperKVCache,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Store the step's self K/V [T, H, D] and attend each row q [T, H, D] to its own
    sequence's cells (CausalCache.attention) -> [T, H*D]."""
    cache.cache.set_layer_type(SELF)
    return cache.cache.attention(layer, q, k, v, scale=scale).reshape(q.shape[0], -1)


def _cross_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, windows: list[int], scale: float
) -> torch.Tensor:
    """q [T, H, D] over each row's window of keys/values [A, H, S, D] -> [T, H*D]."""
    return dense_attention(q, keys, values, windows, scale).reshape(q.shape[0], -1)


def forward_decoder_cached(
    model: Whisper, token: int | torch.Tensor, cache: WhisperKVCache, seq: int = 0
) -> torch.Tensor:
    """Logits [n_vocab] of one new token of ``seq`` at position ``cache.length(seq)``."""
    ids = torch.as_tensor(token, dtype=torch.int64).reshape(-1)
    if ids.numel() != 1:
        raise InvalidArgumentError("token", token, "one token id")
    return forward_decoder_step(model, ids, [seq], cache)[0]

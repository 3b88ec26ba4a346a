"""Gemma 3's text decoder (Gemma 3 270M) over a caller-owned wrapper cache, as Ollama builds it.

Layout: as :mod:`kvcache.models.llama` (token-major ``x: [T, E]``, fused ``qkv: [T, (Hq + 2
Hkv) D]``, attention a cache operation). What Gemma adds:

- embeddings scaled by sqrt(E) and tied to the LM head;
- RMSNorm weights are ``1 + w`` (llama.cpp's GGUF stores them with the 1 added), four norms a
  block: before and after attention, before and after the MLP (the "after" norms act on the
  branch before the residual add);
- q and k RMS-normed per head (``q_norm``, ``k_norm`` over D), queries scaled by
  ``query_pre_attn_scalar ** -0.5``; GELU(tanh) gated MLP;
- layers of two types: sliding (window 512, RoPE base 10k) and global (full causal, RoPE base
  1M), every ``sliding_pattern``-th layer global. Their K/V live in a
  :class:`~kvcache.WrapperCache` of a sliding-window :class:`~kvcache.CausalCache` (type 0,
  which forgets cells older than the window) and a full one (type 1), each with its own RoPE
  as the shift of middle removals::

      layer   0  1  2  3  4  5  6 ... 11 ... 17
      type    S  S  S  S  S  G  S ...  G ...  G      S -> caches[0], G -> caches[1]

Weights of the three kinds of :mod:`kvcache.models.llama` (``native``: the blocks as stored;
Q4_K_M mixes block types within a fused matrix, which become its parts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.errors import DimensionMismatchError, InvalidArgumentError, NotSupportedError
from kvcache.kernels.linear import linear, norm_linear, rms_norm
from kvcache.kernels.qlinear import QuantizedWeight
from kvcache.kernels.reference import grouped_attention
from kvcache.kernels.rows import split_heads
from kvcache.models.llama import (
    WeightKind,
    WeightReader,
    dense,
    embed_rows,
    fingerprint,
    head_rows,
    held_bytes,
    output_rows,
    token_ids,
    weights_dtype,
)
from kvcache.models.rope import Rope
from kvcache.protocol import Cache
from kvcache.weights.bundled import gemma3_path
from kvcache.weights.gguf import GGUFFile, Weight, kernel_rows, stack_rows
from kvcache.wrapper import HybridCache, WrapperCache

SLIDING, GLOBAL = 0, 1  # layer types: the WrapperCache's index of each layer's cache


@dataclass(frozen=True)
class Gemma3Config:
    """Hyper-parameters of a Gemma 3 text decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_theta: float = 10_000.0  # sliding layers
    sliding_window: int = 512  # tokens a sliding layer's row sees, itself included
    sliding_pattern: int = 6  # layer i is global when (i + 1) % pattern == 0
    query_pre_attn_scalar: float = 256.0
    rms_eps: float = 1e-6
    context_length: int = 32768

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, getattr(self, name), "an int >= 1")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                "num_kv_heads", self.num_kv_heads, f"a divisor of num_heads={self.num_heads}"
            )
        if self.sliding_window < 1:
            raise InvalidArgumentError("sliding_window", self.sliding_window, "an int >= 1")
        if self.sliding_pattern < 1:
            raise InvalidArgumentError("sliding_pattern", self.sliding_pattern, "an int >= 1")

    @property
    def window(self) -> int:
        """The sliding cache's window: positions before a row it sees (the row itself aside)."""
        return self.sliding_window - 1

    def layer_type(self, layer: int) -> int:
        """SLIDING or GLOBAL (llama.cpp's and transformers' pattern: 5 sliding, then 1 global)."""
        return GLOBAL if (layer + 1) % self.sliding_pattern == 0 else SLIDING

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return float(self.query_pre_attn_scalar) ** -0.5

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, vocab_size: int | None = None) -> Gemma3Config:
        """Hyper-parameters from ``gemma3.*`` metadata; what the file does not say (local RoPE
        base, layer pattern, query scalar = head_dim) is what llama.cpp assumes for gemma3.
        ``vocab_size``: the embedding's rows, when the file says no vocab_size."""
        gguf.require_architecture("gemma3")
        a = "gemma3."
        hidden = int(gguf.require(a + "embedding_length"))
        heads = int(gguf.require(a + "attention.head_count"))
        head_dim = int(gguf.get(a + "attention.key_length", hidden // heads))
        value_dim = int(gguf.get(a + "attention.value_length", head_dim))
        if value_dim != head_dim:
            raise NotSupportedError(
                f"{gguf.path.name}: value_length {value_dim} != key_length {head_dim} is not "
                "supported"
            )
        scaling = gguf.get(a + "rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise NotSupportedError(
                f"{gguf.path.name}: {a}rope.scaling.type={scaling!r} is not supported; "
                "expected 'none'"
            )
        vocab = gguf.get(a + "vocab_size", vocab_size)
        if vocab is None:
            vocab = len(gguf.require("tokenizer.ggml.tokens"))
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(gguf.require(a + "feed_forward_length")),
            num_layers=int(gguf.require(a + "block_count")),
            num_heads=heads,
            num_kv_heads=int(gguf.get(a + "attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(gguf.get(a + "rope.freq_base", 1_000_000.0)),
            sliding_window=int(gguf.require(a + "attention.sliding_window")),
            query_pre_attn_scalar=float(head_dim),
            rms_eps=float(gguf.get(a + "attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(gguf.get(a + "context_length", 32768)),
        )


@dataclass
class Gemma3Layer:
    """Weights of one block ([out, in] like ``nn.Linear``; norms already ``1 + w``)."""

    attn_norm: torch.Tensor  # [E]
    wqkv: Weight  # [(Hq + 2 Hkv) D, E]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    wo: Weight  # [E, Hq D]
    post_attn_norm: torch.Tensor  # [E]
    mlp_norm: torch.Tensor  # [E]
    w_gate_up: Weight  # [2 F, E]
    w_down: Weight  # [E, F]
    post_mlp_norm: torch.Tensor  # [E]


@dataclass
class Gemma3Weights:
    """All weights; the LM head is the (unscaled) embedding."""

    embed: Weight  # [V, E]
    layers: list[Gemma3Layer]
    norm: torch.Tensor  # [E]


class Gemma3:
    """Gemma 3 decoder over a caller-owned :class:`~kvcache.WrapperCache` (see :meth:`new_cache`)."""

    hybrid = True  # new_cache builds a HybridCache: the engine sizes its parts apart

    def __init__(self, config: Gemma3Config, weights: Gemma3Weights) -> None:
        self.config = config
        self.weights = weights
        self.dtype = weights_dtype(weights.embed)
        self.ropes = {
            SLIDING: Rope(config.head_dim, config.rope_local_theta),
            GLOBAL: Rope(config.head_dim, config.rope_theta),
        }
        self.types = [config.layer_type(i) for i in range(config.num_layers)]
        self.source = "random"
        self._model_id: str | None = None
        self._check_shapes()

    @property
    def model_id(self) -> str:
        """Which model made a cache's K/V (snapshots refuse another's)."""
        if self._model_id is None:
            w = self.weights
            samples = [head_rows(w.embed, 4), head_rows(w.embed, -4), w.norm]
            for layer in (w.layers[0], w.layers[-1]):
                samples += [head_rows(layer.wqkv, 2), head_rows(layer.wo, 2)]
                samples += [head_rows(layer.w_down, 2), layer.q_norm]
            self._model_id = fingerprint(
                self.source, self.dtype, asdict(self.config), samples, native=self.native
            )
        return self._model_id

    @property
    def native(self) -> bool:
        """Whether the matrices are GGUF blocks as stored (``weights="native"``)."""
        return isinstance(self.weights.embed, QuantizedWeight)

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights hold (the tied LM head is the embedding)."""
        w = self.weights
        every: list[Weight] = [w.embed, w.norm]
        for layer in w.layers:
            every += [layer.attn_norm, layer.wqkv, layer.q_norm, layer.k_norm, layer.wo]
            every += [layer.post_attn_norm, layer.mlp_norm, layer.w_gate_up, layer.w_down]
            every.append(layer.post_mlp_norm)
        return held_bytes(every)

    def output_projections(self) -> list[tuple[torch.Tensor, int]]:
        """Each layer's attention output projection Wo [E, Hq * D] and the head size D."""
        return [(dense(layer.wo), self.config.head_dim) for layer in self.weights.layers]

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_gguf(
        cls,
        path: str | Path | GGUFFile | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        weights: WeightKind = "native",
    ) -> Gemma3:
        """Load a Gemma 3 GGUF (None = the bundled Gemma 3 270M): blocks as stored
        (``native``), dequantized to ``dtype`` (``fp32``) or to bfloat16 (``bf16``)."""
        reader = WeightReader.of(weights, dtype)
        if isinstance(path, GGUFFile):
            return cls._load(path, reader)
        with GGUFFile(gemma3_path() if path is None else path) as gguf:
            gguf.release("tokenizer.")
            return cls._load(gguf, reader)

    @classmethod
    def _load(cls, gguf: GGUFFile, reader: WeightReader) -> Gemma3:
        gguf.require_architecture("gemma3")
        if gguf.has_tensor("output.weight"):
            raise NotSupportedError(f"{gguf.path.name}: an untied output.weight is not supported")
        # the embedding first: its dequantization peaks while little else is resident
        embed = kernel_rows(reader.matrix(gguf, "token_embd.weight"))  # also the LM head
        config = Gemma3Config.from_gguf(gguf, vocab_size=embed.shape[0])
        layers = [_load_layer(gguf, i, reader) for i in range(config.num_layers)]
        norm = reader.vector(gguf, "output_norm.weight")
        model = cls(config, Gemma3Weights(embed, layers, norm))
        model.source = gguf.path.name
        return model

    def new_cache(
        self,
        capacity: int,
        *,
        max_sequences: int = 1,
        max_batch: int | None = None,
        window: int | None = None,
        codec: str | None = None,
        live_sequences: int | None = None,
    ) -> HybridCache:
        """Ollama's Gemma 3 cache: a sliding-window cache for the sliding layers (it holds a
        sequence's last window + a forward's tokens) and a full one for the global layers,
        each with its layers' RoPE as the shift; ``codec`` for both (a ``kvcache.codecs`` spec).
        ``window``: None (the model's layers say theirs; NotSupportedError otherwise).
        ``live_sequences``: sequences whose sliding-layer cells are live at once (default
        ``max_sequences``; an engine's running requests, where its pool of ``max_sequences``
        holds more: idle prefixes keep global cells and checkpoints only)."""
        if window is not None:
            raise NotSupportedError(
                f"window={window} on Gemma 3: its sliding layers' window is the model's "
                f"({self.config.window}), its global layers attend to everything"
            )

        def part(layer_type: int, window: int | None, sequences: int) -> CausalCache:
            cache = CausalCache(
                capacity,
                max_sequences=sequences,
                max_batch=max_batch,
                window=window,
                shift=self.ropes[layer_type],
                dtype=self.dtype,
                codec=codec,
            )
            cache.model_id = self.model_id
            return cache

        live = max_sequences if live_sequences is None else live_sequences
        return HybridCache(
            part(SLIDING, self.config.window, live), part(GLOBAL, None, max_sequences)
        )

    # ---- forward ---------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor | Sequence[int],
        batch: Batch,
        cache: Cache,
        *,
        outputs: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(outputs), V]`` (all rows when None) of a batch of many sequences;
        ``cache`` is a WrapperCache as :meth:`new_cache` builds it."""
        wrapper = self._check_cache(cache)
        ids = token_ids(tokens, len(batch), self.config.vocab_size)
        rows = output_rows(outputs, len(batch))
        with torch.no_grad():
            wrapper.start_forward(batch)
            positions = torch.tensor(batch.positions, dtype=torch.int64)  # [T]
            tables = {t: rope.tables(positions, self.dtype) for t, rope in self.ropes.items()}
            x = self._embed(ids)  # x: [T, E]
            for i, layer in enumerate(self.weights.layers):
                x = self._block(i, layer, x, tables[self.types[i]], wrapper)
            if rows is not None:
                x = x[rows]
            return self._logits(x)

    __call__ = forward

    def forward_full(
        self, tokens: torch.Tensor | Sequence[int], *, outputs: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Logits ``[T, V]`` of one sequence at positions 0..T-1 with no cache (the reference):
        sliding layers see the ``sliding_window`` tokens up to each row, global ones all."""
        ids = token_ids(tokens, None, self.config.vocab_size)
        t = len(ids)
        rows = output_rows(outputs, t)
        c = self.config
        with torch.no_grad():
            positions = torch.arange(t)
            tables = {k: rope.tables(positions, self.dtype) for k, rope in self.ropes.items()}
            causal = torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]
            masks = {GLOBAL: causal, SLIDING: causal.triu(-(c.sliding_window - 1))}
            x = self._embed(ids)
            for i, layer in enumerate(self.weights.layers):
                kind = self.types[i]
                q, k, v = self._qkv(layer, x, *tables[kind])
                out = grouped_attention(q, k, v, masks[kind], c.scale)  # [T, Hq, D]
                x = self._after_attention(layer, x, out)
            return self._logits(x if rows is None else x[rows])

    # ---- pieces ----------------------------------------------------------------------
    def _check_cache(self, cache: Cache) -> WrapperCache:
        """The wrapper of a sliding cache with this model's window and a full one."""
        parts = getattr(cache, "caches", ())
        if (
            not isinstance(cache, WrapperCache)
            or len(parts) != 2
            or getattr(parts[SLIDING], "window", None) != self.config.window
            or getattr(parts[GLOBAL], "window", 0) is not None
        ):
            raise InvalidArgumentError(
                "cache",
                type(cache).__name__,
                f"a WrapperCache(sliding CausalCache with window={self.config.window}, full "
                "CausalCache), as Gemma3.new_cache builds it",
            )
        return cache

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings scaled by sqrt(E) (rounded to the weights' dtype first, as Gemma does)."""
        scale = torch.tensor(math.sqrt(self.config.hidden_size), dtype=self.dtype)
        return embed_rows(self.weights.embed, ids) * scale

    def _qkv(
        self, layer: Gemma3Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k, v ``[T, Hkv, D]`` of the residual ``x``: q and k per-head
        normed then rotated."""
        c = self.config
        qkv = norm_linear(x, layer.attn_norm, c.rms_eps, layer.wqkv)
        norms = (layer.q_norm, layer.k_norm)
        split = split_heads(qkv, c.num_heads, c.num_kv_heads, cos, sin, norms=norms, eps=c.rms_eps)
        if split is not None:
            return split
        t, d = qkv.shape[0], c.head_dim
        nq, nk = c.num_heads * d, c.num_kv_heads * d
        q = rms_norm(qkv[:, :nq].reshape(t, c.num_heads, d), layer.q_norm, c.rms_eps)
        k = rms_norm(qkv[:, nq : nq + nk].reshape(t, c.num_kv_heads, d), layer.k_norm, c.rms_eps)
        v = qkv[:, nq + nk :].view(t, c.num_kv_heads, d)
        return Rope.rotate(q, cos, sin), Rope.rotate(k, cos, sin), v

    def _block(
        self,
        index: int,
        layer: Gemma3Layer,
        x: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        cache: WrapperCache,
    ) -> torch.Tensor:
        """One block through the cache part of its layer type."""
        q, k, v = self._qkv(layer, x, *tables)
        cache.set_layer_type(self.types[index])
        out = cache.attention(index, q, k, v, scale=self.config.scale)  # [T, Hq, D]
        return self._after_attention(layer, x, out)

    def _after_attention(
        self, layer: Gemma3Layer, x: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Output projection, post-attention norm and residual, then the normed MLP branch."""
        c = self.config
        attn = linear(out.reshape(x.shape[0], -1), layer.wo)  # [T, E]
        x = x + rms_norm(attn, layer.post_attn_norm, c.rms_eps)
        gate_up = norm_linear(x, layer.mlp_norm, c.rms_eps, layer.w_gate_up)  # [T, 2F]
        f = c.intermediate_size
        hidden = F.gelu(gate_up[:, :f], approximate="tanh").mul_(gate_up[:, f:])  # [T, F]
        return x + rms_norm(linear(hidden, layer.w_down), layer.post_mlp_norm, c.rms_eps)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the tied LM head: logits ``[T, V]``."""
        return norm_linear(x, self.weights.norm, self.config.rms_eps, self.weights.embed)

    def _check_shapes(self) -> None:
        c, w = self.config, self.weights
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        expect = {
            "embed": (w.embed, (c.vocab_size, c.hidden_size)),
            "norm": (w.norm, (c.hidden_size,)),
        }
        for i, layer in enumerate(w.layers):
            p = f"layers[{i}]."
            expect[p + "wqkv"] = (layer.wqkv, (qkv_rows, c.hidden_size))
            expect[p + "q_norm"] = (layer.q_norm, (c.head_dim,))
            expect[p + "k_norm"] = (layer.k_norm, (c.head_dim,))
            expect[p + "wo"] = (layer.wo, (c.hidden_size, c.num_heads * c.head_dim))
            expect[p + "w_gate_up"] = (layer.w_gate_up, (2 * c.intermediate_size, c.hidden_size))
            expect[p + "w_down"] = (layer.w_down, (c.hidden_size, c.intermediate_size))
        for name, (tensor, shape) in expect.items():
            if tuple(tensor.shape) != shape:
                raise DimensionMismatchError(shape, tuple(tensor.shape), f"weight {name}")
        if len(w.layers) != c.num_layers:
            raise DimensionMismatchError(c.num_layers, len(w.layers), "number of layers")


def _load_layer(gguf: GGUFFile, i: int, reader: WeightReader) -> Gemma3Layer:
    """Block ``i`` from ``blk.{i}.*``: Q/K/V and gate/up fused by rows. Gemma's RoPE rotates
    halves in llama.cpp too (NEOX), so its Q/K rows are stored unpermuted."""
    p = f"blk.{i}."

    def get(name: str) -> torch.Tensor:
        return reader.vector(gguf, p + name + ".weight")

    def matrix(name: str) -> Weight:
        return reader.matrix(gguf, p + name + ".weight")

    return Gemma3Layer(
        attn_norm=get("attn_norm"),
        wqkv=kernel_rows(stack_rows([matrix("attn_q"), matrix("attn_k"), matrix("attn_v")])),
        q_norm=get("attn_q_norm"),
        k_norm=get("attn_k_norm"),
        wo=kernel_rows(matrix("attn_output")),
        post_attn_norm=get("post_attention_norm"),
        mlp_norm=get("ffn_norm"),
        w_gate_up=kernel_rows(stack_rows([matrix("ffn_gate"), matrix("ffn_up")])),
        w_down=kernel_rows(matrix("ffn_down")),
        post_mlp_norm=get("post_ffw_norm"),
    )

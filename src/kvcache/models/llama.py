"""A Llama-family decoder (SmolLM2) that keeps its K/V in a caller-owned cell cache.

Layout: activations are token-major, ``x: [T, E]`` for the T tokens of one forward, which may
mix prefill chunks and decode tokens of many sequences (a :class:`~kvcache.Batch` says which
position of which sequence each row is). Per layer the fused projection gives
``qkv: [T, (Hq + 2 Hkv) D]``; RoPE rotates q and k together (q alone for a cache that stores
keys before RoPE: it takes k as it is, ``keys_rotated=False``); then attention is the cache's
operation: ``cache.attention(layer, q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D]`` stores
k, v and attends each row to its own sequence's cells (``kvcache.kernels``). Query head ``h``
reads KV head ``h // G`` (HuggingFace's ``repeat_kv`` order, ``G = Hq / Hkv``).

Weights come in three kinds (``from_gguf(weights=...)``): ``native``, the GGUF's blocks as
stored (a :class:`~kvcache.kernels.qlinear.QuantizedWeight` per matrix, fused matrices as its
parts, norms float32, activations float32); ``fp32``, every tensor dequantized to ``dtype``
(the reference of the equality tests); ``bf16``, dequantized to bfloat16.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.errors import DimensionMismatchError, InvalidArgumentError, NotSupportedError
from kvcache.kernels.linear import add_linear, linear, norm_linear, rms_norm, swiglu
from kvcache.kernels.qlinear import QuantizedWeight
from kvcache.kernels.reference import grouped_attention
from kvcache.kernels.rows import split_heads
from kvcache.models.rope import Rope
from kvcache.protocol import Cache
from kvcache.weights.gguf import (
    GGUFFile,
    Weight,
    kernel_rows,
    smollm2_path,
    stack_rows,
    unpermute_rope_rows,
)

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
WeightKind = Literal["native", "fp32", "bf16"]
WEIGHT_KINDS: tuple[WeightKind, ...] = ("native", "fp32", "bf16")


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 2048
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, getattr(self, name), "an int >= 1")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                "num_kv_heads", self.num_kv_heads, f"a divisor of num_heads={self.num_heads}"
            )

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> LlamaConfig:
        """Hyper-parameters from ``llama.*`` metadata (llama.cpp's key names)."""
        gguf.require_architecture("llama")
        scaling = gguf.get("llama.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise NotSupportedError(
                f"{gguf.path.name}: llama.rope.scaling.type={scaling!r} is not supported; "
                "expected 'none'"
            )
        hidden = int(gguf.require("llama.embedding_length"))
        heads = int(gguf.require("llama.attention.head_count"))
        vocab = gguf.get("llama.vocab_size")
        if vocab is None:
            vocab = len(gguf.require("tokenizer.ggml.tokens"))
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(gguf.require("llama.feed_forward_length")),
            num_layers=int(gguf.require("llama.block_count")),
            num_heads=heads,
            num_kv_heads=int(gguf.get("llama.attention.head_count_kv", heads)),
            head_dim=int(gguf.get("llama.attention.key_length", hidden // heads)),
            rope_theta=float(gguf.get("llama.rope.freq_base", 10000.0)),
            rms_eps=float(gguf.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(gguf.get("llama.context_length", 2048)),
            tie_embeddings=not gguf.has_tensor("output.weight"),
        )


@dataclass
class LlamaLayer:
    """Weights of one decoder block, projections fused ([out, in] like ``nn.Linear``)."""

    attn_norm: torch.Tensor  # [E]
    wqkv: Weight  # [(Hq + 2 Hkv) D, E]
    wo: Weight  # [E, Hq D]
    mlp_norm: torch.Tensor  # [E]
    w_gate_up: Weight  # [2 F, E]
    w_down: Weight  # [E, F]


@dataclass
class LlamaWeights:
    """All weights; ``lm_head`` is the embedding weight itself when they are tied."""

    embed: Weight  # [V, E]
    layers: list[LlamaLayer]
    norm: torch.Tensor  # [E]
    lm_head: Weight  # [V, E]


class Llama:
    """Llama decoder over a caller-owned cache; the model itself holds weights only."""

    def __init__(self, config: LlamaConfig, weights: LlamaWeights) -> None:
        self.config = config
        self.weights = weights
        self.dtype = weights_dtype(weights.embed)
        self.rope = Rope(config.head_dim, config.rope_theta)
        self.source = "random"  # where the weights came from (from_gguf: the file's name)
        self._model_id: str | None = None
        self._check_shapes()

    def output_projections(self) -> list[tuple[torch.Tensor, int]]:
        """Each layer's attention output projection Wo [E, Hq * D] and the head size D
        (what a press that weighs cells by their effect on the output reads)."""
        return [(dense(layer.wo), self.config.head_dim) for layer in self.weights.layers]

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights hold (the tied LM head once)."""
        w = self.weights
        every = [w.embed, w.lm_head, w.norm]
        for layer in w.layers:
            every += [layer.attn_norm, layer.wqkv, layer.wo, layer.mlp_norm]
            every += [layer.w_gate_up, layer.w_down]
        return held_bytes(every)

    @property
    def model_id(self) -> str:
        """Which model made a cache's K/V (snapshots refuse another's): the weights' source,
        dtype, kind and a SHA-256 of the config and samples of the weights (taken on first use)."""
        if self._model_id is None:
            w = self.weights
            samples = [head_rows(w.embed, 4), w.norm, head_rows(w.lm_head, -4)]
            for layer in (w.layers[0], w.layers[-1]):
                samples += [head_rows(layer.wqkv, 2), head_rows(layer.wo, 2)]
                samples += [head_rows(layer.w_down, 2), layer.attn_norm]
            self._model_id = fingerprint(
                self.source, self.dtype, asdict(self.config), samples, native=self.native
            )
        return self._model_id

    @property
    def native(self) -> bool:
        """Whether the matrices are GGUF blocks as stored (``weights="native"``)."""
        return isinstance(self.weights.embed, QuantizedWeight)

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_gguf(
        cls,
        path: str | Path | GGUFFile | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        weights: WeightKind = "native",
    ) -> Llama:
        """Load a Llama GGUF (None = the bundled SmolLM2-135M-Instruct): its blocks as stored
        (``native``), or dequantized to ``dtype`` (``fp32``; float64 for references) or to
        bfloat16 (``bf16``)."""
        reader = WeightReader.of(weights, dtype)
        if isinstance(path, GGUFFile):
            return cls._load(path, reader)
        with GGUFFile(smollm2_path() if path is None else path) as gguf:
            gguf.release("tokenizer.")  # not ours to read: free it before the weights arrive
            return cls._load(gguf, reader)

    @classmethod
    def _load(cls, gguf: GGUFFile, reader: WeightReader) -> Llama:
        config = LlamaConfig.from_gguf(gguf)
        # the embedding first: its dequantization peaks while little else is resident
        embed = kernel_rows(reader.matrix(gguf, "token_embd.weight"))  # also the tied LM head
        layers = [_load_layer(gguf, config, i, reader) for i in range(config.num_layers)]
        lm_head = embed
        if not config.tie_embeddings:
            lm_head = kernel_rows(reader.matrix(gguf, "output.weight"))
        norm = reader.vector(gguf, "output_norm.weight")
        model = cls(config, LlamaWeights(embed, layers, norm, lm_head))
        model.source = gguf.path.name
        return model

    @classmethod
    def random(
        cls, config: LlamaConfig, *, seed: int = 0, dtype: torch.dtype = torch.float64
    ) -> Llama:
        """Random weights scaled so activations stay O(1): exactness tests need no download."""
        check_dtype(dtype)
        g = torch.Generator().manual_seed(seed)
        c = config
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim

        def mat(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g, dtype=torch.float64) / math.sqrt(cols)).to(
                dtype
            )

        def norm() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(c.hidden_size, generator=g, dtype=torch.float64)).to(
                dtype
            )

        layers = [
            LlamaLayer(
                attn_norm=norm(),
                wqkv=mat(qkv_rows, c.hidden_size),
                wo=mat(c.hidden_size, c.num_heads * c.head_dim),
                mlp_norm=norm(),
                w_gate_up=mat(2 * c.intermediate_size, c.hidden_size),
                w_down=mat(c.hidden_size, c.intermediate_size),
            )
            for _ in range(c.num_layers)
        ]
        embed = mat(c.vocab_size, c.hidden_size) * math.sqrt(c.hidden_size)
        lm_head = embed if c.tie_embeddings else mat(c.vocab_size, c.hidden_size)
        return cls(config, LlamaWeights(embed, layers, norm(), lm_head))

    def new_cache(
        self,
        capacity: int,
        *,
        max_sequences: int = 1,
        max_batch: int | None = None,
        window: int | None = None,
        codec: str | None = None,
    ) -> CausalCache:
        """A causal cache for this model: its dtype, RoPE as the shift of middle removals,
        and ``codec`` (a registry spec such as "int8" or "int8/int4"; None: the dtype);
        stamped with ``model_id`` so its snapshots refuse another model's cache."""
        cache = CausalCache(
            capacity,
            max_sequences=max_sequences,
            max_batch=max_batch,
            window=window,
            shift=self.rope,
            dtype=self.dtype,
            codec=codec,
        )
        cache.model_id = self.model_id  # its snapshots name this model
        return cache

    # ---- forward ---------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor | Sequence[int],
        batch: Batch,
        cache: Cache,
        *,
        outputs: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(outputs), V]`` (all rows when None) of a batch of many sequences.

        ``outputs`` lists the batch rows whose logits are wanted (the LM head is a fifth of
        the weights: a prefill chunk needs at most its last row, or none).
        """
        ids = token_ids(tokens, len(batch), self.config.vocab_size)
        rows = output_rows(outputs, len(batch))
        with torch.no_grad():
            cache.start_forward(batch)
            positions = torch.tensor(batch.positions, dtype=torch.int64)  # [T]
            cos, sin = self.rope.tables(positions, self.dtype)  # [T, 1, D] each
            x = embed_rows(self.weights.embed, ids)  # x: [T, E]
            for i, layer in enumerate(self.weights.layers):
                x = self._block(i, layer, x, cos, sin, cache)
            if rows is not None:
                x = x[rows]
            return self._logits(x)

    __call__ = forward

    def forward_full(
        self,
        tokens: torch.Tensor | Sequence[int],
        *,
        window: int | None = None,
        outputs: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[T, V]`` of one sequence at positions 0..T-1 with no cache (the reference).

        ``window`` W limits each token to the W before it (and itself), as a window cache does;
        ``outputs`` picks rows as in :meth:`forward`.
        """
        ids = token_ids(tokens, None, self.config.vocab_size)
        t = len(ids)
        rows = output_rows(outputs, t)
        c = self.config
        with torch.no_grad():
            cos, sin = self.rope.tables(torch.arange(t), self.dtype)
            causal = torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]
            if window is not None:
                causal &= torch.ones(t, t, dtype=torch.bool).triu(-window)
            x = embed_rows(self.weights.embed, ids)  # x: [T, E]
            for layer in self.weights.layers:
                q, k, v = self._qkv(layer, rms_norm(x, layer.attn_norm, c.rms_eps), cos, sin)
                out = grouped_attention(q, k, v, causal)  # [T, Hq, D]
                x = x + reference_linear(out.reshape(t, -1), layer.wo)
                x = x + reference_linear(self._swiglu(layer, x), layer.w_down)
            return self._logits(x if rows is None else x[rows])

    # ---- pieces ----------------------------------------------------------------------
    def _block(
        self,
        index: int,
        layer: LlamaLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Cache,
    ) -> torch.Tensor:
        """One decoder block through the cache: attention then MLP (``kernels.linear`` for
        decode-sized steps, residuals fused in addmm for prompts)."""
        c = self.config
        attention = getattr(cache, "attention", None)
        if attention is None:
            raise NotSupportedError(
                f"{type(cache).__name__} has no attention(layer, q, k, v): Llama needs a "
                "causal cache (CausalCache, or a WrapperCache routing to one)"
            )
        # a cache storing keys before RoPE takes them so (not rotated here and back there)
        rotated = getattr(cache, "key_rope", "post") != "pre"
        h = norm_linear(x, layer.attn_norm, c.rms_eps, layer.wqkv)
        q, k, v = self._split_qkv(h, cos, sin, rotate_keys=rotated)
        if rotated:
            out = attention(index, q, k, v)  # [T, Hq, D]
        else:
            out = attention(index, q, k, v, keys_rotated=False)
        x = add_linear(x, out.reshape(x.shape[0], -1), layer.wo)  # x: [T, E]
        gate_up = norm_linear(x, layer.mlp_norm, c.rms_eps, layer.w_gate_up)  # [T, 2F]
        return add_linear(x, gate_up, layer.w_down, glu=True)  # + silu(gate) * up @ w_down^T

    def _qkv(
        self, layer: LlamaLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` of the normed rows ``h``."""
        return self._split_qkv(linear(h, layer.wqkv), cos, sin)

    def _split_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate_keys: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the fused projection ``qkv`` [T, (Hq + 2 Hkv) D]; q and k rotated in
        one RoPE call (q alone when not ``rotate_keys``)."""
        c = self.config
        split = split_heads(qkv, c.num_heads, c.num_kv_heads, cos, sin, rotate_keys=rotate_keys)
        if split is not None:
            return split
        t, d = qkv.shape[0], c.head_dim
        n_qk = c.num_heads + c.num_kv_heads
        n_rot = n_qk if rotate_keys else c.num_heads
        rotated = self.rope.rotate(qkv[:, : n_rot * d].view(t, n_rot, d), cos, sin)
        if rotate_keys:
            k = rotated[:, c.num_heads :]
        else:
            k = qkv[:, c.num_heads * d : n_qk * d].view(t, c.num_kv_heads, d)
        v = qkv[:, n_qk * d :].view(t, c.num_kv_heads, d)
        return rotated[:, : c.num_heads], k, v

    def _swiglu(self, layer: LlamaLayer, x: torch.Tensor) -> torch.Tensor:
        """The MLP's hidden activation ``[T, F]`` of the normed residual (before w_down)."""
        c = self.config
        return swiglu(linear(rms_norm(x, layer.mlp_norm, c.rms_eps), layer.w_gate_up))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: logits ``[T, V]``."""
        return norm_linear(x, self.weights.norm, self.config.rms_eps, self.weights.lm_head)

    def _check_shapes(self) -> None:
        c, w = self.config, self.weights
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        expect = {
            "embed": (w.embed, (c.vocab_size, c.hidden_size)),
            "lm_head": (w.lm_head, (c.vocab_size, c.hidden_size)),
            "norm": (w.norm, (c.hidden_size,)),
        }
        for i, layer in enumerate(w.layers):
            expect[f"layers[{i}].wqkv"] = (layer.wqkv, (qkv_rows, c.hidden_size))
            expect[f"layers[{i}].wo"] = (layer.wo, (c.hidden_size, c.num_heads * c.head_dim))
            expect[f"layers[{i}].w_gate_up"] = (
                layer.w_gate_up,
                (2 * c.intermediate_size, c.hidden_size),
            )
            expect[f"layers[{i}].w_down"] = (layer.w_down, (c.hidden_size, c.intermediate_size))
        for name, (tensor, shape) in expect.items():
            if tuple(tensor.shape) != shape:
                raise DimensionMismatchError(shape, tuple(tensor.shape), f"weight {name}")
        if len(w.layers) != c.num_layers:
            raise DimensionMismatchError(c.num_layers, len(w.layers), "number of layers")


def fingerprint(
    source: str,
    dtype: torch.dtype,
    config: dict[str, object],
    samples: list[torch.Tensor],
    *,
    native: bool = False,
) -> str:
    """A model's id: its source, dtype (and ``native`` for blocks as stored) and a SHA-256 of
    its config and samples of its weights."""
    h = hashlib.sha256(repr(sorted(config.items())).encode())
    for t in samples:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    kind = ":native" if native else ""
    return f"{source}:{dtype}{kind}:{h.hexdigest()[:16]}"


# ---- weights of either kind -------------------------------------------------------------
@dataclass(frozen=True)
class WeightReader:
    """How a loader reads a GGUF's tensors for one weight kind (matrices and vectors apart)."""

    kind: WeightKind
    dtype: torch.dtype  # of the vectors (norms) and of dequantized matrices

    @classmethod
    def of(cls, weights: str, dtype: torch.dtype) -> WeightReader:
        """The reader of kind ``weights``: ``fp32`` honours ``dtype``; ``native`` runs in
        float32 and ``bf16`` in bfloat16, so they take dtype float32 (their default) only."""
        check_dtype(dtype)
        if weights not in WEIGHT_KINDS:
            raise InvalidArgumentError("weights", weights, f"one of {list(WEIGHT_KINDS)}")
        if weights == "fp32":
            return cls("fp32", dtype)
        if dtype != torch.float32:
            raise InvalidArgumentError(
                "dtype", dtype, f"torch.float32 with weights={weights!r} (use weights='fp32')"
            )
        return cls(weights, torch.bfloat16 if weights == "bf16" else torch.float32)

    def matrix(self, gguf: GGUFFile, name: str) -> Weight:
        """A matrix [out, in]: blocks as stored (native) or dequantized."""
        return gguf.weight(name) if self.kind == "native" else gguf.tensor(name, self.dtype)

    def vector(self, gguf: GGUFFile, name: str) -> torch.Tensor:
        """A norm's weight (floats in every kind)."""
        return gguf.tensor(name, self.dtype)


def weights_dtype(embed: Weight) -> torch.dtype:
    """The activations' dtype of a model whose embedding is ``embed`` (blocks: float32)."""
    return torch.float32 if isinstance(embed, QuantizedWeight) else embed.dtype


def held_bytes(weights: Sequence[Weight]) -> int:
    """Bytes held by ``weights``, each object once (a tied LM head is the embedding)."""
    unique = {id(w): w for w in weights}.values()
    return sum(
        w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size() for w in unique
    )


def head_rows(weight: Weight, n: int) -> torch.Tensor:
    """The first ``n`` rows (last ``-n`` when negative) for a fingerprint: a QuantizedWeight's
    are its blocks' bytes."""
    if isinstance(weight, torch.Tensor):
        return weight[:n] if n > 0 else weight[n:]
    part = weight.parts[0 if n > 0 else -1]
    rows = part.data.shape[0]
    return part.gguf_bytes(0, n) if n > 0 else part.gguf_bytes(rows + n, rows)


def dense(weight: Weight) -> torch.Tensor:
    """The weight as a float tensor (blocks dequantized to float32: a copy the caller holds)."""
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


def embed_rows(embed: Weight, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows ``[T, E]`` of ``ids``: blocks dequantize only the rows looked up."""
    if isinstance(embed, QuantizedWeight):
        return embed.rows(ids)
    return F.embedding(ids, embed)


def reference_linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """The no-cache reference's product: torch's ``F.linear`` on the float weight (blocks
    dequantized: float32 activations, no int8 step)."""
    return F.linear(x, dense(weight))


def token_ids(
    tokens: torch.Tensor | Sequence[int], expected: int | None, vocab_size: int
) -> torch.Tensor:
    """Validated token ids ``[T]`` (int64): one per batch row when ``expected`` is given."""
    ids = torch.as_tensor(tokens, dtype=torch.int64)
    if ids.dim() != 1 or len(ids) == 0:
        raise DimensionMismatchError("[T] with T >= 1", tuple(ids.shape), "tokens shape")
    if expected is not None and len(ids) != expected:
        raise DimensionMismatchError(expected, len(ids), "tokens (one per batch position)")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidArgumentError("tokens", bad, f"token ids in [0, {vocab_size})")
    return ids


def output_rows(outputs: Sequence[int] | None, t: int) -> torch.Tensor | None:
    """Batch rows whose logits are wanted (None = every row)."""
    if outputs is None:
        return None
    rows = torch.as_tensor(list(outputs), dtype=torch.int64)
    if len(rows) == 0:
        return rows  # a prefill chunk that ends nothing: no LM head at all
    if rows.dim() != 1 or int(rows.min()) < 0 or int(rows.max()) >= t:
        raise InvalidArgumentError("outputs", list(outputs), f"batch rows in [0, {t})")
    return rows


def check_dtype(dtype: object) -> None:
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError("dtype", dtype, f"one of {FLOAT_DTYPES}")


def _load_layer(gguf: GGUFFile, config: LlamaConfig, i: int, reader: WeightReader) -> LlamaLayer:
    """Block ``i`` from ``blk.{i}.*``: Q/K rows un-permuted, projections fused by rows."""
    p = f"blk.{i}."

    def matrix(name: str) -> Weight:
        return reader.matrix(gguf, p + name + ".weight")

    q = unpermute_rope_rows(matrix("attn_q"), config.num_heads)
    k = unpermute_rope_rows(matrix("attn_k"), config.num_kv_heads)
    return LlamaLayer(
        attn_norm=reader.vector(gguf, p + "attn_norm.weight"),
        wqkv=kernel_rows(stack_rows([q, k, matrix("attn_v")])),
        wo=kernel_rows(matrix("attn_output")),
        mlp_norm=reader.vector(gguf, p + "ffn_norm.weight"),
        w_gate_up=kernel_rows(stack_rows([matrix("ffn_gate"), matrix("ffn_up")])),
        w_down=kernel_rows(matrix("ffn_down")),
    )

"""A Llama-family decoder (SmolLM2) that keeps its K/V in a caller-owned cell cache.

Layout: activations are token-major, ``x: [T, E]`` for the T tokens of one forward, which may
mix prefill chunks and decode tokens of many sequences (a :class:`~kvcache.Batch` says which
position of which sequence each row is). Per layer the fused projection gives
``qkv: [T, (Hq + 2 Hkv) D]``; RoPE rotates q and k together (q alone for a cache that stores
keys before RoPE: it takes k as it is, ``keys_rotated=False``); then attention is the cache's
operation: ``cache.attention(layer, q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D]`` stores
k, v and attends each row to its own sequence's cells (``kvcache.kernels``). Query head ``h``
reads KV head ``h // G`` (HuggingFace's ``repeat_kv`` order, ``G = Hq / Hkv``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.errors import DimensionMismatchError, InvalidArgumentError, NotSupportedError
from kvcache.kernels.linear import add_linear, linear, norm_linear, rms_norm, swiglu
from kvcache.kernels.reference import grouped_attention
from kvcache.models.rope import Rope
from kvcache.protocol import Cache
from kvcache.weights.gguf import GGUFFile, smollm2_path, unpermute_rope_rows

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, E]
    wo: torch.Tensor  # [E, Hq D]
    mlp_norm: torch.Tensor  # [E]
    w_gate_up: torch.Tensor  # [2 F, E]
    w_down: torch.Tensor  # [E, F]


@dataclass
class LlamaWeights:
    """All weights; ``lm_head`` is the embedding tensor itself when they are tied."""

    embed: torch.Tensor  # [V, E]
    layers: list[LlamaLayer]
    norm: torch.Tensor  # [E]
    lm_head: torch.Tensor  # [V, E]


class Llama:
    """Llama decoder over a caller-owned cache; the model itself holds weights only."""

    def __init__(self, config: LlamaConfig, weights: LlamaWeights) -> None:
        self.config = config
        self.weights = weights
        self.dtype = weights.embed.dtype
        self.rope = Rope(config.head_dim, config.rope_theta)
        self.source = "random"  # where the weights came from (from_gguf: the file's name)
        self._model_id: str | None = None
        self._check_shapes()

    def output_projections(self) -> list[tuple[torch.Tensor, int]]:
        """Each layer's attention output projection Wo [E, Hq * D] and the head size D
        (what a press that weighs cells by their effect on the output reads)."""
        return [(layer.wo, self.config.head_dim) for layer in self.weights.layers]

    @property
    def model_id(self) -> str:
        """Which model made a cache's K/V (snapshots refuse another's): the weights' source,
        dtype and a SHA-256 of the config and samples of the weights (taken on first use)."""
        if self._model_id is None:
            w = self.weights
            samples = [w.embed[:4], w.norm, w.lm_head[-4:]]
            for layer in (w.layers[0], w.layers[-1]):
                samples += [layer.wqkv[:2], layer.wo[:2], layer.w_down[:2], layer.attn_norm]
            self._model_id = fingerprint(self.source, self.dtype, asdict(self.config), samples)
        return self._model_id

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_gguf(
        cls, path: str | Path | GGUFFile | None = None, dtype: torch.dtype = torch.float32
    ) -> Llama:
        """Load a Llama GGUF (None = the bundled SmolLM2-135M-Instruct), dequantized to ``dtype``."""
        check_dtype(dtype)
        if isinstance(path, GGUFFile):
            return cls._load(path, dtype)
        with GGUFFile(smollm2_path() if path is None else path) as gguf:
            gguf.release("tokenizer.")  # not ours to read: free it before the weights arrive
            return cls._load(gguf, dtype)

    @classmethod
    def _load(cls, gguf: GGUFFile, dtype: torch.dtype) -> Llama:
        config = LlamaConfig.from_gguf(gguf)
        # the embedding first: its dequantization peaks while little else is resident
        embed = gguf.tensor("token_embd.weight", dtype)
        layers = [_load_layer(gguf, config, i, dtype) for i in range(config.num_layers)]
        lm_head = embed if config.tie_embeddings else gguf.tensor("output.weight", dtype)
        norm = gguf.tensor("output_norm.weight", dtype)
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
            x = F.embedding(ids, self.weights.embed)  # x: [T, E]
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
            x = F.embedding(ids, self.weights.embed)  # x: [T, E]
            for layer in self.weights.layers:
                q, k, v = self._qkv(layer, rms_norm(x, layer.attn_norm, c.rms_eps), cos, sin)
                out = grouped_attention(q, k, v, causal)  # [T, Hq, D]
                x = x + F.linear(out.reshape(t, -1), layer.wo)
                x = x + F.linear(self._swiglu(layer, x), layer.w_down)
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
    source: str, dtype: torch.dtype, config: dict[str, object], samples: list[torch.Tensor]
) -> str:
    """A model's id: its source, dtype and a SHA-256 of its config and samples of its weights."""
    h = hashlib.sha256(repr(sorted(config.items())).encode())
    for t in samples:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return f"{source}:{dtype}:{h.hexdigest()[:16]}"


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


def _load_layer(gguf: GGUFFile, config: LlamaConfig, i: int, dtype: torch.dtype) -> LlamaLayer:
    """Block ``i`` from ``blk.{i}.*``: Q/K rows un-permuted, projections concatenated."""
    p = f"blk.{i}."
    q = unpermute_rope_rows(gguf.tensor(p + "attn_q.weight", dtype), config.num_heads)
    k = unpermute_rope_rows(gguf.tensor(p + "attn_k.weight", dtype), config.num_kv_heads)
    v = gguf.tensor(p + "attn_v.weight", dtype)
    gate = gguf.tensor(p + "ffn_gate.weight", dtype)
    up = gguf.tensor(p + "ffn_up.weight", dtype)
    return LlamaLayer(
        attn_norm=gguf.tensor(p + "attn_norm.weight", dtype),
        wqkv=torch.cat((q, k, v)),
        wo=gguf.tensor(p + "attn_output.weight", dtype),
        mlp_norm=gguf.tensor(p + "ffn_norm.weight", dtype),
        w_gate_up=torch.cat((gate, up)),
        w_down=gguf.tensor(p + "ffn_down.weight", dtype),
    )

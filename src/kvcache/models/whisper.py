"""Whisper (encoder-decoder speech model) in plain torch, decoding on the library's caches.

Encoder: mel [B, n_mels, 3000] -> 2 convolutions (GELU, stride 2) + sinusoidal positions ->
pre-norm blocks -> [B, 1500, n_state]. Decoder: token + learned positional embedding ->
pre-norm blocks (causal self-attention, cross-attention to the encoder, MLP) -> logits
against the token embedding (tied output projection, one matmul).

This file holds the model, its weights and loaders and the uncached forwards (the reference);
the cached decoding on the library's caches is :mod:`kvcache.models.whisper_decode`, whose
public names are importable from here too (their documented home).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvcache.errors import DimensionMismatchError, InvalidArgumentError, NotSupportedError
from kvcache.kernels.linear import linear

if TYPE_CHECKING:
    from kvcache.models.whisper_decode import (
        WhisperKVCache,
        forward_decoder_cached,
        forward_decoder_step,
    )

__all__ = [
    "Whisper",
    "WhisperConfig",
    "WhisperKVCache",
    "forward_decoder_cached",
    "forward_decoder_step",
]
# the documented home of the cached decoding names; they live in whisper_decode (which imports
# this module), so they are looked up there on first use instead of imported here (a cycle)
_DECODE_NAMES = frozenset({"WhisperKVCache", "forward_decoder_cached", "forward_decoder_step"})


def __getattr__(name: str) -> object:
    """``WhisperKVCache``, ``forward_decoder_cached``, ``forward_decoder_step`` from
    :mod:`kvcache.models.whisper_decode`, where the cached decoding lives."""
    if name in _DECODE_NAMES:
        return getattr(importlib.import_module("kvcache.models.whisper_decode"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- configuration -----------------------------------------------------------------------
@dataclass(frozen=True)
class WhisperConfig:
    """Model dimensions (OpenAI's names); ``tiny_en()`` is the bundled model."""

    n_mels: int = 80
    n_audio_ctx: int = 1500
    n_audio_state: int = 384
    n_audio_head: int = 6
    n_audio_layer: int = 4
    n_vocab: int = 51864
    n_text_ctx: int = 448
    n_text_state: int = 384
    n_text_head: int = 6
    n_text_layer: int = 4

    @classmethod
    def tiny_en(cls) -> WhisperConfig:
        """Whisper tiny.en: 4+4 layers of width 384, 6 heads, English-only vocabulary."""
        return cls()

    def init(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> Whisper:
        """A model with random weights of this shape (tests, benchmarks of the mechanics)."""
        return _random_whisper(self, dtype, torch.Generator().manual_seed(seed))


# ---- weights -----------------------------------------------------------------------------
@dataclass
class Linear:
    """y = x W^T + b with W [out, in]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # decode-sized x: kernels.linear


@dataclass
class LayerNorm:
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float = 1e-5

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


@dataclass
class Conv1d:
    weight: torch.Tensor  # [out, in, 3]
    bias: torch.Tensor
    stride: int = 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, self.bias, stride=self.stride, padding=1)


@dataclass
class EncoderBlock:
    attn_ln: LayerNorm
    qkv: Linear  # fused [3 n, n]
    out: Linear
    mlp_ln: LayerNorm
    fc1: Linear
    fc2: Linear


@dataclass
class DecoderBlock:
    attn_ln: LayerNorm
    qkv: Linear  # fused self-attention Q|K|V [3 n, n]
    out: Linear
    cross_ln: LayerNorm
    cross_q: Linear
    cross_kv: Linear  # fused cross-attention K|V [2 n, n]
    cross_out: Linear
    mlp_ln: LayerNorm
    fc1: Linear
    fc2: Linear


@dataclass
class Whisper:
    """Whisper's weights and its uncached forwards (cached steps: ``whisper_decode``)."""

    config: WhisperConfig
    conv1: Conv1d
    conv2: Conv1d
    audio_pos: torch.Tensor  # [n_audio_ctx, n]
    encoder: list[EncoderBlock]
    encoder_ln: LayerNorm
    token_emb: torch.Tensor  # [n_vocab, n]; also the LM head
    text_pos: torch.Tensor  # [n_text_ctx, n]
    decoder: list[DecoderBlock]
    decoder_ln: LayerNorm
    cross_kv_all: Linear = field(init=False)  # [L * 2n, n]: every layer's cross K|V

    def __post_init__(self) -> None:
        """Fuse every layer's cross K|V projection into one [L * 2n, n] matrix (the layers'
        own weights become views of it), so a cache's cross K/V take one matmul. The token
        embedding is kept contiguous: the output projection of a decode step (a few rows
        against 80 MB) runs in ``kernels.linear``, which reads it row by row."""
        self.token_emb = self.token_emb.contiguous()
        blocks = self.decoder
        self.cross_kv_all = Linear(
            torch.cat([b.cross_kv.weight for b in blocks]),
            torch.cat([_bias(b.cross_kv) for b in blocks]),
        )
        rows = 2 * self.config.n_text_state
        for i, b in enumerate(blocks):
            assert self.cross_kv_all.bias is not None
            part = slice(i * rows, (i + 1) * rows)
            b.cross_kv = Linear(self.cross_kv_all.weight[part], self.cross_kv_all.bias[part])

    @property
    def dtype(self) -> torch.dtype:
        return self.token_emb.dtype

    @classmethod
    def from_ctranslate2(
        cls, path: str | Path | None = None, dtype: torch.dtype = torch.float32
    ) -> Whisper:
        """Load a CTranslate2 Whisper model.bin (None = the bundled tiny.en)."""
        from kvcache.weights.ctranslate2 import bundled_whisper_dir, read_model_bin

        return _from_ctranslate2(
            read_model_bin(bundled_whisper_dir() if path is None else path), dtype
        )

    # ---- encoder ---------------------------------------------------------------------
    def forward_encoder(self, mel: torch.Tensor) -> torch.Tensor:
        """Audio states [B, n_audio_ctx, n] of mel features [B, n_mels, 2 * n_audio_ctx]."""
        cfg = self.config
        want = (cfg.n_mels, 2 * cfg.n_audio_ctx)
        if mel.dim() != 3 or tuple(mel.shape[1:]) != want:
            raise DimensionMismatchError(
                f"[B, {want[0]}, {want[1]}]", tuple(mel.shape), "mel shape"
            )
        x = F.gelu(self.conv1(mel.to(self.dtype)))  # [B, n, 3000]
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, 1500, n]
        x = x + self.audio_pos
        for blk in self.encoder:
            x = x + blk.out(
                _self_attention(blk.qkv(blk.attn_ln(x)), cfg.n_audio_head, causal=False)
            )
            x = x + blk.fc2(F.gelu(blk.fc1(blk.mlp_ln(x))))
        return self.encoder_ln(x)

    def cross_kv(self, layer: int, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention K and V [A, H, S, D] of one decoder layer (one fused matmul)."""
        a, s, n = audio.shape
        h = self.config.n_text_head
        kv = self.decoder[layer].cross_kv(audio.to(self.dtype))  # [A, S, 2n]
        kv = kv.view(a, s, 2, h, n // h).permute(2, 0, 3, 1, 4)  # [2, A, H, S, D]
        return kv[0].contiguous(), kv[1].contiguous()

    def cross_kv_layers(self, audio: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Cross K and V [A, H, S, D] of every decoder layer from one fused matmul."""
        a, s, n = audio.shape
        h, layers = self.config.n_text_head, self.config.n_text_layer
        kv = self.cross_kv_all(audio.to(self.dtype))  # [A, S, L * 2n]
        kv = kv.view(a, s, layers, 2, h, n // h).permute(2, 3, 0, 4, 1, 5)  # [L, 2, A, H, S, D]
        return [(kv[i, 0].contiguous(), kv[i, 1].contiguous()) for i in range(layers)]

    # ---- uncached decoder (the reference) ----------------------------------------------
    def forward_decoder(self, tokens: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, n_vocab] of tokens [B, T] over the whole sequence, no cache."""
        cfg = self.config
        b, t = _check_tokens(tokens, cfg)
        if audio.dim() != 3 or audio.shape[0] != b or audio.shape[2] != cfg.n_text_state:
            raise DimensionMismatchError(
                f"[{b}, S, {cfg.n_text_state}]", tuple(audio.shape), "audio states"
            )
        x = self.token_emb[tokens] + self.text_pos[:t]  # [B, T, n]
        for i, blk in enumerate(self.decoder):
            x = x + blk.out(_self_attention(blk.qkv(blk.attn_ln(x)), cfg.n_text_head, causal=True))
            k, v = self.cross_kv(i, audio)  # [B, H, S, D]: recomputed every call (no cache)
            q = _heads(blk.cross_q(blk.cross_ln(x)), cfg.n_text_head)  # [B, H, T, D]
            x = x + blk.cross_out(_merge_heads(F.scaled_dot_product_attention(q, k, v)))
            x = x + blk.fc2(F.gelu(blk.fc1(blk.mlp_ln(x))))
        return F.linear(self.decoder_ln(x), self.token_emb)


def _bias(lin: Linear) -> torch.Tensor:
    if lin.bias is not None:
        return lin.bias
    return torch.zeros(lin.weight.shape[0], dtype=lin.weight.dtype)


def _check_tokens(tokens: torch.Tensor, cfg: WhisperConfig) -> tuple[int, int]:
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dim() != 2
        or tokens.dtype not in (torch.int64, torch.int32)
    ):
        raise InvalidArgumentError("tokens", tokens, "an int tensor [B, T]")
    b, t = tokens.shape
    if not 1 <= t <= cfg.n_text_ctx:
        raise InvalidArgumentError("tokens.shape[1]", t, f"1..{cfg.n_text_ctx} (n_text_ctx)")
    if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.n_vocab:
        raise InvalidArgumentError("tokens", tokens.tolist(), f"ids in 0..{cfg.n_vocab - 1}")
    return int(b), int(t)


def _heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """[B, T, n] -> [B, H, T, D]."""
    b, t, n = x.shape
    return x.view(b, t, n_head, n // n_head).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, n]."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def _self_attention(qkv: torch.Tensor, n_head: int, causal: bool) -> torch.Tensor:
    """Full-sequence attention of fused qkv [B, T, 3n] -> [B, T, n]."""
    b, t, n3 = qkv.shape
    d = n3 // (3 * n_head)
    q, k, v = qkv.view(b, t, 3, n_head, d).permute(2, 0, 3, 1, 4)  # each [B, H, T, D]
    return _merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=causal))


# ---- building models ---------------------------------------------------------------------
def _random_whisper(cfg: WhisperConfig, dtype: torch.dtype, g: torch.Generator) -> Whisper:
    if cfg.n_audio_state != cfg.n_text_state:
        raise NotSupportedError(
            "n_audio_state != n_text_state (cross-attention width) is not supported"
        )

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def lin(out: int, inp: int) -> Linear:
        return Linear(rand(out, inp, std=inp**-0.5), rand(out, std=0.02))

    def ln(n: int) -> LayerNorm:
        return LayerNorm((1 + rand(n, std=0.1)).to(dtype), rand(n, std=0.1))

    n, m = cfg.n_audio_state, cfg.n_text_state
    enc = [
        EncoderBlock(ln(n), lin(3 * n, n), lin(n, n), ln(n), lin(4 * n, n), lin(n, 4 * n))
        for _ in range(cfg.n_audio_layer)
    ]
    dec = [
        DecoderBlock(
            ln(m),
            lin(3 * m, m),
            lin(m, m),
            ln(m),
            lin(m, m),
            lin(2 * m, m),
            lin(m, m),
            ln(m),
            lin(4 * m, m),
            lin(m, 4 * m),
        )
        for _ in range(cfg.n_text_layer)
    ]
    return Whisper(
        config=cfg,
        conv1=Conv1d(rand(n, cfg.n_mels, 3, std=(3 * cfg.n_mels) ** -0.5), rand(n, std=0.02)),
        conv2=Conv1d(rand(n, n, 3, std=(3 * n) ** -0.5), rand(n, std=0.02), stride=2),
        audio_pos=sinusoids(cfg.n_audio_ctx, n).to(dtype),
        encoder=enc,
        encoder_ln=ln(n),
        token_emb=rand(cfg.n_vocab, m, std=0.1),
        text_pos=rand(cfg.n_text_ctx, m, std=0.1),
        decoder=dec,
        decoder_ln=ln(m),
    )


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's encoder positions [length, channels]: sin | cos at geometric timescales."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float64))
    t = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1).to(torch.float32)


def _from_ctranslate2(m: object, dtype: torch.dtype) -> Whisper:
    from kvcache.weights.ctranslate2 import CTranslate2Model

    assert isinstance(m, CTranslate2Model)
    if m.spec != "WhisperSpec":
        raise InvalidArgumentError(
            "path", str(m.path), f"a WhisperSpec model (this one is {m.spec!r})"
        )

    def t(name: str) -> torch.Tensor:
        return m.tensor(name, dtype)

    def lin(prefix: str, bias: bool = True) -> Linear:
        b = t(prefix + "/bias") if bias and prefix + "/bias" in m else None
        return Linear(t(prefix + "/weight"), b)

    def ln(prefix: str) -> LayerNorm:
        return LayerNorm(t(prefix + "/gamma"), t(prefix + "/beta"))

    def enc_block(p: str) -> EncoderBlock:
        return EncoderBlock(
            ln(f"{p}/self_attention/layer_norm"), lin(f"{p}/self_attention/linear_0"), lin(f"{p}/self_attention/linear_1"),
            ln(f"{p}/ffn/layer_norm"), lin(f"{p}/ffn/linear_0"), lin(f"{p}/ffn/linear_1"),
        )  # fmt: skip

    def dec_block(p: str) -> DecoderBlock:
        return DecoderBlock(
            ln(f"{p}/self_attention/layer_norm"), lin(f"{p}/self_attention/linear_0"), lin(f"{p}/self_attention/linear_1"),
            ln(f"{p}/attention/layer_norm"), lin(f"{p}/attention/linear_0"), lin(f"{p}/attention/linear_1"),
            lin(f"{p}/attention/linear_2"),
            ln(f"{p}/ffn/layer_norm"), lin(f"{p}/ffn/linear_0"), lin(f"{p}/ffn/linear_1"),
        )  # fmt: skip

    n_enc = _count_layers(m.variables, "encoder")
    n_dec = _count_layers(m.variables, "decoder")
    emb = t("decoder/embeddings/weight")  # [n_vocab, n]
    audio_pos = t("encoder/position_encodings/encodings")  # [n_audio_ctx, n]
    text_pos = t("decoder/position_encodings/encodings")  # [n_text_ctx, n]
    conv1_w = t("encoder/conv1/weight")  # [n, n_mels, 3]
    cfg = WhisperConfig(
        n_mels=conv1_w.shape[1], n_audio_ctx=audio_pos.shape[0], n_audio_state=audio_pos.shape[1],
        n_audio_head=int(m.scalar("encoder/num_heads")), n_audio_layer=n_enc,
        n_vocab=emb.shape[0], n_text_ctx=text_pos.shape[0], n_text_state=emb.shape[1],
        n_text_head=int(m.scalar("decoder/num_heads")), n_text_layer=n_dec,
    )  # fmt: skip
    return Whisper(
        config=cfg,
        conv1=Conv1d(conv1_w, t("encoder/conv1/bias")),
        conv2=Conv1d(t("encoder/conv2/weight"), t("encoder/conv2/bias"), stride=2),
        audio_pos=audio_pos,
        encoder=[enc_block(f"encoder/layer_{i}") for i in range(n_enc)],
        encoder_ln=ln("encoder/layer_norm"),
        token_emb=emb,
        text_pos=text_pos,
        decoder=[dec_block(f"decoder/layer_{i}") for i in range(n_dec)],
        decoder_ln=ln("decoder/layer_norm"),
    )


def _count_layers(variables: dict[str, torch.Tensor], prefix: str) -> int:
    n = 0
    while any(k.startswith(f"{prefix}/layer_{n}/") for k in variables):
        n += 1
    return n

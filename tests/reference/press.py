"""Press scores as kvpress computes them, from a float64 no-cache forward (the reference for
``kvcache.press``).

``no_cache_states`` runs a Llama over one sequence with no cache, in float64, with its own
RoPE (HuggingFace's rotate-half: x cos + rotate_half(x) sin), and keeps each layer's
pre-RoPE queries, rotated queries and keys, and values. The score functions follow
kvpress's presses (``SnapKVPress``, ``TOVAPress``, ``KnormPress``, ``StreamingLLMPress``,
``ExpectedAttentionPress``, ``AdaKVPress``, ``KVzipPress``; ``snapout`` is this library's
own) on one sequence ([heads, tokens] instead of [batch, heads, tokens]); ``cell_decision``
is the documented rule that turns per-head scores into one decision per cell
(kvcache.press.base): min-max per (layer, head), mean, the newest token then the top others
(ties: the earlier token); ``raw_decision`` is snapout's (plain sums).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvcache.models.llama import Llama
from reference.attention import softmax_attention


@dataclass
class LayerStates:
    q_pre: torch.Tensor  # [T, Hq, D] before RoPE
    q: torch.Tensor  # [T, Hq, D] rotated
    k: torch.Tensor  # [T, Hkv, D] rotated
    v: torch.Tensor  # [T, Hkv, D]


def rope_tables(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, ...]:
    """HF Llama's cos, sin [T, D] (each half repeated)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = positions.double()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def no_cache_states(model: Llama, tokens: list[int]) -> list[LayerStates]:
    """Each layer's q / k / v of a float64 no-cache forward over positions 0..T-1."""
    c = model.config
    t, hq, hkv, d = len(tokens), c.num_heads, c.num_kv_heads, c.head_dim
    cos, sin = rope_tables(torch.arange(t), d, c.rope_theta)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x = model.weights.embed.double()[torch.tensor(tokens)]  # [T, E]
    visible = torch.ones(t, t, dtype=torch.bool).tril()
    out: list[LayerStates] = []
    for layer in model.weights.layers:
        h = F.rms_norm(x, (x.shape[-1],), layer.attn_norm.double(), c.rms_eps)
        qkv = h @ layer.wqkv.double().T
        q0 = qkv[:, : hq * d].view(t, hq, d)
        k0 = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        q, k = q0 * cos + rotate_half(q0) * sin, k0 * cos + rotate_half(k0) * sin
        out.append(LayerStates(q0, q, k, v))
        att = softmax_attention(q, k, v, visible, hq // hkv)  # [T, Hq, D]
        x = x + att.reshape(t, -1) @ layer.wo.double().T
        h = F.rms_norm(x, (x.shape[-1],), layer.mlp_norm.double(), c.rms_eps)
        gate_up = h @ layer.w_gate_up.double().T
        f = c.intermediate_size
        x = x + (F.silu(gate_up[:, :f]) * gate_up[:, f:]) @ layer.w_down.double().T
    return out


def _repeat_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    """[T, Hkv, D] -> [Hq, T, D] (kvpress's repeat_kv, heads first)."""
    return k.transpose(0, 1).repeat_interleave(groups, dim=0)


def window_attention(st: LayerStates, window: int) -> torch.Tensor:
    """kvpress compute_window_attention: [Hq, w, T - w] (the window's keys sliced off)."""
    t, hq, d = st.q.shape
    q = st.q[-window:].transpose(0, 1)  # [Hq, w, D]
    keys = _repeat_kv(st.k, hq // st.k.shape[1])  # [Hq, T, D]
    attn = q @ keys.transpose(1, 2) / math.sqrt(d)  # [Hq, w, T]
    mask = torch.full_like(attn, float("-inf")).triu(diagonal=t - window + 1)
    attn = torch.softmax(attn + mask, dim=-1)
    return attn[..., :-window]


def snapkv(st: LayerStates, window: int = 64, kernel: int = 5) -> torch.Tensor:
    hkv = st.k.shape[1]
    scores = window_attention(st, window).mean(dim=-2)  # [Hq, T - w]
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(hkv, -1, scores.shape[-1]).mean(1)
    return F.pad(scores, (0, window), value=scores.max().item())  # [Hkv, T]


def snapout(st: LayerStates, wo: torch.Tensor, window: int = 64) -> torch.Tensor:
    """[Hkv, T]: for each query head h and window row q (softmax over the tokens up to the
    row's), p / (1 - p) * |Wo_h (o_q - v_n)| with o_q the row's output and Wo_h the head's
    columns of the output projection ``wo`` [E, Hq * D] (no factorisation), 1 - p clamped at
    1e-6; the mean over the rows, summed over each KV head's query heads; the window's own
    tokens score the layer's largest other score."""
    t, hq, d = st.q.shape
    hkv = st.k.shape[1]
    g = hq // hkv
    q = st.q[-window:].transpose(0, 1)  # [Hq, w, D]
    keys, values = _repeat_kv(st.k, g), _repeat_kv(st.v, g)  # [Hq, T, D]
    logits = q @ keys.transpose(1, 2) / math.sqrt(d)  # [Hq, w, T]
    p = torch.softmax(logits + torch.full_like(logits, -math.inf).triu(t - window + 1), -1)
    o = p @ values  # [Hq, w, D]
    w_h = wo.double().view(wo.shape[0], hq, d)  # [E, Hq, D]
    diff = o[:, :, None, :] - values[:, None, :, :]  # [Hq, w, T, D]
    move = torch.einsum("ehd,hwtd->hwte", w_h, diff).norm(dim=-1)  # [Hq, w, T]
    s = (p / (1 - p).clamp_min(1e-6) * move).mean(dim=1).view(hkv, g, t).sum(dim=1)
    s[:, -window:] = s[:, :-window].max()
    return s


def raw_decision(scores: torch.Tensor, kept: int, window: int) -> list[int]:
    """One decision per token from [L, H, T] summed as they are: the window's tokens, the
    newest, then the largest sums (ties: the earlier token)."""
    total = scores.double().sum(dim=(0, 1)).tolist()
    t = len(total)
    order = sorted(range(t), key=lambda i: (i < t - window, -total[i], i))
    return sorted(order[:kept])


def tova(st: LayerStates) -> torch.Tensor:
    hkv = st.k.shape[1]
    scores = window_attention(st, 1).mean(dim=0)  # mean over heads: [1, T - 1]
    scores = scores.expand(hkv, -1)
    return F.pad(scores, (0, 1), value=scores.max().item())


def knorm(st: LayerStates) -> torch.Tensor:
    return -st.k.norm(dim=-1).T  # [Hkv, T]


def streaming(t: int, ratio: float, sinks: int = 4) -> torch.Tensor:
    pruned = t - int(t * (1 - ratio) + 1e-9)
    scores = torch.ones(1, t, dtype=torch.float64)
    scores[:, sinks : sinks + pruned] = 0
    return scores


def expected(
    st: LayerStates, theta: float, rows: int = 64, future: int = 512, sinks: int = 4
) -> torch.Tensor:
    """kvpress ExpectedAttentionPress, statistics from the newest ``rows`` queries."""
    t, hq, d = st.q.shape
    hkv = st.k.shape[1]
    q = st.q_pre[max(t - rows, sinks) :].transpose(0, 1)  # [Hq, n, D]
    mean = q.mean(dim=1, keepdim=True)  # [Hq, 1, D]
    centred = q - mean
    cov = centred.transpose(1, 2) @ centred / q.shape[1]  # [Hq, D, D]
    cos, sin = rope_tables(torch.arange(t, t + future), d, theta)  # [F, D]
    eye = torch.eye(d, dtype=torch.float64)
    p = torch.zeros(d, d, dtype=torch.float64)
    p[d // 2 :, : d // 2], p[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
    r = (cos[:, None, :] * eye + sin[:, None, :] * p).mean(dim=0)  # [D, D]
    mean, cov = mean @ r.T, r @ cov @ r.T
    keys = _repeat_kv(st.k[sinks:], hq // hkv).transpose(1, 2)  # [Hq, D, n]
    scores = (mean @ keys)[:, 0] / math.sqrt(d)  # [Hq, n]
    scores = scores + torch.einsum("hin,hij,hjn->hn", keys, cov, keys) / d / 2
    scores = torch.softmax(scores, dim=-1).view(hkv, hq // hkv, -1).mean(1)
    scores = scores * st.v[sinks:].norm(dim=-1).T
    return F.pad(scores, (sinks, 0), value=scores.max().item())


def kvzip(
    model: Llama,
    context: list[int],
    first: list[int],
    later: list[int],
    suffix: list[int],
    skip: int,
    chunk: int,
    sinks: int = 4,
) -> torch.Tensor:
    """kvpress KVzipPress's scores [L, Hkv, T] of ``context``: per chunk of ``chunk`` tokens
    after the ``skip`` prefix, a no-cache forward of the context followed by its repeat
    prompt (``first``, or ``later`` + the 8 tokens before the chunk) + ``suffix`` + the chunk;
    each chunk token scores the largest attention (over the group's heads and the repeat's
    queries) with the softmax over the sinks, the chunk and the repeat (causal). The first
    max(skip, sinks) tokens score 1."""
    t = len(context)
    out: torch.Tensor | None = None
    for a in range(skip, t, chunk):
        b = min(a + chunk, t)
        head = first if a == skip else later + context[max(0, a - 8) : a]
        rep = head + suffix + context[a:b]
        r, s = len(rep), min(sinks, a)
        states = no_cache_states(model, context + rep)
        keys = list(range(s)) + list(range(a, b)) + list(range(t, t + r))
        layers = []
        for st in states:
            hq, hkv = st.q.shape[1], st.k.shape[1]
            q = st.q[t:].transpose(0, 1)  # [Hq, r, D]
            k = _repeat_kv(st.k[keys], hq // hkv)  # [Hq, s + c + r, D]
            logits = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # [Hq, r, s + c + r]
            own = torch.ones(r, r, dtype=torch.bool).tril()
            visible = torch.cat([torch.ones(r, s + b - a, dtype=torch.bool), own], dim=1)
            attn = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            best = attn[:, :, s : s + b - a].amax(dim=1)  # [Hq, c]
            layers.append(best.view(hkv, hq // hkv, -1).amax(dim=1))
        got = torch.stack(layers)
        if out is None:
            out = torch.zeros(got.shape[0], got.shape[1], t, dtype=torch.float64)
        out[:, :, a:b] = got
    assert out is not None
    out[:, :, : max(skip, sinks)] = 1.0
    return out


def adakv_selected(scores: torch.Tensor, kept: int, alpha: float = 0.2) -> torch.Tensor:
    """kvpress AdaKVPress's kept (head, token) pairs of one layer's scores [H, T]."""
    h, t = scores.shape
    s = scores.clone()
    safe = int(kept * alpha)
    top = torch.topk(s, safe, dim=-1).indices
    s.scatter_(-1, top, torch.finfo(s.dtype).max)
    pruned = torch.topk(-s.reshape(-1), h * (t - kept)).indices
    keep = torch.ones(h * t, dtype=torch.bool)
    keep[pruned] = False
    return keep.view(h, t)


def cell_score(scores: torch.Tensor) -> np.ndarray:
    """[L, H, T] -> [T]: min-max per (layer, head), then the mean over both."""
    flat = scores.reshape(-1, scores.shape[-1]).double()
    out = np.zeros(scores.shape[-1])
    for row in flat:
        lo, hi = float(row.min()), float(row.max())
        if hi > lo:
            out += ((row - lo) / (hi - lo)).numpy()
    return out / flat.shape[0]


def cell_decision(score: np.ndarray, kept: int) -> list[int]:
    """The kept token indices: the newest token, then the best scores, ties to the earlier
    token (``kept`` in all)."""
    last = len(score) - 1
    order = sorted(range(len(score)), key=lambda i: (i != last, -score[i], i))
    return sorted(order[:kept])


def chunk_decision(score: np.ndarray, kept: int, chunk: int) -> list[int]:
    """ChunkKV's kept token indices (kvcache.press.chunkkv): chunks of ``chunk`` tokens by
    position (the last may be shorter) ranked by their mean cell score (the newest token's
    chunk first), taken whole while they fit, then the best tokens of the next one."""
    last = len(score) - 1
    s = [math.inf if i == last else float(score[i]) for i in range(len(score))]
    chunks = [list(range(a, min(a + chunk, len(s)))) for a in range(0, len(s), chunk)]
    mean = [sum(s[i] for i in c) / len(c) for c in chunks]
    out: list[int] = []
    for j in sorted(range(len(chunks)), key=lambda j: (-mean[j], j)):
        room = kept - len(out)
        if room <= 0:
            break
        c = chunks[j]
        if len(c) > room:
            c = sorted(c, key=lambda i: (-s[i], i))[:room]
        out += c
    return sorted(out)

"""The ``"kvcache"`` attention implementation of transformers: attention read from the codes.

``import kvcache.hf`` registers :func:`kvcache_attention` with transformers'
``AttentionInterface`` and :func:`kvcache_mask` with ``AttentionMaskInterface`` under the name
``"kvcache"``. A model loaded with ``attn_implementation="kvcache"`` (or switched with
``model.set_attn_implementation("kvcache")``) and given
``past_key_values=KVCacheForTransformers(model.config, ...)`` then runs, per layer::

    mask function (once a forward, per layer type) -> CacheMask: padding [B, past + T],
                                                      offsets, window (no dense tensor)
    cache.update(k, v, layer)                       -> PendingRows(cache, layer, k, v): the new
                                                      rows only, nothing decoded
    kvcache_attention(module, q, rows, rows, mask)  -> cache.attend(...): the first layer of a
                                                      forward places the non-padding tokens,
                                                      every layer stores its rows and attends
                                                      in the cell cache (C++ kernels on the
                                                      codes, grouped heads, its own windows)

Placement waits for the attention call because only the mask carries the padding, and a
padding slot is never stored (the cell cache attends each row to all of its cells).
The mask function builds no [B, 1, T, L] tensor: :meth:`CacheMask.dense` derives it from the
cell cache's own visibility rule, for tests and for callers that want to see it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvcache.errors import NotSupportedError
from kvcache.hf.layers import cell_window
from kvcache.policy import Policy

if TYPE_CHECKING:
    from kvcache.hf.cache import KVCacheForTransformers

NAME = "kvcache"
USE = (
    'attn_implementation="kvcache" attends inside the cache: pass '
    "past_key_values=KVCacheForTransformers(model.config, ...) to the forward or generate "
    "(built from this model's config, whose attn_implementation it reads)"
)


@dataclass(frozen=True)
class CacheMask:
    """What the ``"kvcache"`` mask function hands the layers of one type: the forward's 2D
    padding (False = padding slot), the query/key offsets transformers computed and the
    layer type's sliding window (transformers' convention, None = full causal)."""

    padding: torch.Tensor | None  # [B, past + T] bool, None = no padding
    batch_size: int
    q_offset: int
    q_length: int
    kv_offset: int
    kv_length: int
    window: int | None

    def dense(self) -> torch.Tensor:
        """The boolean mask [B, 1, q_length, kv_length] (True = may attend) this forward's
        attention applies: the cell cache's policy over slot positions, and the padding."""
        q_pos = np.arange(self.q_offset, self.q_offset + self.q_length)  # [T]
        k_pos = np.arange(self.kv_offset, self.kv_offset + self.kv_length)  # [L]
        window = None if self.window is None else cell_window(self.window)
        policy = Policy(window=window, chunk=None, memory=None)
        member = np.ones((self.q_length, self.kv_length), dtype=bool)
        causal = np.ones(self.q_length, dtype=bool)
        visible = torch.from_numpy(policy.mask(member, q_pos, k_pos, causal))  # [T, L]
        out = visible[None, None].expand(self.batch_size, 1, -1, -1)
        if self.padding is None:
            return out.clone()
        pad = torch.zeros(self.batch_size, self.kv_length, dtype=torch.bool)  # [B, L]
        have = self.padding[:, self.kv_offset : self.kv_offset + self.kv_length].cpu()
        pad[:, : have.shape[1]] = have
        return out & pad[:, None, None, :]


@dataclass(frozen=True)
class PendingRows:
    """What ``KVCacheForTransformers.update`` returns under ``"kvcache"``: one layer's new
    K/V [B, H, T, D], not yet stored (the attention call stores them), and their cache."""

    cache: KVCacheForTransformers
    layer: int
    key: torch.Tensor
    value: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The new keys' shape [B, H, T, D] (code that logs shapes keeps working)."""
        return self.key.shape


def kvcache_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> CacheMask:
    """transformers' mask hook for ``"kvcache"``: no tensor, the facts the cache's attention
    needs. Custom mask functions (``or_mask_function`` / ``and_mask_function``: image tokens,
    bidirectional blocks) raise NotSupportedError: the cell cache's policy is causal or
    sliding."""
    from transformers.masking_utils import causal_mask_function

    if use_vmap or (local_size is None and mask_function is not causal_mask_function):
        raise NotSupportedError(
            f"the {NAME!r} attention serves causal and sliding-window masks with padding; this "
            f"forward asks for a custom mask function ({getattr(mask_function, '__name__', '?')})"
            ': use attn_implementation="sdpa" for it'
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotSupportedError(
            f"the {NAME!r} attention takes a 2D padding mask [batch, slots], got "
            f"{tuple(attention_mask.shape)}"
        )
    return CacheMask(
        attention_mask, batch_size, int(q_offset), q_length, int(kv_offset), kv_length, local_size
    )


def kvcache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook for ``"kvcache"``: ``query`` [B, Hq, T, D] attended by
    the cache that returned ``key`` (a :class:`PendingRows`); returns [B, T, Hq, Dv] and no
    weights. NotSupportedError (saying what to pass) for plain K/V tensors (another cache,
    or none), a mask not made by :func:`kvcache_mask`, or dropout."""
    if not isinstance(key, PendingRows):
        got = type(key).__name__
        raise NotSupportedError(f"{USE}; this layer got {got} keys instead of the cache's rows")
    if not isinstance(attention_mask, CacheMask):
        raise NotSupportedError(
            f"{USE}, with its mask function (registered by import kvcache.hf); this layer got "
            f"a {type(attention_mask).__name__} mask (a ready-made 4D mask is not supported)"
        )
    if dropout:
        raise NotSupportedError(f"the {NAME!r} attention is for inference: dropout={dropout}")
    out = key.cache.attend(key, query, attention_mask, scaling, softcap)
    return out, None


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Grouped attention with Gemma 2's logit soft-capping (cap * tanh(s / cap)) over decoded
    K/V: q [T, Hq, D], k/v [L, Hkv, D], mask [T, L] -> [T, Hq, Dv] (the kernels do not cap)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.reshape(t, hkv, g, d).transpose(0, 1).reshape(hkv, t * g, d)  # [Hkv, T*G, D]
    scores = torch.bmm(qg, k.to(q.dtype).permute(1, 2, 0)) * scale  # [Hkv, T*G, L]
    scores = torch.tanh(scores / softcap) * softcap
    keep = mask.repeat_interleave(g, dim=0)  # [T*G, L]
    scores = scores.masked_fill(~keep, float("-inf"))
    empty = ~keep.any(dim=1)  # rows that see nothing give zeros
    probs = torch.softmax(scores.masked_fill(empty[None, :, None], 0.0), dim=-1)
    probs = probs.masked_fill(empty[None, :, None], 0.0)
    out = torch.bmm(probs, v.to(q.dtype).transpose(0, 1))  # [Hkv, T*G, Dv]
    return out.view(hkv, t, g, -1).transpose(0, 1).reshape(t, hq, -1)


def register() -> None:
    """Register ``"kvcache"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, kvcache_attention)
    AttentionMaskInterface.register(NAME, kvcache_mask)

"""``KVCacheForTransformers``: a ``transformers.Cache`` whose storage is kvcache's cell cache.

Mapping (one forward = the updates of all layers between two layer-index wrap-arounds)::

    transformers                      kvcache
    batch row b                  ->   sequence id rows[b] (fresh ids after reorder/select)
    slot s of row b (padding     ->   position s of sequence rows[b] (pads are stored like
      included, = HF's q_offset+i)      tokens; transformers' mask hides them)
    layers with window SW        ->   one CausalCache per distinct window (full = None),
                                      window SW - 1, memory SW (evicts what no query sees)
    update(k [B,H,T,D], layer)   ->   put(layer, [B*T, H, D]) then a view / gather of the
                                      cells [kv_offset, past + T) per row: [B, H, kv_len, D]

The first update of a forward places the B*T new tokens in every cell cache and builds one
:class:`~kvcache.hf.plan.ReadPlan` per cell cache; every layer of that cache reuses it.
transformers builds the attention mask itself from :meth:`get_mask_sizes`, so the returned
columns must be exactly positions ``kv_offset .. past + T - 1`` of each row, in order.
Beam search and batch selection share cells between rows (``copy_prefix``), never copy K/V.

Under ``attn_implementation="kvcache"`` (read from the config the cache was built from, at
every forward) ``update`` only hands back the new rows (``kvcache.hf.attention``) and
:meth:`attend` places, stores and attends inside the cell cache: padding slots are not
stored (slot positions are kept, so windows and causality still count them), nothing is
decoded for transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from transformers.cache_utils import Cache

from kvcache.batch import Batch
from kvcache.causal import CausalCache
from kvcache.codecs import Codec, make_codec
from kvcache.errors import (
    CacheFullError,
    CallOrderError,
    DimensionMismatchError,
    InvalidArgumentError,
    KVCacheError,
    NotSupportedError,
)
from kvcache.hf.attention import NAME, CacheMask, PendingRows, softcapped_attention
from kvcache.hf.layers import LayerSpec, cell_window, kv_offset, layer_specs, uniform_kv_shape
from kvcache.hf.plan import ReadPlan
from kvcache.hf.views import LayerView
from kvcache.validate import config_int, int_arg, optional_config_int

CodecSpec = str | Codec | None


@dataclass(frozen=True)
class _Group:
    """The layers that share one cell cache: same transformers window."""

    window: int | None  # transformers' convention, None = full attention
    forced: bool  # some layer is full attention in the model but windowed here
    layers: tuple[int, ...]


@dataclass
class _Step:
    """The forward in progress: set by its first layer update, read by the others."""

    past: int  # tokens per row stored before this forward
    prev_rows: list[int] | None  # the rows before this forward (restored if it fails)
    rows: int  # B
    tokens: int  # T: new tokens per row
    last_layer: int
    plans: list[ReadPlan]  # one per group (empty when the cache attends itself)
    take: torch.Tensor | None = None  # [N] of the B*T slots stored (None: all); "kvcache" only
    prev_first: dict[int, int] | None = None  # KVCacheForTransformers._first before it


@dataclass(frozen=True)
class _Codecs:
    """Codec choice of every cell cache (validated at construction)."""

    codec: CodecSpec
    key: CodecSpec
    value: CodecSpec


class KVCacheForTransformers(Cache):
    """A ``transformers.Cache`` backed by kvcache cells and codecs, for
    ``model.generate(past_key_values=cache)`` on decoder models with full and sliding layers.

    ``capacity`` tokens per row (prompt, padding included, plus generated tokens);
    ``max_batch_size`` rows (batch x beams); ``codec`` (or ``key_codec``/``value_codec``):
    a kvcache codec name ("fp32", "int8", "int4", "kivi4", ...) or instance, None = the
    model's dtype. ``window`` (transformers' convention: a token sees ``window`` tokens,
    itself included) bounds the layers the config declares full attention; see
    :meth:`update` for what it does not support. ``max_forward_tokens`` caps the new tokens
    per row in one forward (default ``capacity``); sliding layers get
    ``min(capacity, sliding_window + max_forward_tokens)`` cells per row, so lowering it
    (e.g. with ``generate(prefill_chunk_size=...)``) shrinks them.
    """

    def __init__(
        self,
        config: Any,
        capacity: int = 8192,
        max_batch_size: int = 1,
        codec: CodecSpec = None,
        window: int | None = None,
        *,
        key_codec: CodecSpec = None,
        value_codec: CodecSpec = None,
        max_forward_tokens: int | None = None,
    ) -> None:
        text = (
            config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        )
        self.capacity = config_int("capacity", capacity, 1)
        self.max_batch_size = config_int("max_batch_size", max_batch_size, 1)
        fwd = optional_config_int("max_forward_tokens", max_forward_tokens, 1)
        self.max_forward_tokens = self.capacity if fwd is None else min(fwd, self.capacity)
        self.window = optional_config_int("window", window, 1)
        for role, spec in (("key", key_codec or codec), ("value", value_codec or codec)):
            if spec is not None:
                make_codec(spec, role)  # a typed error now, not at the first forward
        self._codecs = _Codecs(codec, key_codec, value_codec)
        self.specs = layer_specs(text, self.window)
        self._kv_shape = uniform_kv_shape(text)
        self.groups = _groups(self.specs)
        self._group_of = [0] * len(self.specs)
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                self._group_of[layer] = g
        self._config = text  # its attn_implementation says who attends (read every forward)
        self._views = [LayerView(self, i, s) for i, s in enumerate(self.specs)]
        super().__init__(layers=list(self._views))
        self.caches: list[CausalCache] = []  # one per group, built by the first forward
        self._rows: list[int] | None = None  # sequence id of each batch row
        self._seen = [0] * len(self.specs)  # tokens per row each layer has stored
        self._step: _Step | None = None
        self._next_seq = 0
        self._inside: bool | None = None  # rows stored under "kvcache" (None: nothing stored)
        self._first: dict[int, int] = {}  # sequence -> leading padding slots (not stored)

    # ---- the hot path ----------------------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new K/V ([B, H, T, D]) and return its keys and values
        ``[B, H, kv_len, D]`` for the columns :meth:`get_mask_sizes` announced.

        The first layer of a forward places the tokens: CacheFullError (nothing placed)
        when a row would exceed ``capacity``; NotSupportedError when a multi-token forward
        would cross a ``window`` imposed on full-attention layers (transformers' mask for
        them is full causal, so only the first new token would see the right keys).
        """
        layer = self._layer(layer_idx)
        _check_states(key_states, value_states)
        if self.attends_inside():
            rows = PendingRows(self, layer, key_states, value_states)
            return cast(torch.Tensor, rows), cast(torch.Tensor, rows)
        step = self._step
        if step is None or layer <= step.last_layer:
            step = self._begin(key_states, value_states, _cache_position(args, kwargs), None)
        self._check_layer(step, layer, key_states)
        g = self._group_of[layer]
        cache = self.caches[g]
        try:
            cache.put(layer, _tokens(key_states), _tokens(value_states))
        except Exception:
            self._abort(step)  # e.g. a codec that cannot store this head_dim
            raise
        plan = step.plans[g]
        keys, values = cache.read(layer, slice(plan.lo, plan.hi))  # [hi - lo, H, D]
        self._seen[layer] = step.past + step.tokens
        step.last_layer = layer
        self._views[layer].is_initialized = True
        return plan.apply(keys), plan.apply(values)

    def attend(
        self,
        rows: PendingRows,
        query: torch.Tensor,
        mask: CacheMask,
        scale: float | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """The ``"kvcache"`` attention of one layer: store ``rows`` (returned by
        :meth:`update`) and attend ``query`` [B, Hq, T, D] over each row's own cells in the
        cell cache; returns [B, T, Hq, Dv] (zeros for padding slots). The first layer of a
        forward places its tokens, padding slots excluded (``mask.padding``), with the
        errors of :meth:`update`; NotSupportedError for padding that is not left padding
        or that disagrees with what is stored. ``softcap`` (Gemma 2) attends in plain torch
        over the decoded history: the kernels do not cap logits."""
        layer = rows.layer
        step = self._step
        if step is None or layer <= step.last_layer:
            step = self._begin(rows.key, rows.value, None, mask)
        self._check_layer(step, layer, rows.key)
        if query.shape[0] != step.rows or query.shape[2] != step.tokens:
            raise DimensionMismatchError(
                f"[{step.rows}, Hq, {step.tokens}, D]",
                tuple(query.shape),
                f"query of layer {layer}",
            )
        spec = self.specs[layer]
        if spec.sliding and mask.window != spec.window:
            raise NotSupportedError(
                f"layer {layer} slides over {spec.window} tokens (config.sliding_window) but "
                f"its mask over {mask.window}"
            )
        cache = self.caches[self._group_of[layer]]
        q, k, v = _tokens(query), _tokens(rows.key), _tokens(rows.value)  # [B*T, H, D]
        if step.take is not None:
            q, k, v = q.index_select(0, step.take), k.index_select(0, step.take), v[step.take]
        try:
            if softcap is None:
                out = cache.attention(layer, q, k, v, scale=scale)  # [N, Hq, Dv]
            else:
                cache.put(layer, k, v)
                keys, values, visible = cache.get(layer)
                s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
                out = softcapped_attention(q, keys, values, visible, s, float(softcap))
        except Exception:
            self._abort(step)
            raise
        self._seen[layer] = step.past + step.tokens
        step.last_layer = layer
        self._views[layer].is_initialized = True
        if step.take is not None:
            full = out.new_zeros((step.rows * step.tokens, *out.shape[1:]))
            full[step.take] = out
            out = full
        return out.view(step.rows, step.tokens, *out.shape[1:])

    def attends_inside(self) -> bool:
        """Whether this forward attends in the cache: the config's attn_implementation is
        ``"kvcache"`` (read each time: ``model.set_attn_implementation`` may change it)."""
        return getattr(self._config, "_attn_implementation", None) == NAME

    def _begin(
        self,
        states: torch.Tensor,
        values: torch.Tensor,
        cache_position: torch.Tensor | None,
        mask: CacheMask | None,
    ) -> _Step:
        """Place a forward's tokens in every cell cache and plan the reads (all or nothing).
        ``mask`` given: the cache attends itself ("kvcache"), padding slots are not placed
        and no reads are planned."""
        b, t = int(states.shape[0]), int(states.shape[2])
        past = self._length()
        inside = mask is not None
        if self._inside is not None and self._inside != inside:
            raise CallOrderError(
                f"rows were stored with attn_implementation {'=' if self._inside else '!='} "
                f"{NAME!r} and this forward runs {'=' if inside else '!='} {NAME!r}: the cache "
                "stores padding only for the latter; reset() first"
            )
        self._check_forward(b, t, past, cache_position, inside)
        prev = self._rows
        firsts = self._leading_padding(mask, b, t, past) if mask is not None else None
        if not self.caches:
            self.caches = [self._new_cache(group, states) for group in self.groups]
            self._preallocate(states, values)
        self._check_placement(states)
        rows = prev if prev is not None else [self._new_seq() for _ in range(b)]
        positions = np.tile(np.arange(past, past + t, dtype=np.int64), b)  # [B*T], row-major
        seqs = np.repeat(np.asarray(rows, dtype=np.int64), t)  # [B*T]
        take = None
        if firsts is not None and any(f > past for f in firsts):
            keep = (positions.reshape(b, t) >= np.asarray(firsts)[:, None]).reshape(-1)  # [B*T]
            if not keep.any():
                raise InvalidArgumentError("attention_mask", "all padding", "a forward with tokens")
            idx = np.flatnonzero(keep)
            positions, seqs = positions[idx], seqs[idx]
            take = torch.from_numpy(idx).to(states.device)
        batch = Batch(positions.tolist(), seqs.tolist())
        self._step = None
        self._start_all(batch, rows, past)
        self._rows = rows
        self._inside = inside
        prev_first = dict(self._first)
        if firsts is not None:
            self._first.update(zip(rows, firsts, strict=True))
        end = past + t
        plans = (
            []
            if inside
            else [
                ReadPlan.build(c, rows, kv_offset(g.window, past), end)
                for c, g in zip(self.caches, self.groups, strict=True)
            ]
        )
        self._step = _Step(past, prev, b, t, -1, plans, take, prev_first)
        return self._step

    def _leading_padding(self, mask: CacheMask, b: int, t: int, past: int) -> list[int]:
        """Each row's leading padding slots after this forward (transformers' left padding),
        checked against the mask's offsets and against what the rows already store."""
        if (mask.batch_size, mask.q_offset, mask.q_length) != (b, past, t):
            raise DimensionMismatchError(
                f"a mask for {b} rows of {t} tokens after {past}",
                f"{mask.batch_size} rows of {mask.q_length} after {mask.q_offset}",
                "the 'kvcache' mask of this forward",
            )
        rows = self._rows
        stored = [0] * b if rows is None else [self._first.get(s, 0) for s in rows]
        pad = mask.padding
        if pad is None or (not any(stored) and bool(pad.all())):
            if any(f > 0 for f in stored):
                raise NotSupportedError("rows hold left padding but this forward has no mask")
            return [0] * b
        if tuple(pad.shape) != (b, past + t):
            raise InvalidArgumentError(
                "attention_mask", tuple(pad.shape), f"[{b}, {past + t}]: one column per slot"
            )
        lead = (~pad).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B] leading False columns
        if not bool((lead + pad.sum(dim=1) == past + t).all()):
            raise NotSupportedError(
                f"the {NAME!r} attention supports left padding (zeros before a row's first "
                "token); attention_mask has a zero after a one"
            )
        firsts = [int(x) for x in lead.tolist()]
        for i, (f, new) in enumerate(zip(stored, firsts, strict=True)):
            if rows is not None and (new != f if f < past else new < past):
                raise NotSupportedError(
                    f"attention_mask row {i} pads {new} slots, the row stores {f} padding "
                    "slots: a stored token cannot become padding or the reverse"
                )
        return firsts

    def _abort(self, step: _Step) -> None:
        """Undo a failed forward: drop its tokens from every row, restore lengths and rows."""
        assert self._rows is not None
        for cache in self.caches:
            for seq in self._rows:
                cache.remove(seq, step.past)
        self._seen = [step.past] * len(self._seen)
        self._rows = step.prev_rows
        if step.prev_first is not None:
            self._first = step.prev_first
        if self._rows is None:
            self._inside = None
        self._step = None

    def _check_forward(
        self, b: int, t: int, past: int, cache_position: torch.Tensor | None, inside: bool
    ) -> None:
        """Reject a forward this cache cannot serve exactly, before anything changes."""
        rows = self._rows
        if rows is None and b > self.max_batch_size:
            raise InvalidArgumentError(
                "batch size", b, f"<= max_batch_size ({self.max_batch_size}), beams included"
            )
        if rows is not None and b != len(rows):
            raise InvalidArgumentError(
                "batch size",
                b,
                f"{len(rows)} rows, as stored (change rows with batch_select_indices, "
                "batch_repeat_interleave or reorder_cache, or reset() first)",
            )
        if t < 1:
            raise InvalidArgumentError("key_states tokens", t, "at least one new token")
        if past + t > self.capacity:
            raise CacheFullError(t, self.capacity - past, self.capacity)
        if t > self.max_forward_tokens:
            raise InvalidArgumentError(
                "tokens in one forward",
                t,
                f"<= max_forward_tokens ({self.max_forward_tokens}); pass a larger one or "
                "generate(..., prefill_chunk_size=...)",
            )
        if cache_position is not None and not torch.equal(
            cache_position.flatten().cpu(), torch.arange(past, past + t)
        ):
            raise NotSupportedError(
                f"cache_position {cache_position.flatten().tolist()[:8]}... is not the next "
                f"{t} slots after {past}: KVCacheForTransformers only appends"
            )
        for group in [] if inside else self.groups:  # inside, the cache's own window applies
            if group.forced and group.window is not None and t > 1 and past + t > group.window:
                raise NotSupportedError(
                    f"a {t}-token forward after {past} tokens crosses window={group.window} on "
                    "full-attention layers, whose mask transformers builds as full causal; "
                    "prefill at most window tokens, then decode one token per step"
                )

    def _check_placement(self, states: torch.Tensor) -> None:
        cache = self.caches[0]
        if states.dtype != cache.dtype or states.device != cache.device:
            raise InvalidArgumentError(
                "key_states",
                f"{states.dtype} on {states.device}",
                f"{cache.dtype} on {cache.device}, as the first forward (reset() keeps both)",
            )

    def _start_all(self, batch: Batch, rows: Sequence[int], past: int) -> None:
        """start_forward on every cell cache; if one fails, drop the tokens the others placed."""
        for i, cache in enumerate(self.caches):
            try:
                cache.start_forward(batch)
            except KVCacheError:
                for done in self.caches[:i]:
                    for seq in rows:
                        done.remove(seq, past)
                raise

    def _check_layer(self, step: _Step, layer: int, key_states: torch.Tensor) -> None:
        if self._seen[layer] != step.past:
            raise CallOrderError(
                f"layer {layer} skipped a forward ({self._seen[layer]} tokens stored, "
                f"this forward starts at {step.past}); reset() first"
            )
        if key_states.shape[0] != step.rows or key_states.shape[2] != step.tokens:
            raise DimensionMismatchError(
                f"[{step.rows}, H, {step.tokens}, D] like this forward's first layer",
                tuple(key_states.shape),
                f"key_states of layer {layer}",
            )

    # ---- building --------------------------------------------------------------------
    def _new_cache(self, group: _Group, states: torch.Tensor) -> CausalCache:
        """The cell cache of one group, in the dtype and on the device of the first forward."""
        rows = self.max_batch_size
        c = self._codecs
        common: dict[str, Any] = {
            "max_sequences": rows,
            "dtype": states.dtype,
            "device": states.device,
            "codec": c.codec,
            "key_codec": c.key,
            "value_codec": c.value,
        }
        w = group.window
        if w is None or w >= self.capacity:
            return CausalCache(self.capacity, **common)
        # rows keep <= w old tokens (memory w) plus at most min(capacity - w, T) new ones
        per_row_new = min(self.capacity - w, self.max_forward_tokens)
        return CausalCache(
            self.capacity,
            window=cell_window(w),
            memory=w,
            max_batch=rows * per_row_new,
            **common,
        )

    def _preallocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Allocate every layer's cells now, in one go, when the config says all layers share
        this forward's [kv_heads, head_dim]. Allocated layer by layer in the middle of an 8k
        prefill instead, the long-lived buffers interleave with freed activations and glibc
        cannot return that memory (figure: docs/design/index.md)."""
        if self._kv_shape != (int(keys.shape[1]), int(keys.shape[3])):
            return
        k, v = _tokens(keys[:1, :, :1]), _tokens(values[:1, :, :1])  # [1, H, D]: shapes only
        for cache, group in zip(self.caches, self.groups, strict=True):
            cache.start_forward(Batch([0], [0]), reserve=True)  # allocates, places nothing
            for layer in group.layers:
                cache.put(layer, k, v)

    def _new_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _layer(self, layer_idx: object) -> int:
        layer = int_arg("layer_idx", layer_idx)
        if layer >= len(self.specs):
            raise InvalidArgumentError("layer_idx", layer, f"a layer < {len(self.specs)}")
        return layer

    def _length(self) -> int:
        """Tokens per row every layer holds; CallOrderError mid-forward or after a failed one."""
        past = self._seen[0]
        if any(s != past for s in self._seen):
            raise CallOrderError(
                f"layers hold different lengths {sorted(set(self._seen))}: a forward did not "
                "update every layer; crop(...) back to a common length or reset() first"
            )
        return past

    # ---- what transformers asks ------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens per row (padding included) the layer holds: the next forward's first slot."""
        return self._seen[layer_idx] if 0 <= layer_idx < len(self._seen) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys :meth:`update` will return for this layer."""
        if not 0 <= layer_idx < len(self.specs):
            return query_length, 0
        past = self._seen[layer_idx]
        offset = kv_offset(self.specs[layer_idx].window, past)
        return past + query_length - offset, offset

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """Most tokens a layer attends to: its window, else ``capacity`` (None: all layers)."""
        if layer_idx is None:
            return max(self.get_max_length(i) for i in range(len(self.specs)))
        if not 0 <= layer_idx < len(self.specs):
            return -1
        w = self.specs[layer_idx].window
        return self.capacity if w is None else min(w, self.capacity)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """The 4.x name of :meth:`get_max_length`."""
        return self.get_max_length(layer_idx)

    @property
    def is_compileable(self) -> bool:
        """False: placement is numpy bookkeeping, so generate must not build static masks."""
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self.caches)

    @property
    def batch_size(self) -> int:
        """Rows stored, -1 before the first forward."""
        return -1 if self._rows is None else len(self._rows)

    def memory_usage_bytes(self) -> int:
        """Bytes of K/V storage allocated in every cell cache (codes and codec metadata)."""
        return sum(c.memory_usage_bytes() for c in self.caches)

    def early_initialization(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(
            "KVCacheForTransformers allocates on the first forward; early_initialization "
            "(static-cache export) is not supported"
        )

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        raise NotSupportedError("KVCacheForTransformers does not offload layers")

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        raise NotSupportedError("KVCacheForTransformers does not offload layers")

    # ---- rows ------------------------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b continues old row ``beam_idx[b]``, sharing its cells."""
        self._select_rows("beam_idx", _int_list("beam_idx", beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices`` (in that order)."""
        self._select_rows("indices", _int_list("indices", indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive rows sharing its cells."""
        r = int_arg("repeats", repeats, minimum=1)
        count = 0 if self._rows is None else len(self._rows)
        self._select_rows("repeats", [i for i in range(count) for _ in range(r)])

    def _select_rows(self, name: str, index: list[int]) -> None:
        """New row b = old row index[b]. The first new row taking an old sequence keeps its
        id; the others get fresh ids sharing its cells (``copy_prefix``, no K/V copied);
        old sequences nobody takes release their cells."""
        old = self._rows
        if old is None:
            return  # nothing stored yet: the next forward sets the rows
        past = self._length()
        for i, v in enumerate(index):
            if not 0 <= v < len(old):
                raise InvalidArgumentError(f"{name}[{i}]", v, f"a row < {len(old)}")
        if not index or len(index) > self.max_batch_size:
            raise InvalidArgumentError(
                name, f"<{len(index)} rows>", f"1 to max_batch_size ({self.max_batch_size}) rows"
            )
        if index == list(range(len(old))):
            return
        taken: set[int] = set()
        new = []
        for i in index:
            src = old[i]
            if src in taken:
                dst = self._new_seq()
                for cache in self.caches:
                    cache.copy_prefix(src, dst, past)
                self._first[dst] = self._first.get(src, 0)
                new.append(dst)
            else:
                taken.add(src)
                new.append(src)
        for seq in old:
            if seq not in taken:
                for cache in self.caches:
                    cache.remove(seq, 0)
                self._first.pop(seq, None)
        self._rows = new
        self._step = None

    # ---- length ----------------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens of every row (DynamicCache's
        convention: a negative count; 0 is a no-op). NotSupportedError, changing nothing,
        when a sliding layer already evicted keys the shortened rows would need."""
        n = tokens_to_remove
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n > 0:
            raise InvalidArgumentError(
                "tokens_to_remove", n, "an int <= 0: minus the number of newest tokens to drop"
            )
        if n == 0 or self._rows is None:
            return
        past = self._length()
        keep = past + int(n)
        if keep < 0:
            raise InvalidArgumentError("tokens_to_remove", n, f"an int >= {-past} ({past} stored)")
        self._check_crop(keep)
        for cache in self.caches:
            for seq in self._rows:
                cache.remove(seq, keep)
        self._seen = [keep] * len(self._seen)
        self._step = None

    def _check_crop(self, keep: int) -> None:
        assert self._rows is not None
        for cache, group in zip(self.caches, self.groups, strict=True):
            for seq in self._rows:
                first = self._first.get(seq, 0)  # padding slots are not stored
                need = max(kv_offset(group.window, keep), first)
                held = cache.positions(seq)
                if keep > first and (not held or held[0] > need):
                    raise NotSupportedError(
                        f"crop to {keep} tokens needs position {need} of the "
                        f"window={group.window} layers {list(group.layers)[:4]}..., which they "
                        "already evicted"
                    )

    def reset(self) -> None:
        """Forget every row; storage stays allocated (and keeps its dtype and device)."""
        for cache in self.caches:
            for seq in cache.sequences():
                cache.remove(seq, 0)
        self._rows = None
        self._seen = [0] * len(self._seen)
        self._step = None
        self._inside = None
        self._first = {}
        for view in self._views:
            view.is_initialized = False


def _groups(specs: Sequence[LayerSpec]) -> list[_Group]:
    """Layers grouped by window, in order of first appearance."""
    by_window: dict[int | None, list[int]] = {}
    for i, spec in enumerate(specs):
        by_window.setdefault(spec.window, []).append(i)
    return [
        _Group(w, any(not specs[i].sliding for i in layers) and w is not None, tuple(layers))
        for w, layers in by_window.items()
    ]


def _check_states(key: object, value: object) -> None:
    """Keys and values [B, H, T, D] of the same batch, heads and tokens (head dims may differ)."""
    for name, t in (("key_states", key), ("value_states", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise DimensionMismatchError("rank 4 [batch, kv_heads, tokens, head_dim]", shape, name)
    assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
    if key.shape[:3] != value.shape[:3]:
        raise DimensionMismatchError(
            tuple(key.shape[:3]), tuple(value.shape[:3]), "value_states [batch, kv_heads, tokens]"
        )


def _tokens(states: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B*T, H, D], row b's T tokens consecutive (the Batch's order)."""
    b, h, t, d = states.shape
    return states.detach().transpose(1, 2).reshape(b * t, h, d)


def _cache_position(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``cache_position`` from the legacy ``cache_kwargs`` argument, if a model passes one."""
    cache_kwargs = args[0] if args else kwargs.get("cache_kwargs")
    if isinstance(cache_kwargs, dict):
        pos = cache_kwargs.get("cache_position")
        if isinstance(pos, torch.Tensor):
            return pos
    return None


def _int_list(name: str, index: object) -> list[int]:
    """A 1-D index (tensor or sequence of ints) as a list, or InvalidArgumentError."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1 or index.is_floating_point():
            raise InvalidArgumentError(name, tuple(index.shape), "a 1-D integer tensor")
        return [int(v) for v in index.tolist()]
    if isinstance(index, Sequence):
        return [int_arg(f"{name}[{i}]", v) for i, v in enumerate(index)]
    raise InvalidArgumentError(name, type(index).__name__, "a 1-D integer tensor")

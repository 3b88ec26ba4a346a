"""The per-head compressed cache (seed API): K/V of attention heads kept only as codes.

Each head (:class:`KVCacheCompressor`) stores its tokens through a
:class:`~kvcache.codecs.quantizer.TurboQuantizer` (sign flips + Walsh–Hadamard rotation,
Lloyd–Max codebook, per-vector norm; keys optionally by the book with a QJL sketch). Layout of
one head::

    keys    Encoded rows [capacity, ...]   codes + bf16 scale (+ QJL sketch and residual norm)
    values  Encoded rows [capacity, ...]   codes + bf16 scale
    centre  key-mean snapshots [J, D] bf16, running key sum [D] int64 (fixed point, 2^-20)

Rows ``[0, len)`` are valid; buffers grow geometrically (doubling), so a push copies only the
new rows except on the rare growth step. Nothing is kept in full precision, and everything
listed above is counted by ``memory_usage_bytes``.

Keys are centred on key-mean snapshots taken at fixed token counts
(:mod:`kvcache.codecs.key_means`: key t subtracts the mean of the first 2^j keys, 2^j <= t + 1,
where that shrinks it; docs/design/turbo.md says why centring beats plain TurboQuant on real
keys), and scores add the exact ``<q, mean>`` back. The schedule is a function of
the token index and every step of the encoder treats rows independently
(``codecs/rotation.py``), so pushing 30 tokens at once or 28 + 1 + 1 gives the same codes,
scores and outputs (tested with Hypothesis).

A schedule fixed by the token index, not by push boundaries: the codes then do not depend on
how the tokens were pushed; it costs log2(T) + 1 snapshots and an int64 sum. Why and what it
bought: docs/design/turbo.md.

:class:`MultiHeadKVCache` is H independent heads; head h uses ``seed + h`` and equals a
``KVCacheCompressor`` with that seed fed the same tokens. A push encodes all heads in one
batched pass (:class:`~kvcache.codecs.quantizer.HeadStack`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvcache.codecs.device import served_device
from kvcache.codecs.encoded import Encoded
from kvcache.codecs.key_means import KeyMeans, MeansPlan, NoKeyMeans, to_fixed
from kvcache.codecs.quantizer import KEY_MODES, HeadStack, TurboQuantizer
from kvcache.errors import (
    CallOrderError,
    DimensionMismatchError,
    InvalidArgumentError,
    InvalidConfigError,
    NonFiniteInputError,
)
from kvcache.validate import config_int, is_int

_INITIAL_ROWS = 64


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape and budget of one compressed head: ``bits`` per coordinate for keys and values."""

    head_dim: int
    bits: int
    projections: int = 64  # QJL rows, used by key_mode="qjl"
    seed: int = 0
    key_mode: str = "mse"  # "mse": all bits to the codebook; "qjl": bits-1 + QJL (by the book)
    centre_keys: bool = True  # subtract the key mean snapshot where it shrinks a key

    def __post_init__(self) -> None:
        config_int("head_dim", self.head_dim, 2)
        if not is_int(self.bits) or not 1 <= int(self.bits) <= 8:
            raise InvalidConfigError("bits", self.bits, "an int in 1..8")
        config_int("projections", self.projections, 1)
        if not is_int(self.seed):
            raise InvalidConfigError("seed", self.seed, "an int")
        if self.key_mode not in KEY_MODES:
            raise InvalidConfigError("key_mode", self.key_mode, f"one of {KEY_MODES}")
        if not isinstance(self.centre_keys, bool):
            raise InvalidConfigError("centre_keys", self.centre_keys, "a bool")


class _Rows:
    """Growable storage for Encoded rows: one buffer per field, first ``length`` rows valid."""

    def __init__(self, template: Encoded) -> None:
        self._bufs = [t.new_empty((_INITIAL_ROWS, *t.shape[1:])) for t in template.tensors()]
        self.length = 0

    def append(self, enc: Encoded) -> None:
        n = len(enc)
        self._reserve(self.length + n)
        for buf, t in zip(self._bufs, enc.tensors(), strict=True):
            buf[self.length : self.length + n] = t
        self.length += n

    def _reserve(self, rows: int) -> None:
        have = self._bufs[0].shape[0]
        if rows <= have:
            return
        grown = max(rows, 2 * have)
        for i, buf in enumerate(self._bufs):
            new = buf.new_empty((grown, *buf.shape[1:]))
            new[: self.length] = buf[: self.length]
            self._bufs[i] = new

    def view(self) -> Encoded:
        """Views of the valid rows."""
        return Encoded(*(b[: self.length] for b in self._bufs))

    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs)

    def clone(self) -> _Rows:
        out = object.__new__(_Rows)
        out._bufs = [b.clone() for b in self._bufs]
        out.length = self.length
        return out


def _as_float(x: object, name: str) -> torch.Tensor:
    """A real tensor (or array-like) as float32; typed error otherwise."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidArgumentError(name, type(x).__name__, "a real tensor") from e
    if x.is_complex() or x.dtype == torch.bool:
        raise InvalidArgumentError(f"{name}.dtype", x.dtype, "a real dtype")
    if x.device.type == "meta":
        raise InvalidArgumentError(f"{name}.device", str(x.device), "a tensor that holds data")
    return x.float()


def _check_finite(x: torch.Tensor, name: str) -> None:
    """NonFiniteInputError at the first NaN/Inf of x (after the cast to float32: a float64
    beyond float32's range counts as Inf, since it could not be encoded)."""
    if bool(torch.isfinite(x.sum())):  # one pass; NaN/Inf anywhere make the sum non-finite
        return
    bad = ~torch.isfinite(x)  # the sum may also overflow: look element by element
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise NonFiniteInputError(index, name)


def _stack_vectors(x: Sequence[object], name: str) -> torch.Tensor:
    """A sequence of H vectors [D] -> [H, D]."""
    rows = [_as_float(v, name) for v in x]
    if not rows or any(r.shape != rows[0].shape for r in rows):
        shapes = [tuple(r.shape) for r in rows]
        raise DimensionMismatchError("H vectors of one shape [D]", shapes, f"{name} shapes")
    return torch.stack(rows)


def _rows(x: object, dim: int, name: str) -> tuple[torch.Tensor, bool]:
    """x: [D] or [T, D] -> ([T, D] float32, whether it was one vector); validated."""
    t = _as_float(x, name)
    if t.dim() not in (1, 2) or t.shape[-1] != dim:
        raise DimensionMismatchError(dim, tuple(t.shape), f"{name} shape ([{dim}] or [T, {dim}])")
    _check_finite(t, name)
    single = t.dim() == 1
    return (t[None] if single else t), single


def _encode_push(
    stack: HeadStack, centres: Sequence[KeyMeans], k: torch.Tensor, v: torch.Tensor
) -> tuple[list[MeansPlan], list[list[Encoded]], list[Encoded]]:
    """Encode a push of k, v [H, T, D] (T >= 1) for H heads at once, keys piece by piece of
    the centring schedule -> (plan per head, key pieces per head, values per head)."""
    fixed = to_fixed(k)  # [H, T, D] int64, all heads in one pass
    plans = [c.plan(fixed[h]) for h, c in enumerate(centres)]
    start = centres[0].count
    pieces = [c.offsets(p, start, start + k.shape[1]) for c, p in zip(centres, plans, strict=True)]
    keys: list[list[Encoded]] = [[] for _ in centres]
    for j, (lo, hi, _) in enumerate(pieces[0]):
        offsets = [head_pieces[j][2] for head_pieces in pieces]
        off = None if offsets[0] is None else torch.stack(offsets)  # type: ignore[arg-type]
        for h, enc in enumerate(stack.encode_keys(k[:, lo - start : hi - start], off)):
            keys[h].append(enc)
    return plans, keys, stack.encode_values(v)


class KVCacheCompressor:
    """One attention head's K/V, stored only as TurboQuant codes."""

    def __init__(self, config: KVCacheConfig, device: torch.device | str | None = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise InvalidConfigError("config", type(config).__name__, "a KVCacheConfig")
        self.config = config
        self.device = served_device(device)
        self.quantizer = TurboQuantizer(
            config.head_dim, config.bits, config.projections, config.seed, config.key_mode,
            self.device,
        )  # fmt: skip
        self._stack = HeadStack([self.quantizer])
        probe = torch.zeros(1, config.head_dim, device=self.device)
        self._keys = _Rows(self.quantizer.encode_keys(probe))
        self._values = _Rows(self.quantizer.encode_values(probe))
        self._centre = self._new_centre()

    def _new_centre(self) -> KeyMeans:
        kind = KeyMeans if self.config.centre_keys else NoKeyMeans
        return kind(self.config.head_dim, self.device)

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def push(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append tokens: key, value [D] or [T, D]. On any error nothing is stored."""
        k, _ = _rows(key, self.head_dim, "key")
        v, _ = _rows(value, self.head_dim, "value")
        if k.shape[0] != v.shape[0]:
            raise DimensionMismatchError(k.shape[0], v.shape[0], "value tokens (= key tokens)")
        if k.shape[0] == 0:
            return
        k, v = k.to(self.device), v.to(self.device)
        plans, keys, values = _encode_push(self._stack, [self._centre], k[None], v[None])
        self._store(keys[0], values[0], plans[0])

    def _store(self, keys: list[Encoded], values: Encoded, plan: MeansPlan) -> None:
        """Append encoded rows (keys piece by piece) and commit the centring plan."""
        for piece in keys:
            self._keys.append(piece)
        self._values.append(values)
        self._centre.commit(plan)

    def _queries(self, query: object) -> tuple[torch.Tensor, bool]:
        q, single = _rows(query, self.head_dim, "query")
        return q.to(self.device), single

    def attention_scores(self, query: torch.Tensor) -> torch.Tensor:
        """Scaled logits q.k/sqrt(D) from the codes: query [D] -> [T] (or [Q, D] -> [Q, T])."""
        q, single = self._queries(query)
        scores = self._scores(q)
        return scores[0] if single else scores

    def _scores(self, q: torch.Tensor) -> torch.Tensor:
        """q: [Q, D] float32 -> [Q, T] scaled logits; the query is rotated once."""
        qr = self.quantizer.rotate_queries(q)  # [Q, P]
        means, index = self._centre.per_key(len(self))  # [J, D], [T]
        scores = self.quantizer.key_scores(qr, self._keys.view(), means, True, index)
        return scores * (1.0 / math.sqrt(self.head_dim))

    def attend(self, query: torch.Tensor) -> torch.Tensor:
        """softmax(scores) @ values from the codes: query [D] -> [D] (or [Q, D] -> [Q, D])."""
        q, single = self._queries(query)
        if self.is_empty():
            raise CallOrderError("attend on an empty cache: push at least one token first")
        weights = torch.softmax(self._scores(q), dim=-1)  # [Q, T]
        out = self.quantizer.weighted_values(weights, self._values.view())
        return out[0] if single else out

    def decode_keys(self) -> torch.Tensor:
        """Reconstructed keys [T, D]."""
        means, index = self._centre.per_key(len(self))  # [J, D], [T]
        return self.quantizer.decode_keys(self._keys.view(), means, index)

    def decode_values(self) -> torch.Tensor:
        """Reconstructed values [T, D]."""
        return self.quantizer.decode_values(self._values.view())

    @property
    def encoded_keys(self) -> Encoded:
        """Views of the stored key codes (what memory_usage_bytes counts, with the centre)."""
        return self._keys.view()

    @property
    def encoded_values(self) -> Encoded:
        """Views of the stored value codes."""
        return self._values.view()

    @property
    def key_means(self) -> list[torch.Tensor]:
        """The key-mean snapshots taken so far (bf16 [D] each; snapshot j = first 2^j keys)."""
        return list(self._centre.means)

    def centre_nbytes(self) -> int:
        """Bytes of the key-centring state (mean snapshots and the running sum)."""
        return self._centre.nbytes()

    def __len__(self) -> int:
        return self._keys.length

    def is_empty(self) -> bool:
        return len(self) == 0

    def clear(self) -> None:
        """Forget every token (buffers are kept for reuse)."""
        self._keys.length = 0
        self._values.length = 0
        self._centre = self._new_centre()

    def memory_usage_bytes(self) -> int:
        """Bytes of everything stored: key/value codes, scales, sketches and the centre state."""
        return self._keys.view().nbytes() + self._values.view().nbytes() + self._centre.nbytes()

    def allocated_bytes(self) -> int:
        """Bytes of the buffers as allocated (>= memory_usage_bytes: growth headroom)."""
        return self._keys.allocated_bytes() + self._values.allocated_bytes() + self._centre.nbytes()

    def compression_ratio(self) -> float:
        """fp16 bytes of the same K/V (T * 2 * D * 2) / memory_usage_bytes; 0.0 when empty."""
        used = self.memory_usage_bytes()
        return 4.0 * self.head_dim * len(self) / used if used else 0.0

    def copy(self) -> KVCacheCompressor:
        """An independent copy (codes cloned; the quantizer's constants are shared, read-only)."""
        out = copy.copy(self)
        out._keys = self._keys.clone()
        out._values = self._values.clone()
        out._centre = self._centre.clone()
        return out


class MultiHeadKVCache:
    """H compressed heads pushed and queried together; head h uses ``config.seed + h``."""

    def __init__(
        self, num_heads: int, config: KVCacheConfig, device: torch.device | str | None = None
    ) -> None:
        self.num_heads = config_int("num_heads", num_heads, 1)
        if not isinstance(config, KVCacheConfig):
            raise InvalidConfigError("config", type(config).__name__, "a KVCacheConfig")
        self.config = config
        self.device = served_device(device)
        self.heads = [
            KVCacheCompressor(replace(config, seed=int(config.seed) + h), self.device)
            for h in range(self.num_heads)
        ]
        self._stack = HeadStack([head.quantizer for head in self.heads])

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def _per_head(self, x: object, name: str, tokens: bool) -> torch.Tensor:
        """x: [H, D] (tokens=False; a sequence of H vectors too) or [T, H, D] -> float32."""
        if not tokens and not isinstance(x, torch.Tensor) and isinstance(x, Sequence):
            x = _stack_vectors(x, name)
        t = _as_float(x, name)
        want = (self.num_heads, self.head_dim)
        if t.dim() != (3 if tokens else 2) or tuple(t.shape[-2:]) != want:
            shape = f"[T, {want[0]}, {want[1]}]" if tokens else f"[{want[0]}, {want[1]}]"
            raise DimensionMismatchError(shape, tuple(t.shape), f"{name} shape")
        _check_finite(t, name)
        return t.to(self.device)

    def push_token(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append one token: keys, values [H, D] (or sequences of H vectors [D])."""
        k = self._per_head(keys, "keys", tokens=False)
        v = self._per_head(values, "values", tokens=False)
        self._push(k[None], v[None])

    def push(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append many tokens: keys, values [T, H, D]. On any error nothing is stored."""
        k = self._per_head(keys, "keys", tokens=True)
        v = self._per_head(values, "values", tokens=True)
        if k.shape[0] != v.shape[0]:
            raise DimensionMismatchError(k.shape[0], v.shape[0], "values tokens (= keys tokens)")
        self._push(k, v)

    def _push(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, H, D] validated; all heads are encoded in one batched pass."""
        if k.shape[0] == 0:
            return
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # [H, T, D]
        centres = [head._centre for head in self.heads]
        plans, keys, values = _encode_push(self._stack, centres, k, v)
        for head, plan, ek, ev in zip(self.heads, plans, keys, values, strict=True):
            head._store(ek, ev, plan)

    def attention_scores(self, queries: torch.Tensor) -> torch.Tensor:
        """Scaled logits per head from the codes: queries [H, D] -> [H, T]."""
        q = self._per_head(queries, "queries", tokens=False)
        out = torch.empty(self.num_heads, len(self), device=self.device)
        for h, head in enumerate(self.heads):
            out[h] = head._scores(q[h : h + 1])[0]
        return out

    def attend(self, queries: torch.Tensor) -> torch.Tensor:
        """Per-head attention output from the codes: queries [H, D] -> [H, D]."""
        q = self._per_head(queries, "queries", tokens=False)
        if self.is_empty():
            raise CallOrderError("attend on an empty cache: push at least one token first")
        return torch.stack([head.attend(q[h]) for h, head in enumerate(self.heads)])

    def __len__(self) -> int:
        return len(self.heads[0])

    def is_empty(self) -> bool:
        return len(self) == 0

    def clear(self) -> None:
        """Forget every token of every head."""
        for head in self.heads:
            head.clear()

    def copy(self) -> MultiHeadKVCache:
        """An independent copy: pushing to either leaves the other unchanged."""
        out = copy.copy(self)
        out.heads = [head.copy() for head in self.heads]
        return out  # the stack's tensors are read-only constants, shared

    def memory_usage_bytes(self) -> int:
        """Sum of the heads' stored bytes."""
        return sum(head.memory_usage_bytes() for head in self.heads)

    def compression_ratio(self) -> float:
        """fp16 bytes of the same K/V over memory_usage_bytes; 0.0 when empty."""
        used = self.memory_usage_bytes()
        return 4.0 * self.head_dim * self.num_heads * len(self) / used if used else 0.0

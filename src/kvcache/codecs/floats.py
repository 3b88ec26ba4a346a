"""Float codecs: rows stored as fp32, fp16 or bf16 (a view when that is the compute dtype)."""

from __future__ import annotations

import torch

from kvcache.codecs.base import Buffer, Codec, Locs, tensor_bytes


class FloatBuffer(Buffer):
    def __init__(self, n: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.data = torch.zeros((n, heads, dim), dtype=dtype, device=device)  # [N, H, D]

    def write(self, locs: Locs, x: torch.Tensor) -> None:
        if isinstance(locs, slice):
            self.data[locs] = x
        else:
            self.data.index_copy_(0, locs, x.to(self.data.dtype))

    def read(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        return self.data[lo:hi].to(dtype)  # no copy when dtype matches

    def gather(self, cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.data[cells].to(dtype)

    def nbytes(self) -> int:
        return tensor_bytes(self.data)


class FloatCodec(Codec):
    """Rows kept as floats of ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {
            torch.float32: "fp32",
            torch.float16: "fp16",
            torch.bfloat16: "bf16",
            torch.float64: "fp64",
        }.get(dtype, str(dtype))

    def allocate(self, n: int, heads: int, dim: int, device: torch.device) -> Buffer:
        return FloatBuffer(n, heads, dim, self.dtype, device)

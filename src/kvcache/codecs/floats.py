"""Float codecs: rows stored as fp32, fp16 or bf16 (a view when that is the compute dtype)."""

from __future__ import annotations

import numpy as np
import torch

from kvcache.codecs.base import FLOAT_KINDS, Buffer, Codec, Layout, Locs, RowFormat, tensor_bytes
from kvcache.kernels.rows import put_rows
from kvcache.recent import SealPlan, Windows


class FloatBuffer(Buffer):
    def __init__(self, n: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.data = torch.zeros((n, heads, dim), dtype=dtype, device=device)  # [N, H, D]

    def store(self, locs: torch.Tensor, x: torch.Tensor, plan: SealPlan | None) -> None:
        put_rows(self.data, locs, x)

    def rewrite(self, cells: torch.Tensor, x: torch.Tensor) -> None:
        self.data.index_copy_(0, cells, x.to(self.data.dtype))

    def decode(self, cells: Locs, dtype: torch.dtype) -> torch.Tensor:
        return self.data[cells].to(dtype)  # a view for a slice of the same dtype

    def layout(self) -> Layout:
        kind = FLOAT_KINDS.get(self.data.dtype)
        assert kind is not None, f"no kernel reads {self.data.dtype} rows"
        return Layout(kind, self.data)

    def nbytes(self) -> int:
        return tensor_bytes(self.data)

    def export_rows(self, cells: np.ndarray, records: np.ndarray) -> dict[str, torch.Tensor]:
        return {"data": self.data.index_select(0, torch.from_numpy(cells).to(self.data.device))}

    def row_formats(self, sealed: int, open_: int, records: int) -> dict[str, RowFormat]:
        return {"data": (self.data.dtype, (sealed + open_, *self.data.shape[1:]))}

    def import_rows(
        self, cells: np.ndarray, records: np.ndarray, rows: dict[str, torch.Tensor]
    ) -> None:
        at = torch.from_numpy(cells).to(self.data.device)
        self.data.index_copy_(0, at, rows["data"].to(self.data.device))


class FloatCodec(Codec):
    """Rows kept as floats of ``dtype``."""

    any_device = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {
            torch.float32: "fp32",
            torch.float16: "fp16",
            torch.bfloat16: "bf16",
            torch.float64: "fp64",
        }.get(dtype, str(dtype))

    def allocate(
        self, n: int, heads: int, dim: int, device: torch.device, windows: Windows | None
    ) -> Buffer:
        return FloatBuffer(n, heads, dim, self.dtype, device)

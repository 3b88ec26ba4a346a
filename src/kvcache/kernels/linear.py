"""Linear layers of decode steps: a few rows against a large weight, read once; and RMSNorm.

A decode step multiplies one row per sequence by every weight matrix. torch's CPU GEMM handles
that shape poorly on this machine class (AVX2, no AMX): 4-16 rows against the 80 MB Whisper or
113 MB SmolLM2 LM head take 2-4x the time of reading the weights once. ``linear`` sends inputs
of at most ``MAX_ROWS`` rows to the C++ kernel (``csrc/linear.cpp``), which reads every weight
row once for all of them; larger inputs (prompts, encoders) and everything it does not serve
(non-float32, non-contiguous weights, K not a multiple of 8, autograd) go to ``F.linear``.

The kernel's outputs do not depend on the rows beside them: a sequence decoded in a batch of
16 gets the bits it gets alone (torch's GEMV for one row and GEMM for several round apart).

``rms_norm`` is ``F.rms_norm`` over the last dim in one pass a row (``csrc/linear.cpp``):
torch's is a chain of small ops, ~100 us a call in a SmolLM2 decode step, 61 calls a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcache.kernels.build import cpu_float32, extension

MAX_ROWS = 32  # rows up to which the kernel beats torch here (benchmarks/linear_rows.py)
_EMPTY = torch.empty(0)


def served(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` runs the kernel."""
    k = weight.shape[-1]
    return (
        cpu_float32(x, weight)
        and weight.dim() == 2
        and weight.is_contiguous()
        and k % 8 == 0
        and x.shape[-1] == k
        and 0 < x.numel() // k <= MAX_ROWS
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    if not served(x, weight) or (bias is not None and bias.dtype != torch.float32):
        return F.linear(x, weight, bias)
    return _kernel(x, weight, bias)


def _kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The C++ kernel on inputs ``served`` accepts."""
    k, n = weight.shape[1], weight.shape[0]
    b = _EMPTY if bias is None else bias.contiguous()
    y = extension().linear_rows(x.reshape(-1, k).contiguous(), weight, b)
    return y.view(*x.shape[:-1], n)


def add_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T`` for 2-D ``residual`` [T, N] and ``x`` [T, K] (one fused
    ``addmm`` for prompt-sized inputs)."""
    if served(x, weight):
        return residual + _kernel(x, weight, None)
    return torch.addmm(residual, x, weight.t())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (K,), weight, eps)`` for x [..., K], weight [K]: the C++ kernel for
    float32 CPU tensors with K a multiple of 8 (no autograd), else torch's."""
    k = x.shape[-1]
    if cpu_float32(x, weight) and weight.shape == (k,) and k % 8 == 0 and x.numel() > 0:
        y = extension().rms_norm_rows(x.reshape(-1, k).contiguous(), weight.contiguous(), eps)
        return y.view(x.shape)
    return F.rms_norm(x, (k,), weight, eps)

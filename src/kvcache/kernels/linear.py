"""Linear layers of decode steps: a few rows against a large weight, read once; and RMSNorm.

A decode step multiplies one row per sequence by every weight matrix. torch's CPU GEMM handles
that shape poorly on CPUs: 4-16 rows against an LM head take several times as long as reading
the weights once (docs/design/kernels.md). ``linear`` sends inputs
of at most ``MAX_ROWS`` rows to the C++ kernel (``csrc/linear.cpp``), which reads every weight
row once for all of them; larger inputs (prompts, encoders) and everything it does not serve
(non-float32, non-contiguous weights, K not a multiple of 8, autograd) go to ``F.linear``.

The kernel's outputs do not depend on the rows beside them: a sequence decoded in a batch of
16 gets the bits it gets alone (torch's GEMV for one row and GEMM for several round apart).

``rms_norm`` is ``F.rms_norm`` over the last dim in one pass a row (``csrc/linear.cpp``):
torch's is a chain of small ops.

A decode step's small ops around the products cost more than their arithmetic: between two
weight passes the caches are cold (figures: docs/design/kernels.md). So the kernel takes
the ops next to a product: ``norm_linear`` (RMSNorm, then the product) and ``add_linear``
(the residual added, and with ``glu`` SwiGLU's silu(gate) * up before the product) are one
call each, with the bits of the separate calls (norm_linear) or within a float32 rounding of
torch's silu per hidden value (glu).

Each of ``linear``, ``norm_linear`` and ``add_linear`` also takes a GGUF weight as stored
(``qlinear.QuantizedWeight``) and hands it to ``kernels.qlinear`` (int8 decode-row kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcache.kernels import qlinear
from kvcache.kernels.build import cpu_float32, extension
from kvcache.kernels.qlinear import QuantizedWeight

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


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    if isinstance(weight, QuantizedWeight):
        y = qlinear.linear(x, weight)
        return y if bias is None else y + bias
    if not served(x, weight) or (bias is not None and bias.dtype != torch.float32):
        return F.linear(x, weight, bias)
    return _kernel(x, weight, bias)


def _kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    glu: bool = False,
) -> torch.Tensor:
    """The C++ kernel on inputs ``served`` accepts (with ``glu``, x holds 2K per row)."""
    k, n = weight.shape[1], weight.shape[0]
    b = _EMPTY if bias is None else bias.contiguous()
    r = _EMPTY if residual is None else residual.contiguous()
    w, eps = (_EMPTY, 0.0) if norm is None else (norm[0].contiguous(), float(norm[1]))
    rows = x.reshape(-1, 2 * k if glu else k).contiguous()
    y = extension().linear_rows(rows, weight, b, r, w, eps, glu)
    return y.view(*x.shape[:-1], n)


def add_linear(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    *,
    glu: bool = False,
) -> torch.Tensor:
    """``residual + x @ weight.T`` for 2-D ``residual`` [T, N] and ``x`` [T, K] (one fused
    ``addmm`` for prompt-sized inputs). ``glu``: x is [T, 2K], SwiGLU's gate and up halves,
    and the product is of ``silu(x[:, :K]) * x[:, K:]`` (one kernel call a decode step)."""
    if isinstance(weight, QuantizedWeight):
        return qlinear.add_linear(residual, x, weight, glu=glu)
    if glu:
        k = weight.shape[-1]
        if x.shape[-1] == 2 * k and _served_rows(x[:, :k], weight, residual):
            return _kernel(x, weight, None, residual=residual, glu=True)
        x = swiglu(x)
    if _served_rows(x, weight, residual):
        return _kernel(x, weight, None, residual=residual)
    return torch.addmm(residual, x, weight.t())


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's hidden rows ``silu(gate) * up`` of ``gate_up`` [..., 2F] = [gate | up]."""
    f = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :f]).mul_(gate_up[..., f:])


def norm_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor | QuantizedWeight
) -> torch.Tensor:
    """``linear(rms_norm(x, norm_weight, eps), weight)``: one kernel call for decode-sized
    float32 inputs (the same bits as the two calls), else the two."""
    if isinstance(weight, QuantizedWeight):
        return qlinear.norm_linear(x, norm_weight, eps, weight)
    k = x.shape[-1]
    if served(x, weight) and cpu_float32(norm_weight) and norm_weight.shape == (k,):
        return _kernel(x, weight, None, norm=(norm_weight, eps))
    return linear(rms_norm(x, norm_weight, eps), weight)


def _served_rows(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether ``x @ weight.T + residual`` runs the kernel (a float32 residual [T, N])."""
    return (
        served(x, weight)
        and cpu_float32(residual)
        and residual.shape == (x.shape[0], weight.shape[0])
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (K,), weight, eps)`` for x [..., K], weight [K]: the C++ kernel for
    float32 CPU tensors with K a multiple of 8 (no autograd), else torch's."""
    k = x.shape[-1]
    if cpu_float32(x, weight) and weight.shape == (k,) and k % 8 == 0 and x.numel() > 0:
        y = extension().rms_norm_rows(x.reshape(-1, k).contiguous(), weight.contiguous(), eps)
        return y.view(x.shape)
    return F.rms_norm(x, (k,), weight, eps)

"""SnapOut: SnapKV's observation window, scored by how far each window query's *output*
would move were the cell alone gone, and summed over layers and heads as it is.

SnapKV asks how much attention the newest ``window`` queries pay a cell. A cell with much
attention may hold a value close to what the query gets anyway; one with little may hold a
value far from it. What the model feels is the move of the attention output through the
output projection Wo, so a cell scores, per query head h and observed row q (the softmax
over the cells the row sees, as SnapKV's):

    o_q          = sum_n p(q, n) v_n                    the row's output
    without n    o_q + p / (1 - p) (o_q - v_n)          the softmax renormalised
    cost(q, n)   = p / (1 - p) * |Wo_h (o_q - v_n)|     (1 - p clamped at 1e-6)
    scores       [Hkv, n]  mean over the window's rows, summed over the group's query heads

|Wo_h x| = |R_h x| for Wo_h = Q_h R_h (a QR factor per query head, [D, D]), so the model's
output projections are read once, at ``bind``: a press that needs them is bound to a model
(``press.bind(model)``; the engine and the benchmarks do it). Every cost is a move of the
same residual stream, so the cell score is the plain sum over layers and heads (the
``base.py`` rule, min-max per head, ranks by each head's shape instead, and reads worse).
The window's own cells are kept (SnapKV's rule: they score their layer's largest score in
every head, so their sums top every other cell's; when they alone fill the budget every cell
is scored), then the newest cell, then the largest sums.

A press for running text pressed during decode (at 1/2 of the history it beats snapkv; at
1/4 it does not); why and what it bought: docs/design/presses.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcache.errors import CallOrderError, InvalidArgumentError
from kvcache.press.base import Press, Scoring, newest_first, top_cells
from kvcache.press.snapkv import WINDOW, observed_cells, window_attention

CLAMP = 1e-6  # 1 - p floor: a cell that holds all of a row's attention
EXACT = "donot_use_mm_for_euclid_dist"  # cdist's mm form loses digits where o nears v


def out_factor(wo: torch.Tensor, head_dim: int) -> torch.Tensor:
    """R^T [Hq, D, D] float64 of each query head's slice of an output projection ``wo``
    [E, Hq * D] (Wo_h = Q_h R_h): |Wo_h x| = |x R_h^T|, in D dimensions instead of E."""
    heads = wo.double().view(wo.shape[0], -1, head_dim).transpose(0, 1)  # [Hq, E, D]
    return torch.linalg.qr(heads)[1].mT


def moved(p: torch.Tensor, o: torch.Tensor, v: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """[Hq, T, n]: how far each row's output would move were cell n alone gone,
    p / (1 - p) * |o - v_n|, from the weights p [Hq, T, n], the outputs o [Hq, T, D'] and
    the values v [Hq, n, D'] (both through ``out_factor``).

    ``exact=False`` (the press): the distances as |o|^2 + |v|^2 - 2 o.v through a matrix
    product (faster: docs/design/presses.md), except each row's most attended
    cell, whose distance is taken exactly: only there can p / (1 - p) be large (p > 1/2 for
    at most one cell), and there o nears v_n, where the product form loses its digits."""
    if exact:
        return p / (1 - p).clamp_min(CLAMP) * torch.cdist(o, v, compute_mode=EXACT)
    d = torch.cdist(o, v, compute_mode="use_mm_for_euclid_dist")  # [Hq, T, n]
    top = p.argmax(dim=-1, keepdim=True)  # [Hq, T, 1]
    near = v.gather(1, top.expand(-1, -1, v.shape[-1]))  # [Hq, T, D'] its value
    d.scatter_(-1, top, (o - near).norm(dim=-1, keepdim=True))
    return p / (1 - p).clamp_min(CLAMP) * d


class SnapOut(Press):
    """Keeps the cells whose loss would move the window's outputs most (module docstring)."""

    name = "snapout"

    def __init__(self, ratio: float, compact: bool = False, window: int = WINDOW) -> None:
        super().__init__(ratio, compact)
        self.query_rows = window
        self.factors: list[torch.Tensor] | None = None  # layer -> R^T [Hq, D, D] float64

    @property
    def needs_model(self) -> bool:
        return True

    def bind(self, model: Any) -> SnapOut:
        """Read the output projections of ``model`` (a Llama, anything with
        ``output_projections()``, or a kvzip Reconstruction: its model)."""
        model = getattr(model, "model", model)  # a Reconstruction carries its model
        get = getattr(model, "output_projections", None)
        if get is None:
            raise InvalidArgumentError(
                "model", type(model).__name__, "a model with output_projections() (a Llama)"
            )
        self.factors = [out_factor(wo, head_dim) for wo, head_dim in get()]
        return self

    def scores(self, ctx: Scoring) -> torch.Tensor:
        if self.factors is None:
            raise CallOrderError(
                "press 'snapout' weighs each cell through the model's output projections: "
                "bind it first (press.bind(model))"
            )
        if len(self.factors) != len(ctx.layers()):
            raise InvalidArgumentError(
                "model",
                f"{len(self.factors)} layers",
                f"the model whose cache is pressed ({len(ctx.layers())} layers)",
            )
        return torch.stack([self._layer(ctx, layer, self.factors[layer]) for layer in ctx.layers()])

    def select(self, ctx: Scoring, keep: int) -> np.ndarray:
        cell = self.scores(ctx).double().sum(dim=(0, 1)).numpy()  # [n], raw over L and Hkv
        return top_cells(newest_first(cell), keep)  # the window's cells sum the most

    def _layer(self, ctx: Scoring, layer: int, factor: torch.Tensor) -> torch.Tensor:
        attn, _ = window_attention(ctx, layer)  # [Hq, w, n]
        v = ctx.values(layer)  # [n, Hkv, D]
        (hq, _, n), hkv = attn.shape, v.shape[1]
        rt = factor.to(v.dtype)  # R^T [Hq, D, D]
        vh = v.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # [Hq, n, D]
        cost = moved(attn, (attn @ vh) @ rt, vh @ rt, exact=False)  # [Hq, w, n]
        s = cost.mean(dim=1).view(hkv, -1, n).sum(dim=1)  # [Hkv, n]
        window = torch.from_numpy(observed_cells(ctx, layer))
        s[:, window] = s[:, ~window].max() if (~window).any() else 1.0
        return s

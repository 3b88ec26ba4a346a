"""A press's observation window after a remove: rows the sequence feeds again replace the
ones it fed before at those positions (SnapKV's window is the newest 64 positions, each once)."""

from __future__ import annotations

import numpy as np
import torch

from greedy_reference import random_prompt
from kvcache import Batch
from kvcache.forward import ForwardPlan
from kvcache.models.llama import Llama
from kvcache.press import make_press


class Seen:
    """Every query the cache's attention shows, per forward and layer (the raw rows)."""

    def __init__(self) -> None:
        self.forwards: list[dict[int, tuple[torch.Tensor, np.ndarray]]] = []

    def __call__(self, layer: int, q: torch.Tensor, plan: ForwardPlan) -> None:
        if layer == 0:
            self.forwards.append({})
        self.forwards[-1][layer] = (q.clone(), plan.positions.copy())


def test_rows_fed_again_after_a_remove_replace_the_old_ones(history_model: Llama) -> None:
    """Observe a 100-token prefill, remove positions 90.., feed 10 other tokens at 90..99:
    the window (64 rows) holds positions 36..99 once each, 36..89 from the prefill and
    90..99 from the second forward."""
    cache = history_model.new_cache(128)
    press = make_press("snapkv:0.5")
    assert press.query_rows == 64
    seen = Seen()
    cache.add_observer(seen)
    prompt, other = random_prompt(100, seed=60), random_prompt(10, seed=61)
    assert other != prompt[90:]
    with press.observe(cache) as window:
        history_model.forward(prompt, Batch(list(range(100)), [0] * 100), cache)
        cache.remove(0, 90)
        history_model.forward(other, Batch(list(range(90, 100)), [0] * 10), cache)
    first, second = seen.forwards
    for layer in cache.layers():
        q, pos = window.queries(0, layer)
        np.testing.assert_array_equal(pos, np.arange(36, 100))  # no position twice
        old_q, old_pos = first[layer]
        new_q, new_pos = second[layer]
        np.testing.assert_array_equal(old_pos, np.arange(100))
        np.testing.assert_array_equal(new_pos, np.arange(90, 100))
        torch.testing.assert_close(q[:54], old_q[36:90].to(q.dtype), rtol=0, atol=0)
        torch.testing.assert_close(q[54:], new_q.to(q.dtype), rtol=0, atol=0)
        assert not torch.equal(new_q, old_q[90:])  # other tokens: other queries

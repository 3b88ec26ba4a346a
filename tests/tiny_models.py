"""Tiny random Llamas for exactness tests, and their sharpened kind that sees the history.

``Llama.random`` keeps activations O(1), which leaves attention nearly uniform and weak
against the token's own embedding: its greedy continuation repeats one token whatever came
before, so a cache that hands back wrong K/V still yields the reference tokens. Scaling the
attention projections (q, k, v and the output projection, each by ``SHARPNESS``) makes
attention peaked and strong, so the output follows the context;
``tests/models/test_generate.py::test_the_test_models_see_the_history`` checks that
changing one early token changes the continuation.
"""

from __future__ import annotations

import torch

from kvcache.models.llama import Llama, LlamaConfig

TINY = LlamaConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_eps=1e-6,
    context_length=256,
)
SHARPNESS = 4.0


def history_llama(
    config: LlamaConfig = TINY, *, seed: int = 0, dtype: torch.dtype = torch.float64
) -> Llama:
    """``Llama.random`` with attention sharpened so the next token depends on the history."""
    model = Llama.random(config, seed=seed, dtype=dtype)
    for layer in model.weights.layers:
        layer.wqkv.mul_(SHARPNESS)
        layer.wo.mul_(SHARPNESS)
    return model

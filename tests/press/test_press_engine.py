"""The engine with a press: every request is pressed once after its prefill, its text goes
on, the stats book what was freed, and bytes held against the history seen."""

from __future__ import annotations

import numpy as np

from kvcache import Batch
from kvcache.generate import GenerationConfig, Generator
from kvcache.models.llama import Llama
from kvcache.press import make_press


def test_generator_presses_each_request_after_prefill(history_model: Llama) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, 100).tolist(), rng.integers(0, 97, 80).tolist()]
    done = {}
    for press in (None, "knorm:0.5", "snapkv:0.5", "snapkv:0.5,compact=1"):
        gen = Generator(history_model, capacity=160, max_sequences=2, press=press)
        ids = gen.add_many(prompts, GenerationConfig(max_new_tokens=8))
        for _ in gen.run():
            pass
        done[press] = [gen.results[i].tokens for i in ids]
        s = gen.stats
        assert s.pressed_cells == (0 if press is None else 50 + 40)
        if press is None:
            plain = s.total_compression
        else:
            assert s.total_compression > 1.6 * plain
            assert gen.engine.press is not None and not gen.engine.press.window.has(0)
        gen.close()
    assert all(len(t) == 8 for t in done["snapkv:0.5"])
    for spec in ("snapkv:0.5", "snapkv:0.5,compact=1"):  # the engine = the library by hand
        assert done[spec][0] == by_hand(history_model, prompts[0], spec, 8)


def by_hand(model: Llama, prompt: list[int], spec: str, n: int) -> list[int]:
    """Greedy tokens: prefill under observe, compress, then decode at next_position."""
    cache = model.new_cache(160)
    press = make_press(spec)
    with press.observe(cache):
        logits = model.forward(prompt, Batch(list(range(len(prompt))), [0] * len(prompt)), cache)
    press.compress(cache, 0)
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        p = cache.next_position(0)
        out.append(int(model.forward([out[-1]], Batch([p], [0]), cache)[0].argmax()))
    return out

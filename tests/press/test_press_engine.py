"""The engine with a press: every request is pressed once after its prefill, its text goes
on, the stats book what was freed, and bytes held against the history seen."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from greedy_reference import random_prompt
from kvcache import Batch, CausalCache
from kvcache.engine import Engine, EngineConfig, Request, RequestParams
from kvcache.errors import InvalidArgumentError
from kvcache.generate import GenerationConfig, Generator
from kvcache.models.llama import Llama
from kvcache.press import Press, Reconstruction, make_press


def test_generator_presses_each_request_after_prefill(history_model: Llama) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, 100).tolist(), rng.integers(0, 97, 80).tolist()]
    done = {}
    for press in (None, "knorm:0.5", "snapkv:0.5", "snapkv:0.5,compact=1", "snapout:0.5"):
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
    # the engine = the library by hand (snapout: bound to the engine's model)
    for spec in ("snapkv:0.5", "snapkv:0.5,compact=1", "snapout:0.5"):
        assert done[spec][0] == by_hand(history_model, prompts[0], spec, 8)


def by_hand(
    model: Llama, prompt: list[int], spec: str | Press | None, n: int, capacity: int = 160
) -> list[int]:
    """Greedy tokens: prefill under observe, compress, then decode at next_position."""
    cache = model.new_cache(capacity)
    press = make_press(spec).bind(model) if isinstance(spec, str) else spec
    if press is None:
        logits = model.forward(prompt, Batch(list(range(len(prompt))), [0] * len(prompt)), cache)
    else:
        with press.observe(cache):
            logits = model.forward(
                prompt, Batch(list(range(len(prompt))), [0] * len(prompt)), cache
            )
        press.compress(cache, 0, tokens=prompt)
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        p = cache.next_position(0)
        out.append(int(model.forward([out[-1]], Batch([p], [0]), cache)[0].argmax()))
    return out


class ChatTokens:
    """A tokenizer stand-in for the tiny model: characters as ids below its vocabulary, and a
    chat template that wraps the user's content in [1] ... [2]."""

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        return [ord(c) % 90 + 5 for c in text]

    stop_ids: frozenset[int] = frozenset()  # no stop token: every request runs its length

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i + 60) for i in ids)

    def apply_chat(self, messages: list[dict[str, str]]) -> str:
        return "\x01" + messages[0]["content"] + "\x02"


def test_generator_kvzip_repeats_each_context_through_the_model(history_model: Llama) -> None:
    """kvzip in the engine: bound to the engine's model and the tokenizer's template, each
    request pressed as the library does by hand; with no room for the repeat, a request is
    left unpressed (counted) and decodes as without a press."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, 100).tolist(), rng.integers(0, 97, 80).tolist()]
    tok = ChatTokens()
    rec = Reconstruction.for_template(history_model, lambda t: tok.encode(t), "\x01", "\x02")
    assert rec.skip == 1 and rec.suffix == tok.encode("\x02")
    config = GenerationConfig(max_new_tokens=6)
    gen = Generator(history_model, tok, capacity=400, max_sequences=2, press="kvzip:0.5")  # type: ignore[arg-type]
    ids = gen.add_many(prompts, config)
    for _ in gen.run():
        pass
    assert gen.stats.pressed_cells == 50 + 40 and gen.stats.press_skipped == 0
    got = gen.results[ids[0]].tokens
    gen.close()
    press = make_press("kvzip:0.5").bind(rec)
    assert got == by_hand(history_model, prompts[0], press, 6, capacity=400)
    # 240 cells: room for the prompts (180) but not for a repeat of one (172): none pressed
    gen = Generator(history_model, tok, capacity=120, max_sequences=2, press="kvzip:0.5")  # type: ignore[arg-type]
    ids = gen.add_many(prompts, config)
    for _ in gen.run():
        pass
    assert gen.stats.pressed_cells == 0 and gen.stats.press_skipped == 2
    assert gen.results[ids[0]].tokens == by_hand(history_model, prompts[0], None, 6)
    gen.close()
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        Generator(history_model, capacity=400, press="kvzip:0.5")


def by_hand_decode(
    model: Llama,
    prompt: list[int],
    spec: str,
    n: int,
    cells: int,
    every: int,
    preempted: Sequence[int] = (),
    recompute: bool = False,
) -> tuple[list[int], int]:
    """Greedy tokens and cells freed: the prompt pressed by the spec's ratio, then after
    every ``every``-th decode step back to ``cells`` once it holds more. ``preempted``: the
    numbers of tokens generated when the request lost its cells, as the engine's pressing
    docstring says it goes on: spilled, its cells come back as stored and its steps and
    queries count from the restore; recomputed (``recompute``), the tokens its cells held
    and its last token are prefilled again and pressed as a prompt."""
    cache = model.new_cache(160)
    press = make_press(spec).bind(model)
    context = list(prompt)  # the tokens at positions 0.. (a compacting press renumbers them)

    def pressed(keep: int | None) -> int:
        before, positions = cache.cells_of(0), np.asarray(cache.positions(0))
        freed = press.compress(cache, 0) if keep is None else press.compress_to(cache, 0, keep)
        if press.compact and freed:
            context[:] = [context[p] for p in positions[np.isin(before, cache.cells_of(0))]]
        return freed

    with press.observe(cache) as window:
        logits = model.forward(context, Batch(list(range(len(context))), [0] * len(context)), cache)
        freed = pressed(None)
        out, steps = [int(logits[-1].argmax())], 0
        while len(out) < n:
            if len(out) in preempted:
                window.forget(0)
                steps = 0
                if recompute:
                    cache.remove(0, 0)
                    context.append(out[-1])
                    batch = Batch(list(range(len(context))), [0] * len(context))
                    logits = model.forward(context, batch, cache)
                    freed += pressed(None)
                    out.append(int(logits[-1].argmax()))
                    continue
            p = cache.next_position(0)
            logits = model.forward([out[-1]], Batch([p], [0]), cache)
            context.append(out[-1])
            steps += 1
            if steps % every == 0 and len(cache.cells_of(0)) > cells:
                freed += pressed(cells)
            assert steps < every or len(cache.cells_of(0)) < cells + every
            out.append(int(logits[0].argmax()))
    return out, freed


@pytest.mark.parametrize("spec", ["snapkv:0", "snapout:0", "snapout:0.5", "snapkv:0.3,compact=1"])
def test_generator_presses_during_decode_back_to_press_cells(
    history_model: Llama, spec: str
) -> None:
    """press_cells: each request pressed back to 40 cells every 8 decode steps, exactly as
    the library does by hand (tokens and cells freed), beside another request."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 97, 60).tolist(), rng.integers(0, 97, 50).tolist()]
    gen = Generator(
        history_model, capacity=160, max_sequences=2, press=spec, press_cells=40, press_every=8
    )
    ids = gen.add_many(prompts, GenerationConfig(max_new_tokens=48))
    for _ in gen.run():
        pass
    got = [gen.results[i].tokens for i in ids]
    pressed = gen.stats.pressed_cells
    gen.close()
    want = [by_hand_decode(history_model, p, spec, 48, 40, 8) for p in prompts]
    assert got == [w[0] for w in want]
    # 107 and 97 cells fed, at most 40 + 7 held at the end
    assert pressed == sum(w[1] for w in want) >= (107 - 47) + (97 - 47)


def test_press_cells_needs_a_press_that_scores_without_repeating() -> None:
    from kvcache.commands.options import check_press
    from kvcache.engine.params import EngineConfig
    from kvcache.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="press_cells"):
        EngineConfig(press_cells=64)
    with pytest.raises(InvalidConfigError, match="kvzip"):
        EngineConfig(press="kvzip:0.5", press_cells=64)
    with pytest.raises(InvalidConfigError, match="press_cells"):
        EngineConfig(press="snapkv:0.5", press_cells=0)
    with pytest.raises(InvalidConfigError, match="press_every"):
        EngineConfig(press="snapkv:0.5", press_cells=64, press_every=0)
    assert EngineConfig(press="snapout:0", press_cells=64).press_cells == 64
    for spec, cells, every in [(None, 64, 16), ("kvzip:0.5", 64, 16), ("snapkv:0.5", 0, 16),
                               ("snapkv:0.5", 64, 0)]:  # fmt: skip
        with pytest.raises(InvalidArgumentError, match="--press"):
            check_press(spec, cells, every)
    check_press("snapout:0", 64, 8)


def test_serve_and_generate_pass_the_press_options_on() -> None:
    import argparse

    from kvcache.commands import generate, serve

    parser = argparse.ArgumentParser()
    serve.register(parser)
    argv = ["--press", "snapout:0", "--press-cells", "256", "--press-every", "4"]
    config = serve._engine_config(parser.parse_args(argv))
    assert (config.press, config.press_cells, config.press_every) == ("snapout:0", 256, 4)
    assert serve._engine_config(parser.parse_args([])).press_cells is None
    with pytest.raises(InvalidArgumentError, match="--press-cells"):
        serve._engine_config(parser.parse_args(["--press-cells", "256"]))
    parser = argparse.ArgumentParser()
    generate.register(parser)
    args = parser.parse_args(["hello", *argv])
    assert (args.press_cells, args.press_every) == (256, 4)


def test_decode_pressing_forgets_finished_requests(history_model: Llama) -> None:
    """A long-running engine keeps no per-request decode state once a request ends."""
    gen = Generator(history_model, capacity=160, press="snapkv:0", press_cells=20, press_every=4)
    gen.add_many([[5] * 30, [7] * 30], GenerationConfig(max_new_tokens=12))
    for _ in gen.run():
        pass
    press = gen.engine.press
    assert press is not None and gen.stats.pressed_cells > 0
    assert press._steps == {} and press._done == set() and not press.window.has(0)
    gen.close()


@pytest.mark.parametrize("spec", ["snapkv:0", "snapkv:0.2,compact=1", "snapout:0"])
@pytest.mark.parametrize("preemption", ["spill", "recompute"])
def test_decode_pressing_goes_on_through_preemption(
    history_model: Llama, spec: str, preemption: str
) -> None:
    """4 requests of 20 + 60 tokens in a pool of 96 cells, each pressed back to 24 cells:
    a request is preempted (spilled and restored, or recomputed) and every one still runs
    its length, pressed after it comes back (by the queries seen since): its tokens and the
    cells freed are those of the library by hand through the same preemptions."""
    config = EngineConfig(
        capacity=96,
        max_sequences=4,
        pool_sequences=1,
        max_batch=64,
        press=spec,
        press_cells=24,
        press_every=4,
        preemption=preemption,
    )
    engine = Engine(history_model, config=config)
    preempted: dict[int, list[int]] = {}  # request id -> tokens it had generated
    preempt = engine.preemption.preempt

    def spy(cache: CausalCache, request: Request) -> None:
        assert request.fed == len(request.context) - 1, "preempted while decoding"
        preempted.setdefault(request.id, []).append(len(request.generated))
        preempt(cache, request)

    engine.preemption.preempt = spy  # type: ignore[method-assign]
    prompts = [random_prompt(20, seed=30 + i) for i in range(4)]
    reqs = [engine.submit(p, RequestParams(max_tokens=60)) for p in prompts]
    engine.run()
    s = engine.stats
    assert all(r.finish_reason == "length" for r in reqs)
    assert s.preemptions == sum(len(v) for v in preempted.values()) >= 1
    assert s.restores == s.spills == (s.preemptions if preemption == "spill" else 0)
    want = [
        by_hand_decode(
            history_model, p, spec, 60, 24, 4, preempted.get(r.id, ()), preemption == "recompute"
        )
        for p, r in zip(prompts, reqs, strict=True)
    ]
    assert [r.generated for r in reqs] == [w[0] for w in want]
    # 4 x 79 cells fed (the recomputed context once more), at most 27 held at each end
    assert s.pressed_cells == sum(w[1] for w in want) >= 4 * (79 - 27)

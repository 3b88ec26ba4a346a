"""Generation (the facade over the engine) against no-cache references, on tiny float64 models
whose next token depends on the history (``tests/tiny_models.py``): greedy, many prompts at
once, prompts joining later, queueing, the shared-prompt fork, context shifting (with a
shared prefix too), sliding windows, sampling reproducibility, and the streaming/stop-string
text machinery."""

from __future__ import annotations

import pytest
import torch

from greedy_reference import greedy, greedy_with_shift, random_prompt
from kvcache.errors import InvalidArgumentError
from kvcache.generate import GenerationConfig, Generator, generate
from kvcache.models.llama import Llama
from kvcache.models.sampling import SamplingParams, sample
from kvcache.text.stream import IncrementalDecoder, StopMatcher


def run_all(gen: Generator) -> None:
    for _ in gen.run():
        pass


def changed_by_one_early_token(model: Llama, prompts: int = 8, n: int = 8) -> int:
    """Of ``prompts`` random prompts, how many continue differently (within ``n`` greedy
    tokens, from no-cache forwards) when token 1 changes."""
    changed = 0
    for seed in range(prompts):
        a = random_prompt(10, seed=seed)
        b = list(a)
        b[1] = (b[1] + 1) % 97
        for _ in range(n):  # side by side: most pairs differ at the first token
            a.append(int(model.forward_full(a)[-1].argmax()))
            b.append(int(model.forward_full(b)[-1].argmax()))
            if a[-1] != b[-1]:
                changed += 1
                break
    return changed


def test_the_test_models_see_the_history(history_model: Llama, history_one_layer: Llama):
    # the guard of every reference comparison here: with wrong K/V the tokens would differ.
    # Llama.random's own weights (the contrast) continue the same whatever token 1 is.
    assert changed_by_one_early_token(history_model) == 8
    assert changed_by_one_early_token(history_one_layer) >= 7
    plain = Llama.random(history_one_layer.config, seed=1, dtype=torch.float64)
    assert changed_by_one_early_token(plain) <= 1


def test_greedy_generation_equals_no_cache_reference(history_model: Llama):
    ids = random_prompt(9, seed=1)
    [done] = generate(history_model, None, ids, GenerationConfig(max_new_tokens=12))
    assert done.tokens == greedy(history_model, ids, 12)
    assert done.finish_reason == "length"


def test_many_prompts_in_one_cache_equal_each_alone(history_model: Llama):
    prompts = [random_prompt(5, seed=2), random_prompt(11, seed=3), random_prompt(3, seed=4)]
    configs = [GenerationConfig(max_new_tokens=n) for n in (6, 3, 9)]
    gen = Generator(history_model, capacity=32, max_sequences=3, max_batch=8)
    ids = [gen.add(p, c) for p, c in zip(prompts, configs, strict=True)]
    run_all(gen)
    for i, p, c in zip(ids, prompts, configs, strict=True):
        assert gen.results[i].tokens == greedy(history_model, p, c.max_new_tokens)
    # finished sequences gave back every cell but those they keep as prefix holders
    assert gen.cache.used_cells() == gen.engine.holder_cells() > 0
    # max_batch 8 forced chunked prefill; decoding was shared: fewer forwards than tokens
    assert gen.stats.forwards < sum(c.max_new_tokens for c in configs) + 3


def test_prompt_longer_than_max_batch_is_prefilled_in_chunks(history_model: Llama):
    ids = random_prompt(23, seed=12)
    gen = Generator(history_model, capacity=40, max_batch=5)
    rid = gen.add(ids, GenerationConfig(max_new_tokens=4))
    run_all(gen)
    assert gen.results[rid].tokens == greedy(history_model, ids, 4)
    assert gen.stats.forwards == 5 + 3  # ceil(23 / 5) prefill chunks, then 3 decode steps


def test_prompt_joining_between_steps_and_queueing(history_model: Llama):
    first, late, queued = (
        random_prompt(6, seed=5),
        random_prompt(4, seed=6),
        random_prompt(7, seed=7),
    )
    gen = Generator(history_model, capacity=32, max_sequences=2)
    cfg = GenerationConfig(max_new_tokens=8)
    a = gen.add(first, cfg)
    for _ in range(3):
        gen.step()
    b = gen.add(late, cfg)  # joins while `first` decodes
    c = gen.add(queued, cfg)  # no free slot: waits for one to finish
    run_all(gen)
    for rid, p in ((a, first), (b, late), (c, queued)):
        assert gen.results[rid].tokens == greedy(history_model, p, 8)


def test_shared_prefix_is_computed_once(history_model: Llama):
    base = random_prompt(10, seed=8)
    prompts = [base + [1, 2], base + [3], list(base), base + [4, 5, 6]]
    gen = Generator(history_model, capacity=32, max_sequences=4)
    ids = gen.add_many(prompts, GenerationConfig(max_new_tokens=5))
    run_all(gen)
    for rid, p in zip(ids, prompts, strict=True):
        assert gen.results[rid].tokens == greedy(history_model, p, 5)
    assert gen.stats.prompt_tokens == sum(len(p) for p in prompts)
    # the first computes its 12 tokens; the others wait for it, take its cells (all of their
    # prompt but the last token, or the common prefix) and compute only the rest
    assert gen.stats.reused_tokens == 10 + 9 + 10
    assert gen.stats.prefill_tokens == 12 + 1 + 1 + 3


def test_context_shift_keeps_first_tokens_and_halves_the_rest(history_one_layer: Llama):
    # one layer, so the shifted cache equals the cache of the kept tokens exactly
    model = history_one_layer
    ids = random_prompt(6, seed=9)
    capacity, keep, n_new = 12, 2, 20
    gen = Generator(model, capacity=capacity, keep=keep)
    rid = gen.add(ids, GenerationConfig(max_new_tokens=n_new))
    run_all(gen)
    assert gen.results[rid].tokens == greedy_with_shift(model, ids, n_new, capacity, keep)
    assert gen.stats.shifts >= 2


def test_context_shift_keeps_a_prefix_shared_with_another_sequence(history_one_layer: Llama):
    # the second prompt takes the first's 5-token prefix (shared cells cannot move): both
    # sequences shift keeping those 5 tokens, not the 2 asked for
    model = history_one_layer
    base = random_prompt(5, seed=15)
    prompts = [[*base, 7], [*base, 8]]
    capacity, n_new = 12, 16
    gen = Generator(model, capacity=capacity, max_sequences=2, keep=2)
    ids = gen.add_many(prompts, GenerationConfig(max_new_tokens=n_new))
    run_all(gen)
    for rid, p in zip(ids, prompts, strict=True):
        assert gen.results[rid].tokens == greedy_with_shift(model, p, n_new, capacity, keep=5)
    assert gen.stats.reused_tokens == 5 and gen.stats.shifts >= 4


def test_sliding_window_generation_equals_windowed_reference(history_model: Llama):
    window, n_new = 5, 14
    prompts = [random_prompt(7, seed=13), random_prompt(4, seed=14)]
    gen = Generator(history_model, capacity=8, max_sequences=2, max_batch=4, window=window)
    ids = [gen.add(p, GenerationConfig(max_new_tokens=n_new)) for p in prompts]
    run_all(gen)
    for rid, p in zip(ids, prompts, strict=True):
        # positions grow past capacity: the window forgets, nothing shifts
        assert gen.results[rid].tokens == greedy(history_model, p, n_new, window)
    assert gen.stats.shifts == 0


def test_sampling_is_reproducible_and_filters_work(history_model: Llama):
    ids = random_prompt(5, seed=10)

    def tokens(sampling: SamplingParams) -> list[int]:
        cfg = GenerationConfig(max_new_tokens=10, sampling=sampling)
        return generate(history_model, None, ids, cfg)[0].tokens

    hot = SamplingParams(temperature=1.5, seed=7)
    assert tokens(hot) == tokens(hot)
    assert tokens(hot) != tokens(SamplingParams(temperature=1.5, seed=8))
    want = greedy(history_model, ids, 10)
    assert tokens(SamplingParams(temperature=1.0, top_k=1, seed=1)) == want
    assert tokens(SamplingParams(temperature=1.0, top_p=1e-6, seed=1)) == want


def test_parallel_samples_of_one_prompt_differ_but_share_the_prompt(history_model: Llama):
    ids = random_prompt(8, seed=11)
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=2.0, seed=3))
    gen = Generator(history_model, capacity=32, max_sequences=3)
    rids = gen.add_many([ids] * 3, cfg)
    run_all(gen)
    assert len({tuple(gen.results[r].tokens) for r in rids}) == 3  # seeds seed+0, +1, +2
    assert gen.stats.prefill_tokens == 8 + 1 + 1  # the prompt once, then each one's last token
    one = generate(history_model, None, ids, cfg)[0].tokens  # seed + 0 alone
    assert gen.results[rids[0]].tokens == one


def test_top_k_top_p_sample_only_allowed_tokens():
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0, 4.8])
    rng = torch.Generator().manual_seed(0)
    seen_k = {sample(logits, SamplingParams(1.0, top_k=2), rng) for _ in range(200)}
    assert seen_k == {1, 2}
    # top-p 0.5: token 1 alone has ~35 % of the mass, 1 and 2 together more than 0.5
    seen_p = {sample(logits, SamplingParams(1.0, top_p=0.5), rng) for _ in range(200)}
    assert seen_p == {1, 2}


def test_invalid_generation_arguments(history_model: Llama):
    with pytest.raises(InvalidArgumentError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(InvalidArgumentError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(InvalidArgumentError, match="stop"):
        GenerationConfig(stop="END")  # a str, not a list of them
    gen = Generator(history_model, capacity=8)
    with pytest.raises(InvalidArgumentError, match="prompt"):
        gen.add("text needs a tokenizer")
    with pytest.raises(InvalidArgumentError, match="prompt"):
        gen.add_many([[1, 2], [1, 500]])
    assert not gen.busy  # the valid first prompt was not queued either
    with pytest.raises(InvalidArgumentError, match="keep"):
        Generator(history_model, capacity=8, keep=4)


def test_incremental_decoder_never_splits_a_character():
    # a toy byte-level vocabulary: each token is one byte of UTF-8
    text = "añ😀b é"
    data = text.encode()

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    dec = IncrementalDecoder(decode)
    deltas = [dec.push(b) for b in data] + [dec.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[data.index("😀".encode())] == ""  # first byte of the emoji: held back


def test_stop_matcher_cuts_and_holds_back():
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("hello E") == "hello "  # "E" may start "END"
    assert m.feed("N") == ""
    assert m.feed("Dtail") == "" and m.stopped
    m = StopMatcher(["END"])
    assert m.feed("hi E") == "hi "
    assert m.feed("x") == "Ex"
    assert m.feed("E") == "" and m.flush() == "E"
    m = StopMatcher(["\n\n"])
    assert m.feed("a\n") == "a" and m.feed("\nb") == "" and m.stopped

"""Generation on the shared cache against no-cache references (tiny float64 model): greedy,
many prompts at once, prompts joining later, queueing, shared prefixes, context shifting,
sampling reproducibility, and the streaming/stop-string text machinery."""

from __future__ import annotations

import pytest
import torch

from kvcache.errors import InvalidArgumentError
from kvcache.generate import GenerationConfig, Generator, generate
from kvcache.models.llama import Llama
from kvcache.models.sampling import SamplingParams, sample
from kvcache.text.stream import IncrementalDecoder, StopMatcher


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


def greedy_reference(model: Llama, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a full no-cache forward over everything so far."""
    out = list(ids)
    for _ in range(n):
        out.append(int(model.forward_full(out)[-1].argmax()))
    return out[len(ids) :]


def run_all(gen: Generator) -> None:
    for _ in gen.run():
        pass


def test_greedy_generation_equals_no_cache_reference(tiny: Llama):
    ids = prompt(9, seed=1)
    [done] = generate(tiny, None, ids, GenerationConfig(max_new_tokens=12))
    assert done.tokens == greedy_reference(tiny, ids, 12)
    assert done.finish_reason == "length"


def test_many_prompts_in_one_cache_equal_each_alone(tiny: Llama):
    prompts = [prompt(5, seed=2), prompt(11, seed=3), prompt(3, seed=4)]
    configs = [GenerationConfig(max_new_tokens=n) for n in (6, 3, 9)]
    gen = Generator(tiny, capacity=32, max_sequences=3, max_batch=8)
    ids = [gen.add(p, c) for p, c in zip(prompts, configs, strict=True)]
    run_all(gen)
    for i, p, c in zip(ids, prompts, configs, strict=True):
        assert gen.results[i].tokens == greedy_reference(tiny, p, c.max_new_tokens)
    assert gen.cache.used_cells() == 0  # finished sequences gave their cells back
    # max_batch 8 forced chunked prefill; decoding was shared: fewer forwards than tokens
    assert gen.stats.forwards < sum(c.max_new_tokens for c in configs) + 3


def test_prompt_longer_than_max_batch_is_prefilled_in_chunks(tiny: Llama):
    ids = prompt(23, seed=12)
    gen = Generator(tiny, capacity=40, max_batch=5)
    rid = gen.add(ids, GenerationConfig(max_new_tokens=4))
    run_all(gen)
    assert gen.results[rid].tokens == greedy_reference(tiny, ids, 4)
    assert gen.stats.forwards == 5 + 3  # ceil(23 / 5) prefill chunks, then 3 decode steps


def test_prompt_joining_between_steps_and_queueing(tiny: Llama):
    first, late, queued = prompt(6, seed=5), prompt(4, seed=6), prompt(7, seed=7)
    gen = Generator(tiny, capacity=32, max_sequences=2)
    cfg = GenerationConfig(max_new_tokens=8)
    a = gen.add(first, cfg)
    for _ in range(3):
        gen.step()
    b = gen.add(late, cfg)  # joins while `first` decodes
    c = gen.add(queued, cfg)  # no free sequence id: waits for one to finish
    run_all(gen)
    for rid, p in ((a, first), (b, late), (c, queued)):
        assert gen.results[rid].tokens == greedy_reference(tiny, p, 8)


def test_shared_prefix_is_computed_once(tiny: Llama):
    base = prompt(10, seed=8)
    prompts = [base + [1, 2], base + [3], list(base), base + [4, 5, 6]]
    gen = Generator(tiny, capacity=32, max_sequences=4)
    ids = gen.add_many(prompts, GenerationConfig(max_new_tokens=5))
    run_all(gen)
    for rid, p in zip(ids, prompts, strict=True):
        assert gen.results[rid].tokens == greedy_reference(tiny, p, 5)
    assert gen.stats.prompt_tokens == sum(len(p) for p in prompts)
    assert gen.stats.prefill_tokens == len(base) + 2 + 1 + 0 + 3
    assert gen.cache.used_cells() == 0


def test_context_shift_keeps_first_tokens_and_halves_the_rest(tiny_one_layer: Llama):
    # one layer, so the shifted cache equals the cache of the kept tokens exactly
    model = tiny_one_layer
    ids = prompt(6, seed=9)
    capacity, keep, n_new = 12, 2, 20
    gen = Generator(model, capacity=capacity, keep=keep)
    rid = gen.add(ids, GenerationConfig(max_new_tokens=n_new))
    run_all(gen)
    got = gen.results[rid].tokens
    # reference: the same policy on a token list, each token from a full forward
    held, out = list(ids), []
    for _ in range(n_new):
        nxt = int(model.forward_full(held)[-1].argmax())
        out.append(nxt)
        if len(held) + 1 > capacity:  # feeding nxt would overflow: shift first
            discard = (len(held) - keep) // 2
            del held[keep : keep + discard]
        held.append(nxt)
    assert got == out
    assert gen.stats.shifts >= 2


def test_sliding_window_generation_equals_windowed_reference(tiny: Llama):
    window, n_new = 5, 14
    prompts = [prompt(7, seed=13), prompt(4, seed=14)]
    gen = Generator(tiny, capacity=8, max_sequences=2, max_batch=4, window=window)
    ids = [gen.add(p, GenerationConfig(max_new_tokens=n_new)) for p in prompts]
    run_all(gen)
    for rid, p in zip(ids, prompts, strict=True):
        ref = list(p)
        for _ in range(n_new):  # positions grow past capacity: the window forgets, no shift
            ref.append(int(tiny.forward_full(ref, window=window)[-1].argmax()))
        assert gen.results[rid].tokens == ref[len(p) :]
    assert gen.stats.shifts == 0


def test_sampling_is_reproducible_and_filters_work(tiny: Llama):
    ids = prompt(5, seed=10)
    hot = SamplingParams(temperature=1.5, seed=7)
    a = generate(tiny, None, ids, GenerationConfig(max_new_tokens=10, sampling=hot))[0].tokens
    b = generate(tiny, None, ids, GenerationConfig(max_new_tokens=10, sampling=hot))[0].tokens
    c = generate(
        tiny,
        None,
        ids,
        GenerationConfig(max_new_tokens=10, sampling=SamplingParams(temperature=1.5, seed=8)),
    )[0].tokens
    assert a == b
    assert a != c
    greedy = greedy_reference(tiny, ids, 10)
    for params in (
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=1),
    ):
        cfg = GenerationConfig(max_new_tokens=10, sampling=params)
        assert generate(tiny, None, ids, cfg)[0].tokens == greedy


def test_parallel_samples_of_one_prompt_differ_but_share_the_prompt(tiny: Llama):
    ids = prompt(8, seed=11)
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=2.0, seed=3))
    outs = generate(tiny, None, [ids] * 3, cfg)
    assert len({tuple(o.tokens) for o in outs}) == 3  # seeds seed+0, seed+1, seed+2


def test_top_k_top_p_sample_only_allowed_tokens():
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0, 4.8])
    rng = torch.Generator().manual_seed(0)
    seen_k = {sample(logits, SamplingParams(1.0, top_k=2), rng) for _ in range(200)}
    assert seen_k == {1, 2}
    # top-p 0.5: token 1 alone has ~35 % of the mass, 1 and 2 together more than 0.5
    seen_p = {sample(logits, SamplingParams(1.0, top_p=0.5), rng) for _ in range(200)}
    assert seen_p == {1, 2}


def test_invalid_generation_arguments(tiny: Llama):
    with pytest.raises(InvalidArgumentError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(InvalidArgumentError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    gen = Generator(tiny, capacity=8)
    with pytest.raises(InvalidArgumentError, match="prompt"):
        gen.add("text needs a tokenizer")
    with pytest.raises(InvalidArgumentError, match="prompt"):
        gen.add([1, 500])
    with pytest.raises(InvalidArgumentError, match="keep"):
        Generator(tiny, capacity=8, keep=4)


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

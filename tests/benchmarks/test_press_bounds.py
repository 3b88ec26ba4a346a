"""benchmarks/press_bounds.py: the head-wise eviction simulation and the future-attention oracle."""

from __future__ import annotations

import numpy as np
import torch

import kv_quality as kq
import press_bounds as pb
from kvcache.models.llama import Llama

TOKENS = [(7 * i + 3) % 90 + 2 for i in range(120)]
PREFILL = 80


def test_the_simulation_without_a_press_is_the_cache(history_model: Llama) -> None:
    base, _ = pb.unpressed(history_model, TOKENS, PREFILL)
    c = history_model.config
    cache = kq.make_cache(history_model, "fp32", len(TOKENS))
    pb.PerHead(cache, c.num_layers, c.num_kv_heads, len(TOKENS))
    lp = pb.decode_logprobs(history_model, cache, TOKENS, PREFILL, lambda i: None)
    assert torch.allclose(lp, base, atol=1e-3, rtol=0)  # float32 K/V: kernel vs torch


def test_each_head_keeps_its_own_cells_and_sees_only_them(history_model: Llama) -> None:
    c = history_model.config
    cache = kq.make_cache(history_model, "fp32", len(TOKENS))
    sim = pb.PerHead(cache, c.num_layers, c.num_kv_heads, len(TOKENS))
    pb.decode_logprobs(history_model, cache, TOKENS[: PREFILL + 2], PREFILL, lambda i: None)
    n, keep = PREFILL + 1, 70
    sim.press(n, keep)
    kept = sim.valid[:, :, :n]
    assert (kept.sum(-1) == keep).all()  # exactly the budget, per layer and head
    assert kept[:, :, n - pb.WINDOW :].all()  # the observed window stays
    assert any(not torch.equal(kept[layer, 0], kept[layer, 1]) for layer in range(c.num_layers))
    # a next step attends, per head, to that head's cells only
    from kvcache import Batch

    cache.start_forward(Batch.single(0, n, 1))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, c.num_heads, c.head_dim, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 1, c.num_kv_heads, c.head_dim, generator=g, dtype=torch.float64)
    out = sim.attention(0, q, k, v)
    keys, values = (x.double() for x in cache.get(0)[:2])  # float32 codes
    group = c.num_heads // c.num_kv_heads
    for hq in range(c.num_heads):
        h = hq // group
        seen = torch.cat([kept[0, h], torch.tensor([True])])  # the new token is seen
        w = torch.softmax(keys[seen, h] @ q[0, hq] / c.head_dim**0.5, dim=0)
        assert torch.allclose(out[0, hq].double(), w @ values[seen, h], atol=1e-5)


def test_the_oracle_keeps_the_cell_the_next_queries_attend_to(history_model: Llama) -> None:
    cache = kq.make_cache(history_model, "fp32", len(TOKENS))
    pb.decode_logprobs(history_model, cache, TOKENS[:PREFILL], PREFILL, lambda i: None)
    n, target = PREFILL, 17
    future = {}
    for layer in cache.layers():
        k = cache.read(layer, torch.arange(n))[0]  # [n, Hkv, D]
        q = k[target].repeat_interleave(history_model.config.num_heads // k.shape[1], 0)
        future[layer] = (40 * q[None], np.array([n]))  # the query of position n, 1 row
    press = pb.FutureAttention(future, every=4)
    ctx = press.scoring(cache, 0, 2)
    assert list(press.select(ctx, 2)) == [target, n - 1]  # it, and the newest cell
    far = pb.FutureAttention({layer: (q, p + 10) for layer, (q, p) in future.items()}, every=4)
    assert target not in far.select(far.scoring(cache, 0, 2), 2)  # not within `every`: unseen


def test_the_head_oracle_keeps_each_heads_most_attended_cell(history_model: Llama) -> None:
    c = history_model.config
    cache = kq.make_cache(history_model, "fp32", len(TOKENS))
    n, every = PREFILL, 4
    pb.decode_logprobs(history_model, cache, TOKENS[:n], n, lambda i: None)
    group = c.num_heads // c.num_kv_heads
    future, want, decoyed = {}, {}, False
    for layer in cache.layers():
        k = cache.read(layer, torch.arange(n))[0].double()  # [n, Hkv, D]
        q = torch.stack([k[(11 * h + 5) % n, h] for h in range(c.num_kv_heads)])  # [Hkv, D]
        # the query of position n - 1 (already seen, not to come) aims elsewhere, harder
        decoy = 3 * torch.stack([k[(11 * h + 40) % n, h] for h in range(c.num_kv_heads)])
        rows = torch.stack([decoy, q]).repeat_interleave(group, 1).float()  # [2, Hq, D]
        future[layer] = (rows, np.array([n - 1, n]))
        want[layer] = torch.einsum("nhd,hd->hn", k, q).argmax(-1)  # per head: the top logit
        decoyed |= not torch.equal(torch.einsum("nhd,hd->hn", k, decoy).argmax(-1), want[layer])
    assert decoyed  # the decoy would change some head's choice
    sim = pb.PerHeadOracle(cache, c.num_layers, c.num_kv_heads, len(TOKENS), future, every)
    sim.press(n, 1)
    for layer in cache.layers():
        kept = sim.valid[layer, :, :n]
        assert (kept.sum(-1) == 1).all()
        assert torch.equal(kept.float().argmax(-1), want[layer])
    assert len({tuple(w.tolist()) for w in want.values()}) > 1  # heads and layers differ

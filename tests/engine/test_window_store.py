"""Prefix blocks published under a sliding window: a request whose window has forgotten its
first positions publishes the blocks it still holds, each with its own positions' cells, and
a warm windowed engine that loads them gives the tokens of a cold one (and of the no-cache
windowed reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from greedy_reference import greedy, random_prompt
from kvcache import Batch
from kvcache.engine import Engine, EngineConfig, Request, RequestParams
from kvcache.engine.store import BlockStore, DiskStore, MemoryStore, decode_block
from kvcache.models.llama import Llama

WINDOW, BLOCK = 24, 8
CONFIG = EngineConfig(capacity=128, max_sequences=1, block_size=BLOCK, window=WINDOW, max_batch=64)


def stored_entries(store: BlockStore) -> int:
    if isinstance(store, MemoryStore):
        return len(store.data)
    assert isinstance(store, DiskStore)
    return len(list(store.root.glob("*.kvblock")))


def block_reference(model: Llama, tokens: list[int], i: int) -> list[tuple[torch.Tensor, ...]]:
    """K/V of positions i*BLOCK.. of ``tokens`` from one windowed prefill of the tokens up
    to the block's end in a fresh cache (nothing forgotten yet), per layer."""
    ref = model.new_cache(128, window=WINDOW)
    head = tokens[: (i + 1) * BLOCK]
    model.forward(head, Batch(list(range(len(head))), [0] * len(head)), ref)
    cells = torch.from_numpy(ref.cells_of(0)[i * BLOCK : (i + 1) * BLOCK])
    return [ref.read(layer, cells) for layer in ref.layers()]


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_blocks_published_under_a_window_hold_their_positions(
    history_model: Llama, kind: str, tmp_path: Path
) -> None:
    """Prompts of 16, 32 and 48 tokens of one text, one after another, each generating past
    its window: the second and third have forgotten their first 16 and 32 positions when
    they end, so they publish their later blocks from an offset into their cells."""
    store: BlockStore = MemoryStore() if kind == "memory" else DiskStore(tmp_path / "blocks")
    text = random_prompt(64, seed=70)
    engine = Engine(history_model, config=CONFIG, model_id="tiny", store=store)
    reqs: list[Request] = []
    for n, new in [(16, 4), (32, 10), (48, 10)]:
        [r] = [engine.submit(text[:n], RequestParams(max_tokens=new))]
        engine.run()
        assert r.generated == greedy(history_model, text[:n], new, window=WINDOW)
        reqs.append(r)
    # the window forgot: each finished request holds its whole blocks from 0, 16 and 32 on
    spans = [engine.cache.positions(h) for h in engine.reuse.holders()]
    assert [(p[0], p[-1]) for p in spans] == [(0, 15), (16, 39), (32, 55)]
    assert engine.stats.store_published == 2 + 3 + 3

    found: dict[bytes, tuple[int, int]] = {}  # block hash -> (request, block index)
    for j, r in enumerate(reqs):
        for i, h in enumerate(engine.reuse.index.hashes(r.context)):
            data = store.get(engine.reuse.identity.key(h))
            if data is None:
                continue
            keys, values = decode_block(data, engine.reuse.identity, h)
            for layer, (k, v) in enumerate(block_reference(history_model, r.context, i)):
                torch.testing.assert_close(keys[layer], k, msg=f"request {j} block {i} keys")
                torch.testing.assert_close(values[layer], v, msg=f"request {j} block {i} values")
            found.setdefault(h, (j, i))
    assert stored_entries(store) == len(found) == engine.stats.store_published
    # blocks published from an offset: request 1's 2..4 (from 16), request 2's 4..6 (from 32)
    assert sorted(found.values()) == [(0, 0), (0, 1), (1, 2), (1, 3), (1, 4)] + [
        (2, 4),
        (2, 5),
        (2, 6),
    ]

    prompt = [*text[:48], 1, 2]
    want = greedy(history_model, prompt, 12, window=WINDOW)
    cold = Engine(history_model, config=CONFIG, model_id="tiny")
    warm = Engine(history_model, config=CONFIG, model_id="tiny", store=store)
    for e in (cold, warm):
        [r] = [e.submit(prompt, RequestParams(max_tokens=12))]
        e.run()
        assert r.generated == want
    assert warm.stats.store_tokens == 48 and warm.stats.store_rejected == 0
    assert cold.stats.store_tokens == 0

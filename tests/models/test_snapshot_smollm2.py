"""Snapshots of real SmolLM2 K/V: restore then decode gives the uninterrupted logits bit for
bit (torch.equal) for every codec of the issue, in another pool with other sequences placed
first, and across processes (a subprocess writes the file and its own continuation's
logits; this process restores and decodes). The prompt (~250 tokens) goes beyond the 128
fp16 recent rows of the quantizing codecs, so codes, not fp16 copies, are compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvcache import Batch, CausalCache
from kvcache.models.llama import Llama
from kvcache.snapshot import Snapshot
from kvcache.text.tokenizer import Tokenizer

TEXT = (
    "The cell cache keeps every token's keys and values in one pool shared by many "
    "sequences. A snapshot copies one sequence's cells as they are stored, so that it can be "
    "written to disk, read back by another process and decoded further without computing "
    "the prompt again. "
)
PROMPT = 240
DECODED = 8
AFTER = 6


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT * 8)
    assert len(ids) >= PROMPT + DECODED + AFTER
    return ids[: PROMPT + DECODED + AFTER]


def run(model: Llama, cache: CausalCache, seq: int, toks: list[int], start: int) -> torch.Tensor:
    """Decode ``toks`` one step at a time from ``start``: logits of each step [n, V]."""
    rows = [model.forward([t], Batch.single(seq, start + i, 1), cache) for i, t in enumerate(toks)]
    return torch.cat(rows)


def filled(model: Llama, codec: str, ids: list[int]) -> CausalCache:
    cache = model.new_cache(1024, max_sequences=4, codec=codec)
    model.forward(ids[:PROMPT], Batch.single(0, 0, PROMPT), cache, outputs=[PROMPT - 1])
    run(model, cache, 0, ids[PROMPT : PROMPT + DECODED], PROMPT)
    return cache


def crowded(model: Llama, codec: str, ids: list[int]) -> CausalCache:
    cache = model.new_cache(1024, max_sequences=4, codec=codec)
    model.forward(ids[5:45], Batch.single(1, 0, 40), cache, outputs=[39])
    model.forward(ids[50:61], Batch.single(2, 0, 11), cache, outputs=[10])
    cache.remove(1, 25)  # a hole the restore fills first
    return cache


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4", "kivi4", "turbo4"])
def test_restore_then_decode_is_bit_identical(
    smollm2: Llama, prompt: list[int], codec: str, tmp_path: Path
):
    source = filled(smollm2, codec, prompt)
    path = tmp_path / "seq.safetensors"
    source.snapshot(0, model_id=smollm2.model_id).save(path)
    start = PROMPT + DECODED
    want = run(smollm2, source, 0, prompt[start:], start)

    target = crowded(smollm2, codec, prompt)
    target.restore(Snapshot.load(path), 3, model_id=smollm2.model_id)
    assert target.cells_of(3)[0] != source.cells_of(0)[0]  # placed elsewhere
    got = run(smollm2, target, 3, prompt[start:], start)
    assert torch.equal(got, want), f"{codec}: max |diff| {(got - want).abs().max()}"


WRITER = textwrap.dedent(
    """
    import json, sys, torch
    from kvcache import Batch
    from kvcache.models.llama import Llama
    ids, codec, prompt, decoded, path, out = json.loads(sys.argv[1])
    model = Llama.from_gguf(weights="fp32")
    cache = model.new_cache(1024, max_sequences=4, codec=codec)
    model.forward(ids[:prompt], Batch.single(0, 0, prompt), cache, outputs=[prompt - 1])
    for i in range(prompt, prompt + decoded):
        model.forward([ids[i]], Batch.single(0, i, 1), cache)
    cache.snapshot(0, model_id=model.model_id, tokens=ids[: prompt + decoded]).save(path)
    rows = [model.forward([ids[i]], Batch.single(0, i, 1), cache)
            for i in range(prompt + decoded, len(ids))]
    torch.save(torch.cat(rows), out)
    """
)


@pytest.mark.parametrize("codec", ["turbo4"])
def test_a_snapshot_written_by_another_process_decodes_identically(
    smollm2: Llama, prompt: list[int], codec: str, tmp_path: Path
):
    path, out = tmp_path / "seq.safetensors", tmp_path / "logits.pt"
    args = json.dumps([prompt, codec, PROMPT, DECODED, str(path), str(out)])
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    subprocess.run([sys.executable, "-c", WRITER, args], check=True, env=env, timeout=300)
    want = torch.load(out)

    snap = Snapshot.load(path)
    assert snap.tokens == prompt[: PROMPT + DECODED]
    target = crowded(smollm2, codec, prompt)
    target.restore(snap, 3, model_id=smollm2.model_id)
    start = PROMPT + DECODED
    got = run(smollm2, target, 3, prompt[start:], start)
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max()}"

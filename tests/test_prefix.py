"""Prefix index bookkeeping: chained hashes, longest match, LRU, block-wise drops."""

from __future__ import annotations

import pytest

from kvcache.errors import InvalidConfigError
from kvcache.prefix import PrefixIndex, chain_hashes


def test_chained_hashes_name_whole_prefixes():
    a = chain_hashes(list(range(40)), 16, b"m")
    b = chain_hashes([*range(16), 99, *range(17, 40)], 16, b"m")
    assert len(a) == 2  # 8 trailing tokens do not make a block
    assert a[0] == b[0] and a[1] != b[1]
    assert chain_hashes(list(range(16, 32)), 16, b"m")[0] != a[1]  # same block, other prefix
    assert chain_hashes(list(range(40)), 16, b"other model") != a


def test_lookup_finds_longest_held_prefix_and_touches_lru():
    index = PrefixIndex(block_size=4, namespace="m")
    index.insert(7, list(range(10)))  # blocks [0..3], [4..7]
    index.insert(8, list(range(13)))  # blocks 0..2
    assert index.lookup(list(range(20))).holder == 8
    assert index.lookup(list(range(20))).tokens == 12
    match = index.lookup([0, 1, 2, 3, 4, 5, 6, 99])
    assert (match.blocks, match.tokens) == (1, 4)
    assert index.lookup([5, 5, 5, 5]).holder is None
    assert index.lru() == [7, 8]
    index.insert(9, [50, 51, 52, 53])
    assert index.lru() == [7, 8, 9]
    assert index.lookup([50, 51, 52, 53, 54]).holder == 9
    assert index.lookup(list(range(9))).holder == 8  # touched: most recently used
    assert index.lru() == [7, 9, 8]


def test_drop_tail_blocks_and_fallback_to_other_holder():
    index = PrefixIndex(block_size=2)
    index.insert(1, [1, 2, 3, 4, 5, 6])
    index.insert(2, [1, 2, 3, 4])
    assert index.lookup([1, 2, 3, 4]).holder == 2
    index.drop(2, 0)
    assert 2 not in index and index.lookup([1, 2, 3, 4]).holder == 1
    index.drop(1, 1)
    assert index.lookup([1, 2, 3, 4, 5, 6]).blocks == 1 and index.blocks() == 1
    index.insert(1, [9, 9])  # re-inserting replaces what a holder held
    assert index.lookup([1, 2]).holder is None and index.lookup([9, 9]).holder == 1


def test_bad_block_size():
    with pytest.raises(InvalidConfigError):
        PrefixIndex(block_size=0)

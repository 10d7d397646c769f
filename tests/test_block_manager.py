"""BlockManager without a model: allocation, sharing, eviction, freeing, the block hash."""

import hashlib
from array import array
from collections import Counter

import pytest

from batcher.block_hash import cacheable_block_hashes, iter_block_hashes, root_hash
from batcher.block_manager import BlockManager
from tests.block_ops import random_operations, seq

ROOT = root_hash("test-model")


def compute(bm, s, n):
    """Grow `s` by n tokens and mark them computed, as a step would."""
    assert bm.grow(s, n)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)


def test_grow_allocates_ceil_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(range(10))
    bm.admit(s, bm.match_prefix(s))
    compute(bm, s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == [] and s.num_computed_tokens == 0


def test_grow_fails_without_allocating_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(range(12))
    bm.admit(s, [])
    assert not bm.grow(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_shared_by_hash_and_never_covers_last_token():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = seq(range(12), "a")
    bm.admit(a, bm.match_prefix(a))
    compute(bm, a, 12)
    b = seq(list(range(12)), "b")  # same 12 tokens: the last block must be recomputed
    cached = bm.match_prefix(b)
    assert cached == a.block_table[:2]
    bm.admit(b, cached)
    assert b.num_computed_tokens == 8
    assert all(bm.blocks[i].ref_count == 2 for i in cached)
    c = seq(list(range(8)) + [99, 98, 97, 96, 95], "c")
    assert bm.match_prefix(c) == a.block_table[:2]
    d = seq([5] + list(range(1, 12)), "d")  # differs in the first block: nothing shared
    assert bm.match_prefix(d) == []


def test_freed_cached_blocks_are_reused_then_evicted():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(9), "a")
    bm.admit(a, [])
    compute(bm, a, 9)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq(range(9), "b")
    cached = bm.match_prefix(b)
    assert len(cached) == 2  # still cached after free
    assert bm.can_admit(cached, 1, reserve=0)
    bm.admit(b, cached)
    assert bm.num_free_blocks == 2
    bm.free(b)
    # Filling the whole cache with other tokens evicts the cached prefix.
    c = seq(range(100, 116), "c")
    bm.admit(c, bm.match_prefix(c))
    compute(bm, c, 16)
    assert bm.match_prefix(seq(range(9))) == []


def test_uncached_tail_block_reused_before_cached_prefix():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(6), "a")
    bm.admit(a, [])
    compute(bm, a, 6)  # one full (cached) block, one partial
    full, partial = a.block_table
    bm.free(a)
    x = seq([7], "x")
    bm.admit(x, [])
    assert bm.grow(x, 1)
    assert x.block_table == [partial]
    assert bm.match_prefix(seq(range(6))) == [full]


def test_can_admit_respects_reserve():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.can_admit([], 32, reserve=2)
    assert not bm.can_admit([], 33, reserve=2)
    assert not bm.can_admit([], 32, reserve=3)


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = seq(range(12), "a")
    bm.admit(a, [])
    compute(bm, a, 12)
    assert bm.match_prefix(seq(range(12), "b")) == []


def test_prompt_and_answer_hashes_continue_the_prompt_chain_as_the_engine_does():
    """What a router counts as cached after an answer: the prompt's hashes, continued over the
    answer with the same function, equal the blocks the engine registered for prompt + answer."""
    bs, prompt, answer = 4, list(range(100, 118)), list(range(500, 511))
    bm = BlockManager(num_blocks=20, block_size=bs)
    s = seq(prompt)
    bm.admit(s, bm.match_prefix(s))
    compute(bm, s, len(prompt))
    for t in answer:  # decode: each sampled token is computed at the next step, the last one never
        s.append_token(t)
        if t != answer[-1]:
            compute(bm, s, 1)
    known = cacheable_block_hashes(prompt, bs, ROOT)
    chained = cacheable_block_hashes(prompt + answer, bs, ROOT, known=known)
    assert chained[: len(known)] == known
    assert chained == cacheable_block_hashes(prompt + answer, bs, ROOT) == s.block_hashes
    # Turn two (prompt + answer + new turn) matches every one of those blocks in the engine's cache.
    bm.free(s)
    turn2 = seq(prompt + answer + [7, 8, 9], "t2")
    assert len(bm.match_prefix(turn2)) == len(chained)


def test_block_hashes_are_sha256_of_the_parent_and_the_tokens():
    tokens = list(range(12))
    first = hashlib.sha256(ROOT + array("q", tokens[:4]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", tokens[4:8]).tobytes()).digest()
    assert cacheable_block_hashes(tokens, 4, ROOT) == [first, second]
    # Blocks that tuple-hash alike are told apart: hash((-1, (a,))) collisions cannot cross tenants.
    assert root_hash("m") != root_hash("m", "") != root_hash("m", "s") != root_hash("n", "s")
    assert root_hash("m", "a\0salt\0") != root_hash("m\0salt\0", "a")


def test_a_cache_salt_keeps_tenants_apart():
    """The same prompt under another salt (or none) matches nothing; the same salt matches."""
    bm = BlockManager(num_blocks=20, block_size=4)
    a = seq(range(13), "a", salt="tenant-a")
    bm.admit(a, [])
    compute(bm, a, 13)
    assert bm.match_prefix(seq(range(13), "b", salt="tenant-b")) == []
    assert bm.match_prefix(seq(range(13), "c")) == []
    assert len(bm.match_prefix(seq(range(13), "d", salt="tenant-a"))) == 3


def _check_invariants(bm: BlockManager, live: list) -> None:
    refs = Counter(b for s in live for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id], block
        assert (block.ref_count == 0) == (block.block_id in bm.free_blocks)
        if block.hash:
            assert block.block_id in (bm.hash_to_block[block.hash], *bm._copies.get(block.hash, ()))
    assert all(bm.blocks[b].hash == h for h, b in bm.hash_to_block.items())
    assert all(bm.blocks[b].hash == h and bm.blocks[b].ref_count for h, copies in bm._copies.items() for b in copies)
    assert not set(bm._copies) - set(bm.hash_to_block)
    assert len(bm.free_blocks) == bm.num_blocks - len(refs)
    for s in live:
        assert len(s.block_table) >= bm.blocks_needed(s.num_computed_tokens)
        full = s.num_computed_tokens // bm.block_size
        assert s.block_hashes == list(iter_block_hashes(s.token_ids, bm.block_size, full, s.cache_root))
        for b, h in zip(s.block_table, s.block_hashes):  # every full block holds its hash, copies too
            assert bm.blocks[b].hash == h


@pytest.mark.parametrize("seed", range(12))
def test_block_accounting_stays_consistent_under_random_operations(seed):
    """Ref counts, the free list and the hash index stay consistent through random operations, and
    everything comes back free at the end."""
    for bm, live in random_operations(seed):
        _check_invariants(bm, live)
    assert bm.num_free_blocks == bm.num_blocks

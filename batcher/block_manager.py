"""Paged KV block bookkeeping with prefix caching. Pure Python: no tensors, testable without a model.

A block holds `block_size` consecutive tokens of one or more sequences. A full block is identified by
its chained hash (batcher.block_hash: the prefix, the model and the request's cache salt), so equal
prefixes of the same tenant map to equal blocks. Freed blocks keep their hash and stay reusable until
a new allocation evicts them (least recently freed first). What it evicts goes to `evictions`
(batcher.eviction_log), which the replica reports to request routers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from batcher.block_hash import BlockHash, iter_block_hashes
from batcher.eviction_log import EvictionLog
from batcher.sequence import Sequence

_NO_HASH = b""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: BlockHash = _NO_HASH  # SHA-256 of the whole prefix up to this block (batcher.block_hash)
    position: int = 0  # with a hash: the block's place in its chain (a hash fixes it), for the eviction log


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: oldest freed first. Cached ones still sit in hash_to_block.
        self.free_blocks: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: Dict[BlockHash, int] = {}
        # Blocks in use that recomputed a cached block (a prompt's last block is never matched, and a
        # repeated prompt's answer follows it). They keep the hash while held, so a chain in use stays
        # cached whole and its tail is evicted before its prefix (router.index relies on it); freed,
        # they give it up.
        self._copies: Dict[BlockHash, List[int]] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.evictions = EvictionLog()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> List[int]:
        """Block ids of the longest cached prefix of `seq`, never covering its last token
        (the step must compute it to get logits). Only for a sequence holding no blocks."""
        if not self.enable_prefix_caching:
            return []
        found: List[int] = []
        num_blocks = (seq.num_tokens - 1) // self.block_size
        for h in iter_block_hashes(seq.token_ids, self.block_size, num_blocks, seq.cache_root):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = len(seq.block_hashes)
        for i, h in enumerate(
            iter_block_hashes(seq.token_ids, self.block_size, num_full, seq.cache_root, seq.block_hashes), start
        ):
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash != _NO_HASH:
                continue
            block.hash, block.position = h, i
            if h not in self.hash_to_block:
                self.hash_to_block[h] = block.block_id
                self.evictions.cached(h)
            else:  # recomputed: a copy, which takes the hash over if the cached block is evicted first
                self._copies.setdefault(h, []).append(block.block_id)

    # -- allocation ---------------------------------------------------------------------------
    def can_admit(self, cached: List[int], num_new_tokens: int, reserve: int) -> bool:
        """Whether a sequence can hold `num_new_tokens` beyond its cached prefix, leaving `reserve` free."""
        need = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        # Reusing a cached block that sits in the free list takes it out of the free list too.
        reused_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return self.num_free_blocks - reused_free - need >= reserve

    def admit(self, seq: Sequence, cached: List[int]) -> None:
        """Gives `seq` its cached prefix blocks; the rest comes from `grow`."""
        assert not seq.block_table, "admit() takes a sequence that holds no blocks"
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        seq.num_computed_tokens = len(cached) * self.block_size
        # What the client is told was cached: the first admission's (a forked choice's is its parent's).
        if not seq.num_preemptions and not seq.index:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed_tokens

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Makes `seq`'s block table cover `num_new_tokens` more tokens. False if blocks run out."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def can_fork(self, parent: Sequence) -> bool:
        return self.num_free_blocks >= (1 if parent.num_computed_tokens % self.block_size else 0)

    def fork(self, parent: Sequence, child: Sequence) -> Optional[Tuple[int, int]]:
        """Gives `child` (holding no blocks) `parent`'s computed tokens: the full blocks shared (one
        more reference each), the partial last block, which both will write, as a new block. Returns
        (parent's block, child's copy) for the caller to copy the K/V, or None when there is no
        partial block. Check can_fork first."""
        assert not child.block_table, "fork() takes a child that holds no blocks"
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        for block_id in parent.block_table[:num_full]:
            self.blocks[block_id].ref_count += 1  # held by the parent: never in the free list
        child.block_table = parent.block_table[:num_full]
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_computed_tokens = parent.num_computed_tokens
        if not partial:
            return None
        child.block_table.append(self._take_free_block())
        return parent.block_table[num_full], child.block_table[-1]

    def free(self, seq: Sequence) -> None:
        # Tail blocks go to the free list first, so they are evicted before shared prefixes.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash != _NO_HASH and self.hash_to_block[block.hash] != block_id:
                    self._drop_copy(block)
                if block.hash == _NO_HASH:  # nothing worth keeping: reuse it first
                    self.free_blocks.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != _NO_HASH:  # evict the cached content
            self._uncache(block)
        block.ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        """`block`, free, is reused: its hash goes, unless a copy in use takes it over."""
        h, copies = block.hash, self._copies.get(block.hash)
        block.hash = _NO_HASH
        if not copies:
            del self.hash_to_block[h]
            self.evictions.evicted(h, block.position)
            return
        self.hash_to_block[h] = copies.pop()
        if not copies:
            del self._copies[h]

    def _drop_copy(self, block: Block) -> None:
        """A copy no sequence holds any more: the cached block it copies counts as freed now (after the
        copy's descendants, as the copy would have been), and the copy, redundant, is reused first."""
        h, copies = block.hash, self._copies[block.hash]
        copies.remove(block.block_id)
        if not copies:
            del self._copies[h]
        block.hash = _NO_HASH
        original = self.hash_to_block[h]
        if self.blocks[original].ref_count == 0:
            self.free_blocks.move_to_end(original)

    def used_slots(self) -> int:
        return (self.num_blocks - self.num_free_blocks) * self.block_size

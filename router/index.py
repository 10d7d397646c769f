"""Which KV blocks each replica probably holds: a bounded, per-replica LRU of prefix block hashes.

Hashes are the engine's own (batcher.block_manager.cacheable_block_hashes over the same token ids),
so a match here is a match in the replica's prefix cache, as far as the router can know. A block
hash chains its whole prefix, so a replica holding block i held blocks 0..i-1 when they were
inserted; inserting deepest-first keeps the root most recent, so LRU eviction trims chains from the
tail and the prefix property holds: a replica's match is the deepest of the request's blocks it
holds, found for every replica at once by bisecting the request's chain.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Set


class PrefixIndex:
    def __init__(self, max_blocks_per_replica: int):
        if max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be >= 1")
        self.max_blocks_per_replica = max_blocks_per_replica
        self._blocks: Dict[Hashable, "OrderedDict[int, None]"] = {}  # per replica, LRU order
        self._owners: Dict[int, Set[Hashable]] = {}  # block hash -> replicas holding it
        self._capacity: Dict[Hashable, int] = {}

    def set_capacity(self, replica: Hashable, kv_blocks: Optional[int]) -> None:
        """A replica cannot cache more blocks than its KV cache has: the index keeps no more either."""
        cap = min(self.max_blocks_per_replica, kv_blocks) if kv_blocks else self.max_blocks_per_replica
        if self._capacity.get(replica) != cap:
            self._capacity[replica] = cap
            self._evict(replica)

    def insert(self, replica: Hashable, hashes: Sequence[int]) -> None:
        """Marks the chain `hashes` (root first) as cached on `replica`, most recently used."""
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in reversed(hashes):  # the root ends up most recent: evicted last
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                self._owners.setdefault(h, set()).add(replica)
        self._evict(replica)

    def matched_blocks(self, hashes: Sequence[int]) -> Dict[Hashable, int]:
        """How many leading blocks of `hashes` each replica holds (replicas holding none: absent).

        By the prefix property the holders of block i include those of block i+1, so the holders'
        count only grows toward the root: bisecting on it finds the deepest depth where someone new
        holds the chain, then the next one above it. Cost: about log2(len(hashes)) lookups per
        distinct match depth, whatever the fleet size."""
        found: Dict[Hashable, int] = {}
        top = len(hashes)
        while top > 0 and len(found) < len(self._blocks):
            lo, hi = 0, top  # the deepest depth in [1, top] with more holders than found so far
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if len(self._owners.get(hashes[mid - 1], ())) > len(found):
                    lo = mid
                else:
                    hi = mid - 1
            if lo == 0:
                break
            for r in self._owners[hashes[lo - 1]]:
                found.setdefault(r, lo)
            top = lo - 1
        return found

    def remove_replicas(self, replicas: Iterable[Hashable]) -> None:
        for r in replicas:
            for h in self._blocks.pop(r, ()):
                self._disown(h, r)
            self._capacity.pop(r, None)

    def replicas(self) -> List[Hashable]:
        return list(self._blocks)

    def num_blocks(self, replica: Hashable) -> int:
        return len(self._blocks.get(replica, ()))

    def _evict(self, replica: Hashable) -> None:
        blocks = self._blocks.get(replica)
        if blocks is None:
            return
        cap = self._capacity.get(replica, self.max_blocks_per_replica)
        while len(blocks) > cap:
            self._disown(blocks.popitem(last=False)[0], replica)

    def _disown(self, h: int, replica: Hashable) -> None:
        owners = self._owners[h]
        owners.discard(replica)
        if not owners:
            del self._owners[h]

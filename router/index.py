"""Which KV blocks each replica probably holds: a bounded, per-replica LRU of prefix block hashes,
plus the blocks requests have claimed there but Serve has not confirmed yet.

Hashes are the engine's own (batcher.block_hash over the same token ids and root), so a match here
is a match in the replica's prefix cache, as far as the router can know. The index keeps each hash's
routing key (its first 8 bytes, block_hash.routing_key): what the replicas' eviction reports name,
and a quarter of the memory per block. A block hash chains its whole prefix, so a replica holding
block i held blocks 0..i-1 when they were inserted; inserting deepest-first keeps the root most
recent, so LRU eviction trims chains from the tail and the prefix property holds: a replica's match
is the deepest of the request's blocks it holds, found for every replica at once by bisecting the
request's chain.

It keeps one block in every `stride` of a chain: blocks stride-1, 2*stride-1, ... (each still names
its whole prefix, so the prefix property holds for them; block_hash.first_routed_block, by which the
replicas' eviction logs report the same blocks and the routers' exchange carries them). A match is
found to within `stride` blocks, for a stride-th of the work each request's passes over its chain
cost (claim, confirm, insert) and of the memory: a decision needs the matched prefix to within a few
dozen tokens, not to the block (router.config's `index_stride_tokens`).

A claim (`claim`/`release`) counts a chain on a replica while its request waits for Serve's
confirmation: the next requests of a burst follow it there, and a claim released (Serve sent the
request elsewhere) leaves nothing behind. Claims are counted per (replica, block), so releasing one
request's claim keeps the blocks other requests claimed or that are cached there. Claimed blocks
are whole chains too, so the prefix property holds for "cached or claimed".

A block's owners are a bitmask (an int: one bit per replica), not a set: an index holds hundreds of
thousands of blocks, and a set each made every full pass of Python's garbage collector walk them all
(640,000 blocks: 150 ms with the ingress's loop, its routing and its streams stopped, every time the
index grew by a quarter). Ints are not tracked by the collector.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, Iterable, List, Optional, Sequence

from batcher.block_hash import BlockHash, first_routed_block, routing_key


class PrefixIndex:
    def __init__(self, max_blocks_per_replica: int, stride: int = 1):
        """`max_blocks_per_replica`: in the engine's blocks (the index keeps a stride-th of them)."""
        if max_blocks_per_replica < 1 or stride < 1:
            raise ValueError("max_blocks_per_replica and stride must be >= 1")
        self.stride = stride
        self.max_entries_per_replica = max(1, max_blocks_per_replica // stride)
        self._blocks: Dict[Hashable, "OrderedDict[BlockHash, None]"] = {}  # per replica, LRU order
        self._claims: Dict[Hashable, Dict[BlockHash, int]] = {}  # per replica: block -> pending claims
        self._owners: Dict[BlockHash, int] = {}  # block -> bitmask of the replicas caching or claiming it
        self._bit: Dict[Hashable, int] = {}  # replica -> its bit in _owners (freed when it is removed)
        self._replica_at: Dict[int, Hashable] = {}  # bit position -> replica
        self._capacity: Dict[Hashable, int] = {}

    def set_capacity(self, replica: Hashable, kv_blocks: Optional[int]) -> None:
        """A replica cannot cache more blocks than its KV cache has: the index keeps no more either."""
        cap = self.max_entries_per_replica
        if kv_blocks:
            cap = min(cap, max(1, kv_blocks // self.stride))
        if self._capacity.get(replica) != cap:
            self._capacity[replica] = cap
            self._evict(replica)

    def insert(self, replica: Hashable, hashes: Sequence[BlockHash]) -> None:
        """Marks the chain `hashes` (root first) as cached on `replica`, most recently used."""
        self.insert_keys(replica, self.kept_keys(hashes))

    def insert_keys(self, replica: Hashable, keys: Sequence[bytes]) -> None:
        """`insert` of a chain given as the routing keys of the blocks this index keeps of it, root
        first (`kept_keys`: what the routers' exchange carries)."""
        blocks, bit, owners = self._blocks.setdefault(replica, OrderedDict()), self._bit_of(replica), self._owners
        for h in reversed(keys):  # the root ends up most recent: evicted last
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                owners[h] = owners.get(h, 0) | bit
        self._evict(replica)

    def claim(self, replica: Hashable, hashes: Sequence[BlockHash]) -> None:
        """One request's pending claim of the chain `hashes` on `replica` (undone by `release`)."""
        claims, bit, owners = self._claims.setdefault(replica, {}), self._bit_of(replica), self._owners
        for h in self.kept_keys(hashes):
            n = claims.get(h, 0)
            claims[h] = n + 1
            if n == 0:
                owners[h] = owners.get(h, 0) | bit

    def confirm(self, replica: Hashable, hashes: Sequence[BlockHash]) -> None:
        """One request's claim of `hashes` on `replica` becomes cached blocks there: `insert` then
        `release` in one pass (the claimed blocks stay owned instead of being disowned and re-owned)."""
        blocks, bit, owners = self._blocks.setdefault(replica, OrderedDict()), self._bit_of(replica), self._owners
        claims = self._claims.get(replica, {})
        for h in reversed(self.kept_keys(hashes)):  # the root ends up most recent, as in insert
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                owners[h] = owners.get(h, 0) | bit
            n = claims.get(h, 0)
            if n > 1:
                claims[h] = n - 1
            elif n == 1:
                del claims[h]
        if not claims:
            self._claims.pop(replica, None)
        self._evict(replica)

    def release(self, replica: Hashable, hashes: Sequence[BlockHash]) -> None:
        """Undoes one `claim(replica, hashes)`; blocks cached or claimed by others stay."""
        claims = self._claims.get(replica)
        if claims is None:
            return
        cached = self._blocks.get(replica, {})
        for h in self.kept_keys(hashes):
            n = claims.get(h, 0)
            if n > 1:
                claims[h] = n - 1
            elif n == 1:
                del claims[h]
                if h not in cached:
                    self._disown(h, replica)
        if not claims:
            del self._claims[replica]

    def forget(self, replica: Hashable, keys: Iterable[bytes]) -> int:
        """`replica` evicted the blocks of routing keys `keys` (its report names them so): they are no
        longer cached there. Claimed ones stay owned until their claims go (the requests claiming them
        compute them again). Returns how many of them the index kept (one block a stride). The engine
        evicts a chain's tail before its prefix, so the prefix property holds."""
        blocks, claims, n = self._blocks.get(replica), self._claims.get(replica, {}), 0
        if not blocks:
            return 0
        for h in keys:
            if blocks.pop(h, 0) is None:
                n += 1
                if h not in claims:
                    self._disown(h, replica)
        return n

    def matched_blocks(self, hashes: Sequence[BlockHash]) -> Dict[Hashable, int]:
        """How many leading blocks of `hashes` each replica caches or claims (replicas with none: absent).

        By the prefix property the holders of block i include those of block i+1, so the holders'
        count only grows toward the root: bisecting on it finds the deepest depth where someone new
        holds the chain, then the next one above it. Cost: about log2(len(hashes)) lookups per
        distinct match depth, whatever the fleet size. Counts are multiples of the stride."""
        found: Dict[Hashable, int] = {}
        stride, hashes = self.stride, hashes[first_routed_block(0, self.stride) :: self.stride]
        top, holders = len(hashes), len(self._blocks.keys() | self._claims.keys())
        while top > 0 and len(found) < holders:
            lo, hi = 0, top  # the deepest depth in [1, top] with more holders than found so far
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._owners.get(routing_key(hashes[mid - 1]), 0).bit_count() > len(found):
                    lo = mid
                else:
                    hi = mid - 1
            if lo == 0:
                break
            for r in self._holders(self._owners[routing_key(hashes[lo - 1])]):
                found.setdefault(r, lo * stride)
            top = lo - 1
        return found

    def remove_replicas(self, replicas: Iterable[Hashable]) -> None:
        for r in replicas:
            owned = set(self._blocks.pop(r, ())) | set(self._claims.pop(r, ()))
            for h in owned:
                self._disown(h, r)
            self._capacity.pop(r, None)
            bit = self._bit.pop(r, None)
            if bit is not None:  # no block names it any more: the bit is free for a new replica
                del self._replica_at[bit.bit_length() - 1]

    def replicas(self) -> List[Hashable]:
        return list(self._blocks.keys() | self._claims.keys())

    def num_blocks(self, replica: Hashable) -> int:
        """Blocks the index keeps of those cached on `replica` (one a stride; claims not included)."""
        return len(self._blocks.get(replica, ()))

    def num_claimed(self, replica: Hashable) -> int:
        """Distinct blocks with a pending claim on `replica`."""
        return len(self._claims.get(replica, ()))

    def _evict(self, replica: Hashable) -> None:
        blocks = self._blocks.get(replica)
        if blocks is None:
            return
        cap = self._capacity.get(replica, self.max_entries_per_replica)
        claims = self._claims.get(replica, {})
        while len(blocks) > cap:
            h = blocks.popitem(last=False)[0]
            if h not in claims:  # a claimed block stays owned until its claim goes
                self._disown(h, replica)

    def kept_keys(self, hashes: Sequence[BlockHash], start: int = 0) -> List[bytes]:
        """The routing keys of the blocks of chain `hashes` (root first) this index keeps (one a
        stride, counted from the root: block_hash.first_routed_block), from block `start` on."""
        return [routing_key(h) for h in hashes[first_routed_block(start, self.stride) :: self.stride]]

    def _disown(self, h: BlockHash, replica: Hashable) -> None:
        owners = self._owners.get(h)
        if owners is None:
            return
        owners &= ~self._bit.get(replica, 0)
        if owners:
            self._owners[h] = owners
        else:
            del self._owners[h]

    def _bit_of(self, replica: Hashable) -> int:
        bit = self._bit.get(replica)
        if bit is None:
            k = next(k for k in range(len(self._replica_at) + 1) if k not in self._replica_at)
            self._replica_at[k], bit = replica, 1 << k
            self._bit[replica] = bit
        return bit

    def _holders(self, owners: int) -> Iterable[Hashable]:
        while owners:
            low = owners & -owners
            yield self._replica_at[low.bit_length() - 1]
            owners ^= low

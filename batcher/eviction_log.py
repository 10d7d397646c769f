"""Which prefix-cache blocks a replica evicted lately: the feed request routers read with each report,
so their prefix index (router.index) drops what the replica no longer holds.

The engine thread writes it (BlockManager evicts, caches); the replica's report, on another thread,
cuts it into numbered segments: `cut()` closes the open segment and returns the last few, oldest
first. Every router of the deployment reads the same reports (Serve's controller polls each replica
and broadcasts), and one that falls behind sees only the latest, so each report repeats the last
`keep_segments` segments (a router may miss one report in two) and a router applies those newer
than the last it applied. Every router gets every replica's report, several times a second over a
fleet, so a report stays small: keys of 8 bytes, two segments.

A hash cached again since its eviction (a request recomputed the block) leaves every kept segment:
a router reading the report later must not drop a block the replica holds again. Segments hold at
most `max_hashes` between them: past that the oldest hashes go and their segment counts them as
lost, so a router knows its view may be stale (an engine whose reports nobody reads stays bounded).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Deque, List, Tuple

from batcher.block_hash import BlockHash, first_routed_block, routing_key

# (segment number, the routing keys of the segment's evicted hashes joined (block_hash.routing_key,
# 8 bytes each: a quarter of the hashes' bytes in every report), hashes left out of it)
EvictedSegment = Tuple[int, bytes, int]


class EvictionLog:
    def __init__(self, keep_segments: int = 2, max_hashes: int = 16384, stride: int = 1):
        """`stride`: only the blocks of a chain routers key at that stride are logged
        (block_hash.first_routed_block: the ones their prefix indexes keep; the app sets it from the
        router's config): a stride-th of the report's keys and of the work."""
        self.keep_segments = keep_segments
        self.max_hashes = max_hashes
        self.stride = stride
        self._lock = threading.Lock()
        # Oldest first; the last is open. [number, hashes in eviction order, lost]
        self._segments: Deque[list] = deque([[1, {}, 0]])
        self._size = 0

    def evicted(self, h: BlockHash, position: int) -> None:
        """Block `h`, block `position` of its chain (0: the root's child), was evicted."""
        if first_routed_block(position, self.stride) != position:
            return
        with self._lock:
            segment = self._segments[-1]
            if h not in segment[1]:
                segment[1][h] = None
                self._size += 1
            if self._size > self.max_hashes:
                self._drop_oldest()

    def cached(self, h: BlockHash) -> None:
        """`h` is cached again: no longer reported as evicted."""
        if not self._size:  # the common case, without the lock: only this thread adds, so 0 is never stale
            return
        with self._lock:
            for segment in self._segments:
                if segment[1].pop(h, 0) is None:
                    self._size -= 1

    def cut(self) -> List[EvictedSegment]:
        """Closes the open segment and returns the kept ones, oldest first (the closed one last)."""
        with self._lock:
            segments = [(n, b"".join(map(routing_key, hashes)), lost) for n, hashes, lost in self._segments]
            self._segments.append([segments[-1][0] + 1, {}, 0])
            while len(self._segments) > self.keep_segments:  # the new open one counted: cuts return keep
                self._size -= len(self._segments.popleft()[1])
            return segments

    def _drop_oldest(self) -> None:
        for segment in self._segments:
            if segment[1]:
                del segment[1][next(iter(segment[1]))]
                segment[2] += 1
                self._size -= 1
                return

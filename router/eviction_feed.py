"""The replicas' evictions, applied to the router's prefix index (router.index).

Without them the index guesses: it keeps what it saw sent and answered, least recently used first,
capped at the replica's KV blocks, while the replica evicts the least recently freed of the blocks
no running sequence holds. Under memory pressure the two part: the router counts prefixes the
replica dropped, sends their sessions there and the replica recomputes them. Each report lists what
the replica evicted over its last few reports (batcher.eviction_log: numbered segments of the
hashes' routing keys, without the ones cached again since), and this applies the segments it has not
applied yet. A replica whose segments it missed (more reports than a report repeats went by unread,
or the replica's log overflowed) is counted in `gaps`: its stale blocks go only by the index's LRU.
"""

from __future__ import annotations

from typing import Dict, Optional

from batcher.block_hash import ROUTING_KEY_BYTES
from router.index import PrefixIndex


class EvictionFeed:
    def __init__(self, index: PrefixIndex):
        self.index = index
        self._applied: Dict[str, int] = {}  # replica -> the last segment number applied
        self.dropped = 0  # blocks the index held and a replica reported evicted
        self.gaps = 0  # reports that showed segments were missed

    def read(self, rid: str, stats: Optional[dict]) -> None:
        """Applies report `stats`' segments newer than the last applied from replica `rid`."""
        segments = (stats or {}).get("evicted")
        if not segments:
            return
        last = self._applied.get(rid)
        if last is not None and segments[-1][0] <= last:  # this report, or an older one, again
            return
        if last is not None and segments[0][0] > last + 1:
            self.gaps += 1
        for number, joined, lost in segments:
            if last is not None and number <= last:
                continue
            if lost:
                self.gaps += 1
            self.dropped += self.index.forget(
                rid, (joined[i : i + ROUTING_KEY_BYTES] for i in range(0, len(joined), ROUTING_KEY_BYTES))
            )
        self._applied[rid] = segments[-1][0]

    def drop(self, rid: str) -> None:
        self._applied.pop(rid, None)

"""RequestLedger: what an LLMRouter knows of each request it routes, from its decision to its answer.

Plain data in and out (replica ids are `ReplicaID.unique_id` strings, times are seconds), so it is
unit-tested without Serve. A request, keyed by Serve's internal request id, goes through:

  chosen     choose_replicas ranked it: it counts in flight on its first choice and its prompt's
             blocks are claimed there (pending), so the rest of a burst, routed before Serve
             confirms any, follows it. Serve may ask again (backoff, a rejection): the request is
             taken back first (`take_back`), so it never counts twice nor scores against itself.
  routed     Serve confirmed a replica (on_request_routed): the claim becomes cached blocks there;
             if Serve picked another replica, the claim is released and that one caches them.
  completed  no longer in flight (on_request_completed), kept while its replica's reports may
             still count it; its answer is awaited (`answered`).

A completion before any confirmation (the replica rejected the attempt; Serve retries) releases the
claim: blocks count as cached only where Serve confirmed them. A request Serve never reports on again
(cancelled while queued) is forgotten by the bounds, by count and by age, all applied in `_expire`.

Requests other routers of the deployment sent (`sent_elsewhere`, from router.index_exchange) count
in flight on their replica too, until the router that sent them shares their answer (they ended), a
report of it counts them (from then on its reports do) or, taken `FOREIGN_GRACE_S` after they were
sent, does not (they ended without an answer this router heard of).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Collection, Deque, Dict, List, Optional, Sequence, Set, Tuple

from batcher.block_hash import BlockHash
from router.index import PrefixIndex
from router.scoring import Report, Routed, RoutingRequest, counted_in

FORGET_AFTER_S = 3600.0  # a request still counted after this long was lost without a callback
ANSWER_WAIT_S = 900.0  # a request's answer is expected within this (it ends the request)
MAX_COMPLETED = 4096  # per replica: completions its latest report may still count
FOREIGN_GRACE_S = 1.0  # a report this long after another router's request was sent, not counting it: it ended


@dataclass(frozen=True)
class HashedRequest:
    """What the decision needs of a request: its id, its prompt's block hashes (chained from `root`:
    the model, the request's cache salt and LoRA adapter), its sizes, its adapter (None: the base)."""

    request_id: Optional[str]
    root: BlockHash
    hashes: List[BlockHash]
    sizes: RoutingRequest
    adapter: Optional[str] = None


@dataclass
class _Entry:
    request: HashedRequest
    replica: Optional[str] = None  # where it counts in flight (None: nowhere)
    confirmed: bool = False  # Serve confirmed `replica` (its blocks are cached there, not claimed)
    since: float = 0.0


class RequestLedger:
    def __init__(
        self,
        index: PrefixIndex,
        max_requests: int,
        forget_after_s: float = FORGET_AFTER_S,
        answer_wait_s: float = ANSWER_WAIT_S,
        max_completed: int = MAX_COMPLETED,
    ):
        self.index = index
        self.max_requests = max_requests
        self.forget_after_s, self.answer_wait_s = forget_after_s, answer_wait_s
        self.max_completed = max_completed
        self._entries: "OrderedDict[str, _Entry]" = OrderedDict()  # least recently touched first
        self._inflight: Dict[str, Dict[str, Routed]] = {}  # replica -> key -> routed
        self._completed: Dict[str, Deque[Routed]] = {}  # replica -> completions, oldest first
        # Our request id -> (replica, the request, since): the answer's blocks chain on from its prompt's.
        self._awaiting: "OrderedDict[str, Tuple[str, HashedRequest, float]]" = OrderedDict()
        self._awaiting_on: Dict[str, int] = {}  # replica -> answers awaited from it
        self._versions: Dict[str, int] = {}
        self._foreign: Dict[str, Dict[str, Routed]] = {}  # replica -> key -> another router's request

    # ---- reads --------------------------------------------------------------------------------------

    def request(self, key: str) -> Optional[HashedRequest]:
        entry = self._entries.get(key)
        return None if entry is None else entry.request

    def replica_of(self, key: str) -> Optional[str]:
        """Where request `key` counts in flight (None: nowhere)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.replica

    def inflight(self, replica: str) -> Collection[Routed]:
        return self._inflight.get(replica, {}).values()

    def completed(self, replica: str) -> Sequence[Routed]:
        return self._completed.get(replica, ())

    def version(self, replica: str) -> int:
        """Changes whenever `inflight(replica)` or `completed(replica)` does (a cache key for loads)."""
        return self._versions.get(replica, 0)

    def replicas(self) -> Set[str]:
        """Replicas this ledger holds anything for."""
        return set(self._inflight) | set(self._completed) | set(self._awaiting_on)

    def num_requests(self) -> int:
        return len(self._entries)

    def num_awaiting(self) -> int:
        return len(self._awaiting)

    # ---- events -------------------------------------------------------------------------------------

    def take_back(self, key: str) -> Optional[HashedRequest]:
        """Serve routes request `key` again: it no longer counts where it was chosen, nor claims
        blocks there (blocks a confirmation cached stay). Returns it, or None if unknown."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._leave(key, entry)
        return entry.request

    def chosen(self, key: str, replica: str, request: HashedRequest, cached_tokens: int, now: float) -> None:
        """The decision ranked `replica` first: request `key` counts there, its blocks claimed."""
        entry = self._entries.pop(key, None) or _Entry(request)
        self._leave(key, entry)
        self.index.claim(replica, request.hashes)
        self._enter(key, entry, replica, cached_tokens, now)
        self._entries[key] = entry
        self._expire(now)

    def routed(self, key: str, replica: str, cached_tokens: Optional[int], now: float) -> Optional[HashedRequest]:
        """Serve confirmed `replica` for request `key` (`cached_tokens`: what `replica` caches of its
        prompt, read only if the request counts elsewhere). Returns the request, None if unknown."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        hashes = entry.request.hashes
        if entry.replica == replica and not entry.confirmed:
            self.index.confirm(replica, hashes)  # its claim there becomes cached blocks
        else:
            if entry.replica is not None and entry.replica != replica:  # Serve sent it elsewhere
                self._leave(key, entry)
                self._enter(key, entry, replica, cached_tokens or 0, now)
            # (with no replica, it completed before this confirmation came, a short request: it counts nowhere)
            self.index.insert(replica, hashes)
        entry.confirmed = True
        if entry.replica is not None:
            entry.since = now
            self._entries[key] = entry
        if entry.request.request_id:
            self._pop_awaiting(entry.request.request_id)
            self._awaiting[entry.request.request_id] = (replica, entry.request, now)
            self._awaiting_on[replica] = self._awaiting_on.get(replica, 0) + 1
        self._expire(now)
        return entry.request

    def completed_on(self, key: str, replica: str, now: float) -> None:
        """Request `key` ended on `replica`. Confirmed there: kept as a completion until a later report
        of the replica covers it. Not confirmed (a rejected attempt): its claim goes, and the request
        waits for a retry's decision or a late confirmation. Elsewhere: another attempt's, ignored."""
        entry = self._entries.get(key)
        if entry is None or entry.replica != replica:
            return
        routed = self._inflight[replica].get(key)
        confirmed = entry.confirmed
        self._leave(key, entry)
        if confirmed:
            del self._entries[key]
            done = self._completed.setdefault(replica, deque(maxlen=self.max_completed))
            done.append(replace(routed, completed_at=now))
            self._bump(replica)

    def sent_on(self, key: str) -> Optional[Routed]:
        """What counts for request `key` on its replica while it counts in flight; else None."""
        entry = self._entries.get(key)
        return None if entry is None or entry.replica is None else self._inflight[entry.replica].get(key)

    def sent_elsewhere(self, replica: str, routed: Routed, report: Optional[Report], now: float) -> None:
        """Another router sent `routed` to `replica`: it counts there until a report does (`report`:
        the replica's latest, which may count it already). Sent more than FOREIGN_GRACE_S before `now`
        (a new router reading the exchange's log), it is left to the reports. Bounded like this
        router's own requests."""
        if now - routed.routed_at > FOREIGN_GRACE_S or (report is not None and counted_in(report, routed)):
            return
        foreign = self._foreign.setdefault(replica, {})
        key = f"@{routed.request_id}" if routed.request_id else f"@{id(routed)}"
        foreign[key] = self._inflight.setdefault(replica, {})[key] = routed
        while len(foreign) > self.max_requests:
            oldest = next(iter(foreign))
            del foreign[oldest]
            self._inflight[replica].pop(oldest, None)
        self._bump(replica)

    def ended_elsewhere(self, replica: str, request_id: str) -> None:
        """Another router's request on `replica` ended (that router heard its answer)."""
        foreign = self._foreign.get(replica)
        if foreign is not None and foreign.pop(f"@{request_id}", None) is not None:
            self._inflight[replica].pop(f"@{request_id}", None)
            self._bump(replica)

    def reported(self, replica: str, report: Report) -> None:
        """A new report of `replica`. It counts every completion before it (and so does every later
        report): they are corrections no more. The other routers' requests it counts, or that ended
        before it (sent more than FOREIGN_GRACE_S earlier and not counted), count through its
        reports from now on."""
        done, time_s = self._completed.get(replica), report.time_s
        if done and done[0].completed_at < time_s:
            while done and done[0].completed_at < time_s:
                done.popleft()
            self._bump(replica)
        foreign = self._foreign.get(replica)
        gone = [
            k for k, r in (foreign or {}).items() if counted_in(report, r) or r.routed_at < time_s - FOREIGN_GRACE_S
        ]
        for key in gone:
            del foreign[key]
            self._inflight[replica].pop(key, None)
        if gone:
            self._bump(replica)

    def answered(self, request_id: str) -> Optional[Tuple[str, HashedRequest]]:
        """The answer to `request_id` came: (its replica, the request), or None if unknown."""
        found = self._pop_awaiting(request_id)
        return None if found is None else found[:2]

    def drop_replica(self, replica: str) -> None:
        """`replica` is gone: nothing counts on it any more, no answer is awaited from it, and requests
        in flight there are forgotten (Serve retries a request whose replica died: a new decision)."""
        for key in list(self._inflight.get(replica, ())):
            self.forget(key)
        self._inflight.pop(replica, None)
        self._foreign.pop(replica, None)
        self._completed.pop(replica, None)
        self._versions.pop(replica, None)
        if self._awaiting_on.get(replica):
            for rid in [rid for rid, (r, _, _) in self._awaiting.items() if r == replica]:
                self._pop_awaiting(rid)

    # ---- internals ----------------------------------------------------------------------------------

    def _enter(self, key: str, entry: _Entry, replica: str, cached_tokens: int, now: float) -> None:
        sizes = entry.request.sizes
        self._inflight.setdefault(replica, {})[key] = Routed(
            now, sizes.prompt_tokens, sizes.prompt_tokens - cached_tokens, entry.request.request_id
        )
        entry.replica, entry.confirmed, entry.since = replica, False, now
        self._bump(replica)

    def _leave(self, key: str, entry: _Entry) -> None:
        """Undoes `_enter`: no longer in flight on its replica, its pending claim released."""
        if entry.replica is None:
            return
        self._inflight.get(entry.replica, {}).pop(key, None)
        if not entry.confirmed:
            self.index.release(entry.replica, entry.request.hashes)
        self._bump(entry.replica)
        entry.replica, entry.confirmed = None, False

    def forget(self, key: str) -> None:
        """Request `key` will not be reported on again (its replica left before Serve confirmed it, or
        a bound dropped it): it counts nowhere and claims nothing."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._leave(key, entry)

    def _pop_awaiting(self, request_id: str) -> Optional[Tuple[str, HashedRequest, float]]:
        found = self._awaiting.pop(request_id, None)
        if found is not None:
            left = self._awaiting_on[found[0]] - 1
            if left:
                self._awaiting_on[found[0]] = left
            else:
                del self._awaiting_on[found[0]]
        return found

    def _bump(self, replica: str) -> None:
        self._versions[replica] = self._versions.get(replica, 0) + 1

    def _expire(self, now: float) -> None:
        """The bounds, oldest first: requests (and their claims) by count and by age; awaited
        answers too (their hashes are 32 bytes a block, and failed requests never report one)."""
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if now - entry.since < self.forget_after_s and len(self._entries) <= self.max_requests:
                break
            self.forget(key)
        while self._awaiting:
            request_id, (_, _, since) = next(iter(self._awaiting.items()))
            if now - since < self.answer_wait_s and len(self._awaiting) <= self.max_requests:
                break
            self._pop_awaiting(request_id)

"""`python -m load_tests.exchange_micro`: what the routers' exchange costs as ingress replicas multiply.

Every ingress replica (and every Python handle caller) routes with an LLMRouter of its own, and the
routers share their sends and answers through one `ExchangeBoard` actor per cluster: each push wakes
every other router's long poll, so the board's calls grow with the square of the routers. This
drives N real `IndexSync`s (each router's side of the exchange; spread over a few Ray actors that
stand in for ingress processes) against the real board actor, each sending R requests a second
(Poisson) and pushing each one's answer a while later, each router putting what it takes in into a
prefix index of its own (`--stride`: one block in four by default, as LLMRouter's). It measures the
board's CPU and calls, the routers' CPU, how long a send takes to reach the other routers (the
figure that matters: a router must know the others' sends within ~10 ms, docs/routing.md), and that
every send reached every other router. No Serve, no replicas, no decisions: the exchange alone.
Starts a local Ray and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from typing import List, Optional, Sequence

import ray

from router.config import DEFAULT_INDEX_STRIDE_BLOCKS

DRAIN_S = 10.0  # after the last send: at most this long for every entry to reach every router


@ray.remote(num_cpus=0)
class RouterHost:
    """One process's routers (an ingress replica has one; a few here, to spare the cores)."""

    def __init__(self, routers: int, deployment: str, share_index_s: float, stride: int):
        self.deployment, self.share_index_s, self.count, self.stride = deployment, share_index_s, routers, stride
        self.syncs, self.received = [], []

    async def start(self) -> None:
        from router.index import PrefixIndex
        from router.index_sync import IndexSync

        for _ in range(self.count):
            # Each router's index takes in the others' chains, as LLMRouter's does (its CPU is counted).
            index = PrefixIndex(240_000, self.stride)
            sync = IndexSync(self.share_index_s, self.deployment, index.kept_keys)
            got = {"sends": 0, "answers": 0, "lag_s": []}

            def apply(replica, chain, sent, extends, got=got, index=index):
                if chain:
                    index.insert_keys(replica, chain)
                if sent is not None:
                    got["sends"] += 1
                    got["lag_s"].append(time.time() - sent.routed_at)
                elif extends is not None:
                    got["answers"] += 1

            sync.start(apply)
            self.syncs.append(sync)
            self.received.append(got)

    async def reset(self) -> None:
        """Forgets what came before the run (none expected). Every host's, before any host sends: a
        host reset after another had sent would forget that send's arrival."""
        for got in self.received:
            got.update(sends=0, answers=0, lag_s=[])
        self.cpu0 = time.process_time()

    async def run(
        self,
        requests_per_s: float,
        prompt_blocks: int,
        answer_blocks: int,
        answer_after_s: float,
        seconds: float,
        seed: int,
    ) -> dict:
        """Sends for `seconds`; returns how many (each one's answer is pushed later, on this loop)."""
        sent = await asyncio.gather(
            *(
                self._send(
                    sync,
                    requests_per_s,
                    prompt_blocks,
                    answer_blocks,
                    answer_after_s,
                    seconds,
                    random.Random(seed * 1000 + i),
                )
                for i, sync in enumerate(self.syncs)
            )
        )
        return sum(sent)

    async def received(self) -> dict:
        """What this host's routers took in since the reset, and the CPU they used meanwhile."""
        return {
            "received_sends": sum(g["sends"] for g in self.received),
            "received_answers": sum(g["answers"] for g in self.received),
            "lag_s": [lag for g in self.received for lag in g["lag_s"]],
            "cpu_s": time.process_time() - self.cpu0,
        }

    @staticmethod
    async def _send(
        sync,
        rate: float,
        prompt_blocks: int,
        answer_blocks: int,
        answer_after_s: float,
        seconds: float,
        rng: random.Random,
    ) -> int:
        from router.scoring import Routed

        loop, sent = asyncio.get_running_loop(), 0
        end = loop.time() + seconds
        while loop.time() < end:
            await asyncio.sleep(rng.expovariate(rate))
            replica, rid = f"replica-{rng.randrange(16)}", f"req-{rng.getrandbits(64):x}"
            prompt = [os.urandom(32) for _ in range(prompt_blocks)]
            sync.learned(replica, prompt, sent=Routed(time.time(), prompt_blocks * 16, prompt_blocks * 8, rid))
            sent += 1
            answer = prompt + [os.urandom(32) for _ in range(answer_blocks)]
            loop.call_later(
                rng.expovariate(1 / answer_after_s), sync.learned, replica, answer, None, (rid, prompt_blocks)
            )
        return sent


def measure(
    routers: int,
    processes: int,
    requests_per_s: float,
    prompt_blocks: int,
    answer_blocks: int,
    answer_after_s: float,
    seconds: float,
    share_index_s: float,
    seed: int,
    stride: int = DEFAULT_INDEX_STRIDE_BLOCKS,
    drain_s: float = DRAIN_S,
) -> dict:
    """One run; waits after the last send until every send and answer reached every other router, or
    `drain_s` passed (what had not arrived by then counts as lost)."""
    from router.index_exchange import board_stats

    deployment = f"exchange-micro/{routers}-routers-stride{stride}"
    counts = [routers // processes + (i < routers % processes) for i in range(min(processes, routers))]
    hosts = [RouterHost.remote(n, deployment, share_index_s, stride) for n in counts]
    try:
        ray.get([h.start.remote() for h in hosts])
        deadline = time.monotonic() + 30
        while True:  # the routers' first calls make the board; each subscription makes its router heard from
            before = board_stats()
            if before and before["deployments"].get(deployment, {}).get("routers") == routers:
                break
            assert time.monotonic() < deadline, f"not every router subscribed within 30 s: {before}"
            time.sleep(0.05)
        ray.get([h.reset.remote() for h in hosts])
        t0 = time.monotonic()
        sends = sum(
            ray.get(
                [
                    h.run.remote(requests_per_s, prompt_blocks, answer_blocks, answer_after_s, seconds, seed + i)
                    for i, h in enumerate(hosts)
                ]
            )
        )
        deadline = time.monotonic() + drain_s
        while True:  # every send, and then its answer, reaches each other router
            runs = ray.get([h.received.remote() for h in hosts])
            expected = sends * (routers - 1)
            arrived = [sum(r[k] for r in runs) for k in ("received_sends", "received_answers")]
            if min(arrived) >= expected or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        wall, after = time.monotonic() - t0, board_stats()
    finally:
        for h in hosts:
            ray.kill(h)
    b0, b1 = before["deployments"].get(deployment, {}), after["deployments"][deployment]
    delta = {k: b1[k] - b0.get(k, 0) for k in ("pushes", "pulls", "entries_in", "entries_out", "hashes_out")}
    lags = sorted(lag for r in runs for lag in r["lag_s"])
    q = statistics.quantiles(lags, n=100) if len(lags) > 1 else [float("nan")] * 99
    return {
        "routers": routers,
        "processes": len(hosts),
        "stride": stride,
        "requests_per_s_each": requests_per_s,
        "prompt_blocks": prompt_blocks,
        "answer_blocks": answer_blocks,
        "seconds": seconds,
        "wall_s": wall,
        "sends": sends,
        "expected_deliveries": sends * (routers - 1),
        "delivered": sum(r["received_sends"] for r in runs),
        "answers_delivered": sum(r["received_answers"] for r in runs),
        "lag_ms_p50": q[49] * 1e3,
        "lag_ms_p90": q[89] * 1e3,
        "lag_ms_p99": q[98] * 1e3,
        "board_cpu_share": (after["cpu_s"] - before["cpu_s"]) / wall,
        "routers_cpu_share": sum(r["cpu_s"] for r in runs) / wall,
        **{f"board_{k}_per_s": v / wall for k, v in delta.items()},
    }


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    p = argparse.ArgumentParser(prog="python -m load_tests.exchange_micro", description=__doc__.splitlines()[0])
    p.add_argument("--routers", default="2,4,8,16", help="ingress replicas (routers) sharing one deployment")
    p.add_argument("--processes", type=int, default=4, help="Ray actors the routers are spread over")
    p.add_argument(
        "--requests-per-s",
        type=float,
        default=10.0,
        help="each router's sends a second (Mooncake's trace over 2 ingress replicas: ~10)",
    )
    p.add_argument(
        "--total-requests-per-s",
        type=float,
        default=0.0,
        help="if set, the fleet's sends a second, split evenly among the routers (instead of --requests-per-s)",
    )
    p.add_argument("--prompt-blocks", type=int, default=270, help="a send's chain (the trace's ~4,300 tokens)")
    p.add_argument("--answer-blocks", type=int, default=16, help="an answer's blocks past its prompt")
    p.add_argument("--answer-after-s", type=float, default=1.0, help="mean time from a send to its answer")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--share-index-s", type=float, default=0.25, help="LLMRouterConfig.share_index_s")
    p.add_argument(
        "--stride",
        type=int,
        default=DEFAULT_INDEX_STRIDE_BLOCKS,
        help="the routers' indexes keep one block in this many, and "
        "entries carry those (default: LLMRouter's, 4: 32 tokens of 8-token blocks); 1: every block",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the rows here too")
    args = p.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"index of one block in {args.stride}")
    print(
        f"{'routers':>7} {'req/s':>6} {'sends':>6} {'delivered':>10} {'lag p50':>8} {'p90':>7} {'p99':>8} "
        f"{'board CPU':>9} {'pushes/s':>8} {'batches/s':>9} {'entries out/s':>13} {'routers CPU':>11}"
    )
    rows = []
    try:
        for n in map(int, args.routers.split(",")):
            rate = args.total_requests_per_s / n if args.total_requests_per_s else args.requests_per_s
            r = measure(
                n,
                args.processes,
                rate,
                args.prompt_blocks,
                args.answer_blocks,
                args.answer_after_s,
                args.seconds,
                args.share_index_s,
                args.seed,
                args.stride,
            )
            rows.append(r)
            print(
                f"{n:>7} {n * rate:>6.0f} {r['sends']:>6} "
                f"{r['delivered'] / max(1, r['expected_deliveries']):>9.1%} {r['lag_ms_p50']:>6.1f}ms "
                f"{r['lag_ms_p90']:>5.1f}ms {r['lag_ms_p99']:>6.1f}ms {r['board_cpu_share']:>9.1%} "
                f"{r['board_pushes_per_s']:>8.1f} {r['board_pulls_per_s']:>9.1f} "
                f"{r['board_entries_out_per_s']:>13.0f} {r['routers_cpu_share']:>11.1%}"
            )
    finally:
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

"""`python -m load_tests.routing_staleness`: what routers that do not know each other's requests cost,
in the replay's engine model (load_tests.routing_replay; a MODEL, not a measurement).

Several routers (ingress replicas) each take a share of a trace's requests at random and rank
replicas with LLMRouter's scoring (each its own, with its window of the requests it sent), reading
each replica's load from its last report (one every `--report-s`, the queued prefill decayed at the
replica's rate since, as router.scoring does) plus the requests sent since that the router knows
of: its own at once, the other routers' only `known_after_s` after they were sent (inf: never, until
a report counts them). Prints TTFT p50/p90 for one router and for each delay; writes JSON. What
router.index_exchange's sharing of sends is for.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from batcher.simulated import StepTimeModel, preset_for
from load_tests.routing_replay import Chooser, ReplicaModel, RouterScoring, replay
from load_tests.routing_trace import cached_tokens, trace_workload
from router.scoring import EngineShape, FleetLoads, prefill_rate

SHAPE = EngineShape(block_size=8, max_num_batched_tokens=2048, max_num_seqs=64)  # load_tests.routing's


def stale_reports(
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    step: StepTimeModel,
    shape: EngineShape,
    routers: int,
    report_s: float,
    known_after_s: float,
    seed: int = 0,
) -> Chooser:
    """LLMRouter's scoring by `routers` routers over reports every `report_s` (module docstring)."""
    # One scoring per router: each keeps its own window of the requests it sent, as each LLMRouter does.
    scorings = [RouterScoring(prompts, max_tokens, step, shape, seed=seed + r) for r in range(routers)]
    pick = random.Random(seed)
    rate = float(prefill_rate(step, shape))
    reports: dict = {}  # replica -> (time, queued tokens, batch, context) as last reported
    last_report = [-math.inf]
    sends: List[list] = []  # per replica: (sent at, uncached tokens, prompt tokens, router)

    def choose(i: int, fleet: List[ReplicaModel], hits: List[int], now: float) -> int:
        if not sends:
            sends.extend([] for _ in fleet)
        if now - last_report[0] >= report_s:
            last_report[0] = now
            for k, rep in enumerate(fleet):
                reports[k] = (
                    now,
                    rep.queued_tokens(),
                    float(len(rep.waiting) + len(rep.running)),
                    float(sum(d[2] for d in rep.running) + sum(len(prompts[w[0]]) for w in rep.waiting)),
                )
        me = pick.randrange(routers)
        queued, batch, context = [], [], []
        for k in range(len(fleet)):
            at, tokens, b, c = reports[k]
            known = [s for s in sends[k] if s[0] > at and (s[3] == me or s[0] <= now - known_after_s)]
            last = at
            for sent_at, uncached, _prompt, _ in known:  # Lindley's recursion, as scoring.prefill_backlog
                tokens, last = max(0.0, tokens - (sent_at - last) * rate) + uncached, sent_at
            queued.append(max(0.0, tokens - (now - last) * rate))
            batch.append(b + len(known))
            context.append(c + sum(s[2] for s in known))
        loads = FleetLoads(np.array(queued), np.array(batch), np.array(context), np.full(len(fleet), math.nan))
        k = scorings[me].choose(i, fleet, hits, now, loads)
        sends[k].append(
            (now, len(prompts[i]) - cached_tokens(hits[k], len(prompts[i]), shape.block_size), len(prompts[i]), me)
        )
        return k

    return choose


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m load_tests.routing_staleness", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="h100-llama3-8b")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--report-s", type=float, default=0.5, help="the routing-stats period")
    p.add_argument(
        "--delays",
        default="0,0.01,0.02,0.05,0.1,0.25,inf",
        help="seconds after which a router knows another's request, comma separated",
    )
    # Mooncake's trace as load_tests.routing replays it on the GPU presets (docs/routing.md).
    p.add_argument("--trace", default="mooncake_conversation")
    p.add_argument("--trace-window-s", type=float, default=600.0)
    p.add_argument("--trace-speedup", type=float, default=6.5)
    p.add_argument("--trace-token-scale", type=float, default=0.5)
    p.add_argument("--trace-max-prompt", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/routing_staleness.json")
    args = p.parse_args(argv)
    trace = trace_workload(
        args.trace,
        0.0,
        args.trace_window_s,
        args.trace_speedup,
        1.0,
        args.trace_token_scale,
        1 / 16,
        32,
        args.trace_max_prompt,
        block_size=SHAPE.block_size,
        seed=args.seed,
    )
    prompts, max_tokens = [r.prompt for r in trace.requests], [r.max_tokens for r in trace.requests]
    step = preset_for(f"sim:{args.preset}").step
    runs = [(1, 0.0)] + [(args.routers, float(d)) for d in args.delays.split(",")]
    print(
        f"MODEL (load_tests.routing_replay), sim:{args.preset}, {args.replicas} replicas, reports every "
        f"{args.report_s} s, {len(prompts)} requests"
    )
    rows = []
    for routers, delay in runs:
        r = replay(
            prompts,
            max_tokens,
            trace.arrivals,
            stale_reports(prompts, max_tokens, step, SHAPE, routers, args.report_s, delay, args.seed),
            step,
            SHAPE,
            args.replicas,
        )
        rows.append(
            {"routers": routers, "known_after_s": delay, "ttft_ms_p50": r.ttft_ms(50), "ttft_ms_p90": r.ttft_ms(90)}
        )
        print(
            f"  {routers} router(s), others' requests known after {delay:>5} s: TTFT p50 {r.ttft_ms(50):4.0f} ms, "
            f"p90 {r.ttft_ms(90):4.0f} ms ({r.ttft_ms(90) / rows[0]['ttft_ms_p90']:.2f}x one router's)",
            flush=True,
        )
    out = {"model": "load_tests.routing_replay", "args": vars(args), "runs": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

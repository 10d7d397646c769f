"""`python -m load_tests.routing`: three routers, the same traffic, the same simulated fleets, one run.

Routers: Serve's default (power of two choices), Ray Serve LLM's PrefixCacheAffinityRouter (its own
code, through load_tests.routing_peers' text adapter) and iterserve's LLMRouter. Fleets: N replicas
of `sim:<preset>` (SIMULATED: the real engine, scheduler, KV bookkeeping and Serve plumbing, with the
forward replaced by a step-time model that sleeps; every figure here is a simulation). Traffic over
HTTP, streaming chat with usage (the chats: load_tests.routing_chats; a closed loop, or users who think
between turns with --think-s):
- shared: users in multi-turn chats over a few long system prompts;
- skew:   the same, one system prompt taking half the users;
- unique: one-turn chats with a prompt of their own (nothing to share);
- trace:  a public production trace with prefix block ids (Mooncake's conversation trace), replayed
          at its arrival times (each 3 s tick's requests spread over it; a window, time- and
          rate-scaled, token-scaled) over the completions API (load_tests.routing_trace), with what
          an infinite prefix cache would reach on it.
Every workload's decisions are replayed through the step-time model without Serve, beside LLMRouter's
scoring with exact loads and each request's time outside the engine, split by the answers'
Server-Timing headers (load_tests.routing_replay: decisions apart from plumbing).
Reports cached-token share, TTFT p50/p90/p99, failures, output tokens/s, requests in flight per replica and
the time-weighted max/mean of in-flight requests per replica (from the X-Iterserve-Replica header of each answer); writes JSON. Bounded: fixed sessions
(users per replica x fleet size), a timeout per request. The client is the load generator's (load_tests.bench_client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from batcher.model_files import load_tokenizer
from batcher.simulated import preset_for
from cluster.local_serve import local_serve
from load_tests.bench_client import Target, run_load
from load_tests.routing_chats import chat_starts, sessions
from load_tests.routing_metrics import RoundResult, exchange_volume, pool_rounds, summarize
from load_tests.routing_replay import (
    REPLICA_HEADER,
    TIMING_HEADER,
    chat_turns,
    decisions_ttfts,
    exact_loads_ttfts,
    ttft_parts_line,
)
from load_tests.routing_trace import TraceWorkload, trace_workload
from router.index_exchange import board_stats
from router.scoring import EngineShape, prefill_rate

ROUTERS = {
    "serve-default": None,
    "ray-prefix-affinity": "load_tests.routing_peers:PrefixCacheAffinityAdapter",
    "llm-router": "router:LLMRouter",
    # Not run unless named: LLMRouter without the replicas' eviction reports (its index's own LRU).
    "llm-router-lru": "router:LLMRouter",
}
DEFAULT_ROUTERS = "serve-default,ray-prefix-affinity,llm-router"
ROUTER_KWARGS = {"llm-router-lru": {"follow_evictions": False}}
WORKLOADS = ("shared", "skew", "unique", "trace")
CHATS = ("shared", "skew", "unique")  # the default workloads (trace: `--workloads trace`)
SHAPE = EngineShape(block_size=8, max_num_batched_tokens=2048, max_num_seqs=64)  # every fleet's engine


def app_config(args, router_name: str, replicas: int) -> dict:
    router, router_class = {"request_routing_stats_period_s": args.stats_period_s}, ROUTERS[router_name]
    if router_class:
        router["request_router_class"] = router_class
    kwargs = dict(ROUTER_KWARGS.get(router_name, {}))
    if router_class == ROUTERS["llm-router"] and args.llm_router_kwargs:
        kwargs.update(json.loads(args.llm_router_kwargs))
    if kwargs:
        router["request_router_kwargs"] = kwargs
    kv_blocks = args.trace_kv_blocks if args.workloads == ["trace"] else args.kv_blocks
    return {
        "engine": {
            "model": f"sim:{args.preset}",
            "num_kv_blocks": kv_blocks,
            "block_size": SHAPE.block_size,
            "max_num_seqs": SHAPE.max_num_seqs,
            "max_num_batched_tokens": SHAPE.max_num_batched_tokens,
        },
        "replica": {"num_replicas": replicas, "max_ongoing_requests": 256},
        "ingress": {"num_replicas": args.ingress_replicas},
        "stream": {"interval_ms": 20, "max_chunks_per_s": 25},
        "router": router,
    }


def trace_of(args) -> TraceWorkload:
    return trace_workload(
        args.trace,
        args.trace_start_s,
        args.trace_window_s,
        args.trace_speedup,
        args.trace_rate,
        args.trace_token_scale,
        args.trace_output_scale,
        args.trace_max_output,
        args.trace_max_prompt,
        block_size=SHAPE.block_size,
        seed=args.seed,
        at_ticks=args.trace_at_ticks,
    )


def run_fleet(
    args, replicas: int, apps: Dict[str, object], url_base: str, trace: Optional[TraceWorkload], tokenizer
) -> Dict[str, Dict[str, dict]]:
    from ray import serve

    step = preset_for(f"sim:{args.preset}").step
    if trace is not None:  # the replays' inputs, and the yardstick every router of this fleet is read against
        prompts, max_tokens = [r.prompt for r in trace.requests], [r.max_tokens for r in trace.requests]
        exact = exact_loads_ttfts(prompts, max_tokens, trace.arrivals, step, SHAPE, replicas)
    rounds: Dict[str, Dict[str, List[RoundResult]]] = {kind: {name: [] for name in apps} for kind in args.workloads}
    for round_ in range(args.rounds):
        for name in round_order(list(apps), round_):
            app = f"route{replicas}{name.replace('-', '')}"
            serve.run(apps[name], name=app, route_prefix=f"/{app}")
            url = f"{url_base}/{app}"
            users = args.users_per_replica * replicas
            for kind in args.workloads:
                board_before, samples = board_stats(), {}
                if kind == "trace":
                    target = Target(url, api="completions", record_headers=(REPLICA_HEADER, TIMING_HEADER))
                    result = asyncio.run(
                        run_load(target, trace.requests, arrivals=trace.arrivals, timeout_s=args.timeout_s)
                    )
                else:
                    target = Target(url, record_headers=(REPLICA_HEADER, TIMING_HEADER))
                    work = sessions(
                        kind, users, args.turns, args.system_words, args.user_words, args.max_tokens, args.seed
                    )
                    result = asyncio.run(
                        run_load(
                            target,
                            work,
                            chat_starts(len(work), args.think_s, args.seed),
                            timeout_s=args.timeout_s,
                            think_s=args.think_s,
                            seed=args.seed,
                        )
                    )
                m = summarize(result.records, result.duration_s, replicas)
                m["index_exchange"] = exchange_volume(app, board_before, board_stats(), result.duration_s)
                if kind == "trace":
                    m.update(
                        infinite_cache_share=trace.infinite_cache_share,
                        prefill_load=prefill_load(trace, args.preset, replicas),
                        **exact,
                    )
                    by_index = {r.index: r for r in result.records if r.ok}
                    ok = [by_index.get(i) for i in range(len(prompts))]
                    replica_of = [r and r.headers.get(REPLICA_HEADER) for r in ok]
                    m.update(
                        decisions_ttfts(
                            prompts, max_tokens, trace.arrivals, replica_of, step, SHAPE, replicas, ok, samples
                        )
                    )
                else:  # the run's own send times: a closed loop's arrivals depend on its router
                    turns, budgets, sent, replica_of, turn_records = chat_turns(work, result.records, tokenizer)
                    m.update(
                        exact_loads_ttfts(turns, budgets, sent, step, SHAPE, replicas),
                        **decisions_ttfts(
                            turns, budgets, sent, replica_of, step, SHAPE, replicas, turn_records, samples
                        ),
                    )
                rounds[kind][name].append(RoundResult(m, result.records, result.duration_s, samples))
                print(f"  {replicas} replicas, round {round_ + 1}, {name:20s} {kind:7s} {m}", flush=True)
            serve.delete(app)
    return {
        kind: {name: pool_rounds(runs, replicas) for name, runs in by_router.items()}
        for kind, by_router in rounds.items()
    }


def round_order(routers: List[str], round_: int) -> List[str]:
    """The routers in the order given, reversed every other round: whatever drifts over a run (the
    machine, Serve's long-lived proxy) then weighs on every router alike (A B C, C B A, ...)."""
    return routers if round_ % 2 == 0 else routers[::-1]


def targets(kind: str, by_router: Dict[str, dict]) -> List[tuple]:
    """(what, met) for llm-router on one workload: issue 20's targets where prefixes are shared
    (the trace, shared, skew), balance on skew, throughput where nothing is shared."""
    ours, default = by_router.get("llm-router"), by_router.get("serve-default")
    ray_llm = by_router.get("ray-prefix-affinity")
    if not ours:
        return []
    checks = [("nothing failed", ours["failed"] == 0)]
    if kind != "unique":
        bound = ours.get("infinite_cache_share")
        if bound:
            checks.append((f"cached share >= 0.9x infinite cache ({bound:.1%})", ours["cached_share"] >= 0.9 * bound))
        if default:
            checks += [
                ("cached share > Serve default", ours["cached_share"] > default["cached_share"]),
                ("TTFT p90 <= 0.7x Serve default", ours["ttft_ms_p90"] <= 0.7 * default["ttft_ms_p90"]),
            ]
        if ray_llm:  # "level": within a point of it
            checks += [
                ("cached share >= PrefixCacheAffinity - 0.01", ours["cached_share"] >= ray_llm["cached_share"] - 0.01),
                ("TTFT p90 <= 1.05x PrefixCacheAffinity", ours["ttft_ms_p90"] <= 1.05 * ray_llm["ttft_ms_p90"]),
            ]
    # Balance where there is load: with under one request in flight per replica, max/mean measures chance
    # (the only request in flight, on one of 4 replicas, is 4.0).
    if kind == "skew" and ours["inflight_max_over_mean"] and ours.get("inflight_per_replica", 1.0) >= 1.0:
        checks.append(("max/mean in-flight <= 1.5", ours["inflight_max_over_mean"] <= 1.5))
    if kind == "unique" and default:
        checks.append(
            (
                "throughput within 5% of Serve default",
                ours["output_tokens_per_s"] >= 0.95 * default["output_tokens_per_s"],
            )
        )
    return checks


def prefill_load(trace: TraceWorkload, preset: str, replicas: int) -> float:
    """The share of the fleet's prefill capacity (full steps of prompt tokens, by the preset's model)
    the trace takes even with an infinite cache: how busy it keeps the replicas, the same measure on
    every preset."""
    step = preset_for(f"sim:{preset}").step
    return trace.description["uncached_prompt_tokens_per_s"] / (replicas * prefill_rate(step, SHAPE))


def report(all_results: Dict[int, Dict[str, Dict[str, dict]]], preset: str) -> List[dict]:
    print(f"\nSIMULATED fleets (sim:{preset}: step-time model, not a real GPU)")
    print(
        f"{'replicas':>8} {'workload':8} {'router':20} {'cached':>7} {'of inf.':>7} {'TTFT p50':>9} {'TTFT p90':>9} "
        f"{'TTFT p99':>9} {'out tok/s':>9} {'in flight':>9} {'max/mean':>8} {'failed':>6}"
    )
    checks = []
    for n, by_kind in all_results.items():
        for kind, by_router in by_kind.items():
            for name, m in by_router.items():
                imb = f"{m['inflight_max_over_mean']:.2f}" if m["inflight_max_over_mean"] else "-"
                bound = m.get("infinite_cache_share")
                of_bound = f"{m['cached_share'] / bound:.2f}x" if bound else "-"
                print(
                    f"{n:>8} {kind:8} {name:20} {m['cached_share']:>7.1%} {of_bound:>7} {m['ttft_ms_p50']:>7.0f}ms "
                    f"{m['ttft_ms_p90']:>7.0f}ms {m['ttft_ms_p99']:>7.0f}ms {m['output_tokens_per_s']:>9.0f} "
                    f"{m.get('inflight_per_replica', float('nan')):>9.1f} {imb:>8} "
                    f"{m['failed']:>6}"
                )
                if "rounds" in m:
                    print(
                        f"{'':>8} {'':8} {'':20} by round: TTFT p90 "
                        + " / ".join(f"{r['ttft_ms_p90']:.0f}" for r in m["rounds"])
                        + " ms, cached "
                        + " / ".join(f"{r['cached_share']:.1%}" for r in m["rounds"])
                    )
                ex = m.get("index_exchange")
                if ex and ex["pulls_per_s"]:
                    print(
                        f"{'':>8} {'':8} {'':20} index exchange: {ex['pushes_per_s']:.1f} pushes/s "
                        f"({ex['entries_in_per_s']:.1f} entries), {ex['pulls_per_s']:.1f} batches/s to routers, blocks "
                        f"{ex['hashes_in_per_s']:.0f}/s in, {ex['hashes_out_per_s']:.0f}/s out "
                        f"(~{ex['kb_per_s']:.0f} KB/s), its actor {ex['board_cpu_share']:.1%} of a core"
                    )
            checks += [(n, kind, what, met) for what, met in targets(kind, by_router)]
    for n, by_kind in all_results.items():
        load = next((m["prefill_load"] for m in by_kind.get("trace", {}).values()), None)
        if load is not None:
            print(
                f"trace on {n} replicas: its uncached prompt tokens, even with an infinite cache, take "
                f"{load:.0%} of the fleet's prefill capacity (full steps, sim:{preset}'s model)"
            )
        for kind, by_router in by_kind.items():
            replayed = {name: m for name, m in by_router.items() if "modelled_ttft_ms_p90" in m}
            if replayed:
                print(
                    f"  {n} replicas, {kind}: each router's decisions replayed through sim:{preset}'s step-time "
                    f"model, no Serve (load_tests.routing_replay; a MODEL); LLMRouter's scoring on the same "
                    f"arrivals with exact loads; the rest of the client's TTFT, outside the engine:"
                )
                for name, m in replayed.items():
                    print(
                        f"    {name:20s} replayed p50 {m['modelled_ttft_ms_p50']:.0f} / p90 "
                        f"{m['modelled_ttft_ms_p90']:.0f} ms, exact loads p50 {m['exact_loads_ttft_ms_p50']:.0f} / "
                        f"p90 {m['exact_loads_ttft_ms_p90']:.0f} ms, outside p50 "
                        f"{m.get('outside_engine_ms_p50', float('nan')):.0f} / p90 "
                        f"{m.get('outside_engine_ms_p90', float('nan')):.0f} ms"
                    )
                    if "replica_ttft_ms_p50" in m:
                        print(" " * 25 + ttft_parts_line(m))
    print("\ntargets (llm-router):")
    for n, kind, what, met in checks:
        print(f"  {n} replicas, {kind:7s} {what:48s} {'met' if met else 'MISSED'}")
    return [{"replicas": n, "workload": k, "target": w, "met": m} for n, k, w, m in checks]


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m load_tests.routing", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="4,8", help="fleet sizes, comma separated")
    p.add_argument("--routers", default=DEFAULT_ROUTERS, help=f"of {', '.join(ROUTERS)}")
    p.add_argument("--workloads", default=",".join(CHATS), help=f"of {', '.join(WORKLOADS)}")
    p.add_argument(
        "--preset",
        default="cpu-smollm2",
        help="simulated replicas; with sim:h100-llama3-8b's millisecond steps, Serve's own plumbing on "
        "this 2-core machine outweighs the modelled work and hides the routing",
    )
    p.add_argument(
        "--users-per-replica",
        type=int,
        default=4,
        help="concurrent chat sessions per replica (every fleet gets the same load per replica)",
    )
    # Long chats with long user turns and short answers: most of each prompt is the conversation so
    # far, so following the conversation matters, not only the system prompt (at best ~28% of the
    # prompt tokens cached by system prompt alone, ~84% following the conversation). The earlier,
    # lighter workload: --turns 4 --user-words 40 --max-tokens 16 --kv-blocks 400.
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-words", type=int, default=300, help="~1.3 tokens a word")
    p.add_argument("--user-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="chats: mean seconds a user thinks before each later turn (exponential, seeded; the first "
        "turns spread over one such time); 0: every user at once and each turn as the last answer "
        "ends, a closed loop that runs as fast as the machine lets it",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=1280,
        help="per replica (8 tokens each): room for its users' whole conversations, scaled with the workload",
    )
    # The trace workload: 4 replicas of sim:cpu-smollm2 kept busy, prefill costly against the arrivals
    # (~9 requests/s of ~220 prompt tokens: ~1400 uncached prompt tokens/s against ~2600 the fleet prefills).
    p.add_argument("--trace", default="mooncake_conversation", help="a bundled trace with prefix block ids")
    p.add_argument("--trace-start-s", type=float, default=0.0)
    p.add_argument("--trace-window-s", type=float, default=600.0)
    p.add_argument("--trace-speedup", type=float, default=3.0, help="time scaling: arrivals this many times faster")
    p.add_argument("--trace-rate", type=float, default=1.0, help="rate scaling: this many times the users")
    p.add_argument(
        "--trace-token-scale", type=float, default=1 / 64, help="prompts and prefix blocks this much shorter"
    )
    p.add_argument("--trace-output-scale", type=float, default=1 / 16)
    p.add_argument("--trace-max-output", type=int, default=32)
    p.add_argument("--trace-max-prompt", type=int, default=1900, help="longer prompts are cut (prefix kept)")
    p.add_argument("--trace-kv-blocks", type=int, default=12000, help="per replica, for the trace workload")
    p.add_argument(
        "--trace-at-ticks",
        action="store_true",
        help="send a tick's requests together at its timestamp, "
        "as recorded (Mooncake's 3 s ticks), not spread over the tick",
    )
    p.add_argument(
        "--llm-router-kwargs",
        default="",
        help="LLMRouter settings as JSON (router.request_router_kwargs), e.g. '{\"affinity_margin\": 1.5}'",
    )
    p.add_argument(
        "--ingress-replicas",
        type=int,
        default=1,
        help="HTTP ingress replicas: each routes with a router of its own (Serve's proxy spreads requests)",
    )
    p.add_argument("--stats-period-s", type=float, default=0.5)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every router this many times, the order reversed every other round (A B C, C B A), "
        "and pool each router's requests over its rounds",
    )
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/routing.json")
    args = p.parse_args(argv)
    args.routers, args.workloads = args.routers.split(","), args.workloads.split(",")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    context = preset_for(f"sim:{args.preset}").max_model_len
    if "trace" in args.workloads and args.trace_max_prompt + args.trace_max_output > context:
        p.error(
            f"--trace-max-prompt {args.trace_max_prompt} + --trace-max-output {args.trace_max_output} is more "
            f"than sim:{args.preset}'s context of {context} tokens: the longer requests would fail"
        )
    from deployments.app import build_app

    fleets = [int(n) for n in args.replicas.split(",")]
    # Every app is built (its router class serialized) before the first handle makes a router in this
    # process: serializing a router class after that failed here (cloudpickle met an asyncio.Future).
    apps = {n: {name: build_app(app_config(args, name, n)) for name in args.routers} for n in fleets}
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    trace = trace_of(args) if "trace" in args.workloads else None  # built once: hashing every prompt
    tokenizer = load_tokenizer(f"sim:{args.preset}")  # the chat replays tokenize as the ingress does
    with local_serve(num_cpus=2, logging_level="ERROR") as server:
        results = {n: run_fleet(args, n, apps[n], server.url, trace, tokenizer) for n in fleets}
    checks = report(results, args.preset)
    out = {"simulated": f"sim:{args.preset}", "args": vars(args), "results": results, "targets": checks}
    if trace is not None:
        out["trace"] = trace.description
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

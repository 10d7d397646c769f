"""`python -m load_tests.structured_bench`: what structured outputs cost the batch.

One engine, one batch of chat requests, greedy, every request generating exactly --max-tokens
tokens, with 0%, 20% and 100% of them constrained by a JSON schema (one that cannot end before
that, so every mix does the same work), and a baseline: 0% on the engine as it was before any
request was constrained (no grammar state at all). The mixes run interleaved, --repeats rounds (each starting with another mix), after a
warm-up round that also compiles the grammar; each mix keeps its median. Throughput is generated
tokens per second of wall time; TPOT is the mean engine step (one token per running sequence).
Targets (issue 22): 0% costs nothing measurable against the baseline, 20% costs <= 5% throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from batcher import EngineConfig, LLMEngine, SamplingParams
from batcher.structured_outputs import StructuredOutputs

TOPICS = ["a city", "a book", "a recipe", "a planet", "a song", "a river", "a painter", "a machine"]


def schema(min_items: int) -> dict:
    """An object whose array must hold at least `min_items` strings: longer than any --max-tokens run."""
    return {
        "type": "object",
        "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": min_items}},
        "required": ["notes"],
    }


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.structured_bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--shares", default="0,0.2,1", help="constrained shares of the batch, comma separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="results/structured_bench.json")
    return p.parse_args(argv)


def requests(engine: LLMEngine, n: int, share: float, max_tokens: int):
    """n prompts; every round(1 / share)-th one constrained (share 0.2: requests 0, 5, 10, ...)."""
    tok = engine.tokenizer
    constrained = {i for i in range(n) if share and i % round(1 / share) == 0} if share < 1 else set(range(n))
    spec = StructuredOutputs(json=schema(max_tokens))
    prompts, params = [], []
    for i in range(n):
        text = f"Write notes about {TOPICS[i % len(TOPICS)]} number {i}, as JSON."
        prompts.append(
            tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        )
        params.append(
            SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=spec)
            if i in constrained
            else SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
    return prompts, params, len(constrained)


def run_once(engine: LLMEngine, prompts, params, stateless: bool = False) -> Dict[str, float]:
    """One batch; `stateless`: without the engine's grammar state, as before its first constrained request."""
    kept = engine.constrained
    if stateless:
        engine.constrained = None
    c = engine.counters
    steps, step_s = c.steps, c.step_seconds
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    engine.constrained = kept
    tokens = sum(len(o.token_ids) for o in outs)
    assert all(o.finish_reason == "length" for o in outs), "a request ended early: the mixes would differ in work"
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "tpot_ms": 1000 * (c.step_seconds - step_s) / (c.steps - steps),
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    shares = [float(s) for s in args.shares.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.num_requests))
    t0 = time.perf_counter()
    engine.builder.compile(StructuredOutputs(json=schema(args.max_tokens)))
    compile_s = time.perf_counter() - t0
    work = {s: requests(engine, args.num_requests, s, args.max_tokens) for s in shares}
    unconstrained = requests(engine, args.num_requests, 0.0, args.max_tokens)
    run_once(engine, *work[shares[-1]][:2])  # warm-up: first forwards, matcher code paths
    mixes = ["baseline"] + shares
    rounds: Dict[object, List[Dict[str, float]]] = {m: [] for m in mixes}
    for k in range(args.repeats):
        for m in mixes[k % len(mixes) :] + mixes[: k % len(mixes)]:  # each round starts elsewhere: no order bias
            if m == "baseline":
                rounds[m].append(run_once(engine, *unconstrained[:2], stateless=True))
            else:
                rounds[m].append(run_once(engine, *work[m][:2]))
    rows = []
    for m in mixes:
        tps = statistics.median(r["tokens_per_s"] for r in rounds[m])
        tpot = statistics.median(r["tpot_ms"] for r in rounds[m])
        rows.append(
            {
                "mix": "baseline (no grammar state)" if m == "baseline" else f"{m:.0%} constrained",
                "constrained": 0 if m == "baseline" else work[m][2],
                "tokens_per_s": tps,
                "tpot_ms": tpot,
                "rounds": rounds[m],
            }
        )
    base = rows[0]["tokens_per_s"]
    print(
        f"model {args.model}, {args.num_requests} requests x {args.max_tokens} tokens, greedy; median of "
        f"{args.repeats} interleaved rounds; JSON schema compiled in {compile_s * 1000:.0f} ms"
    )
    print(f"{'mix':>28} {'requests':>9} {'tokens/s':>9} {'TPOT ms':>8} {'vs baseline':>12}")
    for r in rows:
        r["vs_baseline"] = r["tokens_per_s"] / base
        print(
            f"{r['mix']:>28} {r['constrained']:>9} {r['tokens_per_s']:>9.1f} {r['tpot_ms']:>8.1f} "
            f"{r['vs_baseline']:>12.3f}"
        )
    result = {
        "model": args.model,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "compile_ms": compile_s * 1000,
        "rows": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

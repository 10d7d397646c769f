"""`python -m load_tests.capacity_check`: the capacity a replica reports at light load, against what
its engine completes full.

A replica reports to the autoscaler the requests per second it would complete running all its slots
(`capacity`: router.cost_model.StepMeter.capacity, from the step times it measures and its requests'
mean size), so a fleet that never fills is sized by what it can do (docs/autoscaling.md). This checks
that estimate on a real forward: the engine of a Serve config (`serve_config.yaml`'s by default),
offline, no Serve. A warm-up at full load (compiles), then `--light` requests kept running for
`--seconds` while a StepMeter reads the engine's counters every second (as LLMServer's routing-stats
poll does), then `max_num_seqs` kept running for `--seconds`, counting completions. Prompts of about
100 tokens, unique (no prefix shared) unless `--shared`; answers of `--max-tokens` (ignore_eos).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional

import yaml

from deployments.app import default_cost_model, load_config

TEXT = "write a long story about a lighthouse keeper and the sea. " * 6


def keep_running(engine, make_request, concurrency: int, seconds: float, meter=None) -> float:
    """Steps `engine` for `seconds`, topping its requests up to `concurrency`; `meter` (a StepMeter)
    reads the counters every second. Returns the requests completed per second."""
    start = last = time.monotonic()
    done = engine.stats().finished_requests
    while time.monotonic() - start < seconds:
        s = engine.stats()
        for _ in range(concurrency - (s.running + s.waiting)):
            make_request()
        engine.step()
        if meter is not None and time.monotonic() - last >= 1.0:
            meter.observe(engine.stats())
            last = time.monotonic()
    return (engine.stats().finished_requests - done) / (time.monotonic() - start)


def main(argv: Optional[list] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="serve_config.yaml", help="a Serve config: its first application's engine")
    ap.add_argument("--model", help="override the engine's model (e.g. tiny-llama)")
    ap.add_argument("--light", type=int, default=4, help="requests running while the capacity is estimated")
    ap.add_argument("--seconds", type=float, default=90.0, help="each phase, light and full")
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--shared", action="store_true", help="prompts share all but their last token (cache hits)")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)

    from batcher.engine_input import EngineInput
    from batcher.llm_engine import LLMEngine
    from batcher.sampling_params import SamplingParams
    from batcher.simulated import PRESETS
    from router.cost_model import StepMeter

    app = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    if args.model:
        app["engine"]["model"] = args.model
    cfg = load_config(app)
    engine = LLMEngine(cfg.engine)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    text = engine.tokenizer.encode(TEXT)
    sent = [0]

    def make_request() -> None:
        sent[0] += 1
        head = [] if args.shared else [100 + sent[0] % 5000, 100 + sent[0] // 5000]
        engine.add_request(EngineInput(head + text + [10 + sent[0] % 1000], params))

    full = cfg.engine.max_num_seqs
    keep_running(engine, make_request, full, args.warmup_s)
    meter = StepMeter()
    meter.observe(engine.stats())
    light_rps = keep_running(engine, make_request, args.light, args.seconds, meter)
    s = engine.stats()
    prior = PRESETS[default_cost_model(cfg)].step
    estimate = meter.capacity(prior, full, cfg.engine.max_num_batched_tokens, s.kv_blocks_total * cfg.engine.block_size)
    keep_running(engine, make_request, full, min(args.warmup_s, args.seconds))  # settle into full
    full_rps = keep_running(engine, make_request, full, args.seconds)
    size = meter.request_size() or (float("nan"), float("nan"))
    result = {
        "model": cfg.engine.model,
        "max_num_seqs": full,
        "light": args.light,
        "shared_prompts": args.shared,
        "prompt_tokens_computed": size[0],
        "tokens_generated": size[1],
        "light_rps": light_rps,
        "capacity_estimate_rps": estimate,
        "full_rps": full_rps,
        "estimate_over_full": estimate / full_rps,
    }
    print(
        f"{cfg.engine.model}, {full} slots, prompts {'shared' if args.shared else 'unique'}: "
        f"{size[0]:.0f} prompt tokens computed and {size[1]:.0f} generated per request"
    )
    print(f"{'phase':<22} {'running':>7} {'req/s':>7}")
    print(f"{'light (completed)':<22} {args.light:>7} {light_rps:>7.2f}")
    print(f"{'light (capacity est.)':<22} {full:>7} {estimate:>7.2f}")
    print(f"{'full (completed)':<22} {full:>7} {full_rps:>7.2f}")
    print(f"estimate / completed full: {estimate / full_rps:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

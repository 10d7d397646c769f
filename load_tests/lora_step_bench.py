"""`python -m load_tests.lora_step_bench`: what mixing LoRA adapters in one batch costs a step.

One engine with --adapters random PEFT adapters (rank --rank on every decoder linear layer, made with
`peft`), one decode batch of --batch sequences: all on the base model, or spread over the adapters
(sequence i on adapter i mod N), timed over the same decode steps; mixes interleaved, --repeats
rounds, medians. The base batch runs on the same LoRA engine (its forward then does no LoRA work),
and on an engine without LoRA for reference (that one may run compiled: adapters force eager).
Target (issue 23): a batch with 8 adapters costs <= 1.3x the base step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from batcher import EngineConfig, EngineInput, LLMEngine, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_name: str, count: int, rank: int, directory: Path) -> Dict[str, str]:
    from peft import LoraConfig, get_peft_model

    from batcher.model_loader import load_model

    paths = {}
    for i in range(count):
        base, _ = load_model(model_name, torch.float32, torch.device("cpu"))
        torch.manual_seed(i)
        model = get_peft_model(
            base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        )
        model.save_pretrained(str(directory / f"a{i}"))
        paths[f"a{i}"] = str(directory / f"a{i}")
    return paths


def decode_steps(engine: LLMEngine, names: List[Optional[str]], prompt_len: int, steps: int) -> float:
    """Mean seconds of `steps` decode steps of one batch (after its prefill)."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    requests = [
        engine.make_request(EngineInput([100 + (i * 7 + j) % 5000 for j in range(prompt_len)], params, lora_name=n))
        for i, n in enumerate(names)
    ]
    for r in requests:
        engine.add(r)
    while any(r.seq.num_output_tokens == 0 for r in requests):  # prefill (and the first token)
        engine.step()
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    return (time.perf_counter() - t0) / n


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m load_tests.lora_step_bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="results/lora_step_bench.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(args.model, args.adapters, args.rank, Path(tmp))
        lora = {"adapters": paths, "max_loras": args.adapters, "max_lora_rank": args.rank}
        engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.batch, lora=lora))
        plain = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.batch))
        mixes = {
            "base, engine without LoRA": (plain, [None] * args.batch),
            "base, LoRA engine": (engine, [None] * args.batch),
            f"{args.adapters} adapters mixed": (engine, [f"a{i % args.adapters}" for i in range(args.batch)]),
        }
        for eng, names in mixes.values():  # warm-up: first forwards, slot loads
            decode_steps(eng, names, args.prompt_len, 4)
        times: Dict[str, List[float]] = {m: [] for m in mixes}
        for k in range(args.repeats):
            order = list(mixes)[k % len(mixes) :] + list(mixes)[: k % len(mixes)]
            for m in order:
                times[m].append(decode_steps(*mixes[m], args.prompt_len, args.steps))
    base = statistics.median(times["base, LoRA engine"])
    print(
        f"model {args.model}, decode batch {args.batch}, {args.adapters} adapters of rank {args.rank} on "
        f"{', '.join(TARGETS)}; median of {args.repeats} rounds of {args.steps} steps"
    )
    print(f"{'batch':>32} {'step ms':>8} {'vs base (LoRA engine)':>22}")
    rows = []
    for m in mixes:
        med = statistics.median(times[m])
        rows.append({"mix": m, "step_ms": 1000 * med, "vs_base": med / base, "rounds_ms": [1000 * t for t in times[m]]})
        print(f"{m:>32} {1000 * med:>8.1f} {med / base:>22.2f}")
    result = {
        "model": args.model,
        "batch": args.batch,
        "adapters": args.adapters,
        "rank": args.rank,
        "engine_forward": engine.runner.forward.mode,
        "plain_forward": plain.runner.forward.mode,
        "rows": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

"""`python -m load_tests.calibrate_sim`: fits a simulation preset's step-time model to this engine.

Runs the real engine on decode batches of several sizes over prompts of several lengths (prefill
steps included), records each step's (prefill tokens, decoding sequences, context tokens), its
forward time and its whole engine step's time, and fits step time = fixed + a x prefill + b x decoding
+ c x context by least squares. Prints the coefficients to put in a `batcher.simulated` preset, and
the fit's error. On CUDA the forward returns before the GPU has finished (the step waits for it when
it reads the sampled tokens back): there only the whole step's fit is a step time.

With `--preset NAME` it also sets the measured steps beside that preset: the step times both give for
a few probe steps, the requests per second a full replica completes on the fleet simulator's request
sizes (`capacity_rps`, what the autoscaler's mu starts from), and the model the router learns from the
same steps with the preset as its prior (`router.cost_model.learned_step`). On a GPU machine
(`--device cuda --config load_tests/configs/llama-3.1-8b-like.json --tokenizer DIR`) the model is a
random-weight one built from the config: weights cannot be carried there, and a step's time does not
depend on them. Results: docs/routing.md#simulated-replicas.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from batcher import EngineConfig, LLMEngine, SamplingParams
from batcher.simulated import PRESETS, StepTimeModel, step_features
from load_tests.gpu_forward import build_model_dir
from load_tests.workload import random_prompts, text_token_range
from router.cost_model import capacity_rps, learned_step

Sample = Tuple[int, int, int, float, float]  # prefill tokens, decoding sequences, context tokens, forward s, step s
# (prefill tokens, decoding sequences, context tokens) of the probe steps compared with a preset
PROBES = {
    "decode 1 seq, 512 context": (0, 1, 512),
    "decode 32 seqs, 1k context each": (0, 32, 32 * 1024),
    "decode 128 seqs, 1k context each": (0, 128, 128 * 1024),
    "prefill 2048 tokens": (2048, 0, 2048),
    "prefill 1024 + decode 64 (1k each)": (1024, 64, 64 * 1024 + 1024),
}
# (prompt, output) tokens: the fleet simulator's means for azure_code_2023 and azure_conv_2023
REQUEST_SIZES = {"azure_code (2048 in, 28 out)": (2048, 28), "azure_conv (1155 in, 211 out)": (1155, 211)}


def record_steps(
    engine: LLMEngine, batches: Sequence[int], prompt_lens: Sequence[int], max_tokens: int, seed: int
) -> List[Sample]:
    samples: List[Sample] = []
    execute, step = engine.runner.execute, engine.step
    forward: list = []

    def timed_execute(scheduled, *args):
        t0 = time.perf_counter()
        logits = execute(scheduled, *args)
        forward.append((step_features(scheduled), time.perf_counter() - t0))
        return logits

    def timed_step():
        t0 = time.perf_counter()
        deltas = step()
        ((features, seconds),) = forward  # one forward per step
        forward.clear()
        samples.append((*features, seconds, time.perf_counter() - t0))
        return deltas

    engine.runner.execute, engine.step = timed_execute, timed_step
    vocab = text_token_range(engine.tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        for batch in batches:
            for n in prompt_lens:
                engine.generate(random_prompts(batch, n, vocab, seed + batch * 1000 + n), params)
                print(f"  batch {batch:3d} x {n:4d} prompt tokens: {len(samples)} steps so far", flush=True)
    finally:
        engine.runner.execute, engine.step = execute, step
    return samples


def design(samples: List[Sample], column: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each step's terms (1, prefill tokens, decoding sequences, context tokens), and its time in
    `column` (3: the forward, 4: the whole step)."""
    x = torch.tensor([[1.0, s[0], s[1], s[2]] for s in samples], dtype=torch.float64)
    return x, torch.tensor([s[column] for s in samples], dtype=torch.float64)


def nonnegative_lstsq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """argmin |a c - b| over c >= 0, exactly: the optimum is the plain least squares over the columns
    it does not zero, so every subset of columns is tried (four terms: 15 small solves)."""
    n = a.shape[1]
    best, best_error = torch.zeros(n, dtype=a.dtype), float((b * b).sum())
    for mask in range(1, 2**n):
        cols = [j for j in range(n) if mask >> j & 1]
        sol = torch.linalg.lstsq(a[:, cols], b.unsqueeze(1)).solution.squeeze(1)
        error = float(((a[:, cols] @ sol - b) ** 2).sum())
        if bool((sol >= 0).all()) and error < best_error:
            best, best_error = torch.zeros(n, dtype=a.dtype).index_copy(0, torch.tensor(cols), sol), error
    return best


def fit(samples: List[Sample], column: int = 3) -> Tuple[List[float], float]:
    """Coefficients (fixed, prefill, decode, context) minimising the squared relative error of the
    time in `column`, so short decode steps weigh as much as long prefills, and the mean relative error.
    None is negative: every term costs time. Unconstrained, a few steps stalled by a busy machine
    made the context term (or the fixed one) negative, which no step-time model can mean."""
    x, y = design(samples, column)
    coef = nonnegative_lstsq(x / y.unsqueeze(1), torch.ones_like(y))
    error = ((x @ coef - y).abs() / y).mean().item()
    return coef.tolist(), error


def router_fit(samples: List[Sample]) -> dict:
    """The whole steps as the normal equations a replica reports (`StepMeter.fit`), one step a sample."""
    x, y = design(samples, 4)
    return {"steps": float(len(samples)), "xtx": (x.T @ x).tolist(), "xty": (x.T @ y).tolist()}


def compare(
    preset: str, measured: StepTimeModel, learned: StepTimeModel, max_num_seqs: int, max_num_batched_tokens: int
) -> dict:
    """The preset, the measured steps and what the router learns, side by side."""
    models = {"preset": PRESETS[preset].step, "measured": measured, "router learns": learned}
    probes = {name: {k: m.step_seconds(*f) * 1e3 for k, m in models.items()} for name, f in PROBES.items()}
    capacity = {
        name: {k: capacity_rps(m, max_num_seqs, max_num_batched_tokens, *size) for k, m in models.items()}
        for name, size in REQUEST_SIZES.items()
    }
    print(f"\n{'step time (ms)':<40}" + "".join(f"{k:>15}" for k in models))
    for name, row in probes.items():
        print(f"{name:<40}" + "".join(f"{v:>15.2f}" for v in row.values()))
    print(
        f"\n{f'full replica (req/s): {max_num_seqs} seqs, {max_num_batched_tokens} tokens a step':<55}"
        + "".join(f"{k:>15}" for k in models)
    )
    for name, row in capacity.items():
        print(f"{name:<55}" + "".join(f"{v:>15.2f}" for v in row.values()))
    return {"probes_ms": probes, "capacity_rps": capacity, "models": {k: vars(m) for k, m in models.items()}}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m load_tests.calibrate_sim", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--config", type=Path, default=None, help="a HF config: a random-weight model of it instead of --model"
    )
    p.add_argument(
        "--tokenizer", default="smollm2-135m-instruct", help="with --config: a model name or tokenizer directory"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--compile", default="auto", help="the engine's compile setting (auto: its default path)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,8,24,64")
    p.add_argument("--prompt-lens", default="32,192")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument(
        "--passes", type=int, default=1, help="sweeps; only the last is fitted (the first records CUDA graphs)"
    )
    p.add_argument("--preset", default=None, help="compare with this preset, as the router's prior")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = str(
            build_model_dir(
                args.config,
                False,
                torch.device(args.device),
                Path(tmp) / "model",
                args.tokenizer,
                getattr(torch, dtype),
            )
            if args.config
            else args.model
        )
        engine = LLMEngine(
            EngineConfig(
                model=model,
                num_threads=args.threads,
                device=args.device,
                dtype=dtype,
                compile=args.compile,
                enable_prefix_caching=False,
                max_num_seqs=args.max_num_seqs,
                num_kv_blocks=args.num_kv_blocks,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
        )
        record_steps(engine, [1], [16], 4, args.seed)  # warm-up, not fitted
        print(f"engine ready in {time.perf_counter() - t0:.0f} s (forward: {engine.runner.forward.mode})", flush=True)
        for _ in range(args.passes):
            samples = record_steps(engine, ints(args.batches), ints(args.prompt_lens), args.max_tokens, args.seed)
    report: dict = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "model": str(args.config or args.model),
        "dtype": dtype,
        "forward_mode": engine.runner.forward.mode,
        "steps": len(samples),
    }
    for name, column in (("forward", 3), ("step", 4)):
        (fixed, prefill, decode, context), error = fit(samples, column)
        print(f"{name}: {len(samples)} steps fitted, mean relative error {error:.1%}")
        print(
            f"  StepTimeModel(fixed_s={fixed:.3g}, prefill_token_s={prefill:.3g}, decode_seq_s={decode:.3g}, "
            f"context_token_s={context:.3g})"
        )
        report[name] = {
            "fixed_s": fixed,
            "prefill_token_s": prefill,
            "decode_seq_s": decode,
            "context_token_s": context,
            "mean_relative_error": error,
        }
    report.update(report["forward"])  # the flat keys: what the CPU preset was fitted to
    if args.preset:
        step = report["step"]
        measured = StepTimeModel(
            step["fixed_s"], step["prefill_token_s"], step["decode_seq_s"], step["context_token_s"]
        )
        learned = learned_step(PRESETS[args.preset].step, router_fit(samples))
        report["compare"] = {
            "preset": args.preset,
            **compare(args.preset, measured, learned, args.max_num_seqs, args.max_num_batched_tokens),
        }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()

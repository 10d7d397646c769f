"""The engine's features on a CUDA device, in one call: `python -m load_tests.gpu_features`.

`load_tests.gpu_forward` checks the plain forward (parity, throughput, roofline); this checks what a
Serve replica adds on top of it, each against an independent reference, with the CUDA default
(`triton` attention, compiled forward replayed as CUDA graphs) and eager:
- async: AsyncLLMEngine (the replica's loop thread: the engine is built, its graphs recorded and
  replayed there) with concurrent streams of mixed lengths; tokens equal HF `generate` (float32);
- lora: three PEFT adapters (random A and B, different ranks and target modules) in one batch with the
  base; each row equals HF `generate` of the PEFT model merged (float32); then bf16 tokens/s of a
  batch on the base alone against the same batch spread over four adapters (1B-like model);
- structured: regex, choice, JSON schema and EBNF constraints beside unconstrained rows; each row
  equals HF `generate` under xgrammar's own logits processor (the same mask) (float32);
- int8: weight-only int8 against bf16 on the 1B-like model: tokens until the first difference and
  the decode step at batch 1 and 64.
Random-weight models from `load_tests/configs` (weights cannot be carried to a device machine); the
tiny (2-layer) variant for parity. `--device cpu` runs every part here (CPU backends, no graphs).
Prints tables and writes JSON after each section (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from batcher.engine_input import EngineInput
from load_tests.gpu_forward import (
    CONFIGS,
    build_model_dir,
    engine,
    first_difference,
    greedy_params,
    hf_greedy,
    hf_model,
    print_table,
    prompts,
    timed,
)

ADAPTERS = {
    "a": (1, 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "b": (2, 8, ["q_proj", "v_proj"]),
    "c": (3, 2, ["down_proj", "o_proj"]),
}
ITEM_SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["colour", "size"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "regex": {"regex": r"[A-Z][a-z]{2,8}, [0-9]{2}"},
    "choice": {"choice": ["Paris", "London", 'Rome "city"']},
    "json": {"json": ITEM_SCHEMA},
    "grammar": {"grammar": 'root ::= "yes" | "no" | "maybe: " [a-z] [a-z] [a-z]'},
}


def async_streams(path: Path, device: torch.device, backend: str, compile: str) -> Dict:
    """Concurrent streams through the replica's loop thread, against HF greedy one by one."""
    from batcher import AsyncLLMEngine, EngineConfig

    ps = prompts(12, seed=4)
    lengths = [4 + 3 * i for i in range(len(ps))]
    ref = hf_model(path, torch.float32, device)
    expected = [hf_greedy(ref, p, n) for p, n in zip(ps, lengths)]
    del ref
    e = AsyncLLMEngine(
        EngineConfig(
            model=str(path),
            device=device.type,
            dtype="float32",
            attention_backend=backend,
            compile=compile,
            num_kv_blocks=512,
            block_size=16,
        )
    )

    async def one(i: int) -> List[int]:
        await asyncio.sleep(0.002 * i)  # arrivals spread over the first steps: joins mid-batch
        return [t async for d in e.stream(EngineInput(ps[i], greedy_params(lengths[i]))) for t in d.token_ids]

    async def all_streams():
        return await asyncio.gather(*(one(i) for i in range(len(ps))))

    try:
        got = asyncio.run(all_streams())
        mode = e.engine.runner.forward.mode
    finally:
        e.shutdown()
    return {
        "backend": backend,
        "compile": compile,
        "forward_mode": mode,
        "streams": len(ps),
        "exact": got == expected,
        "tokens_until_first_difference": [first_difference(g, x) for g, x in zip(got, expected)],
    }


def make_adapters(path: Path, root: Path, device: torch.device, names=tuple(ADAPTERS)) -> Dict[str, str]:
    from peft import LoraConfig, get_peft_model

    out = {}
    for name in names:
        seed, rank, targets = ADAPTERS[name]
        torch.manual_seed(seed)
        model = get_peft_model(
            hf_model(path, torch.float32, device),
            LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False),
        )
        model.save_pretrained(str(root / name))
        out[name] = str(root / name)
    return out


def merged(path: Path, adapter: Optional[str], device: torch.device):
    from peft import PeftModel

    base = hf_model(path, torch.float32, device)
    return base if adapter is None else PeftModel.from_pretrained(base, adapter).merge_and_unload()


def lora_parity(path: Path, adapters: Dict[str, str], device: torch.device, backend: str, compile: str) -> Dict:
    ps, n = prompts(2, seed=5), 16
    names = [None, *adapters]
    expected = {}
    for name in names:
        model = merged(path, adapters.get(name), device)
        for i, p in enumerate(ps):
            expected[name, i] = hf_greedy(model, p, n)
        del model
    e = engine(
        path,
        device,
        "float32",
        backend,
        compile,
        num_kv_blocks=512,
        block_size=16,
        lora={"adapters": adapters, "max_loras": 4},
    )
    requests = {
        (name, i): e.make_request(EngineInput(p, greedy_params(n), lora_name=name))
        for name in names
        for i, p in enumerate(ps)
    }
    for r in requests.values():
        e.add(r)
    while e.has_unfinished():
        e.step()
    same = {
        f"{k[0] or 'base'}/{k[1]}": first_difference(r.seq.output_token_ids, expected[k]) for k, r in requests.items()
    }
    distinct = len({tuple(expected[name, 0]) for name in names})
    return {
        "backend": backend,
        "compile": compile,
        "forward_mode": e.runner.forward.mode,
        "rows": len(requests),
        "exact": all(v == n for v in same.values()),
        "adapters_change_output": distinct == len(names),
        "tokens_until_first_difference": same,
    }


def lora_throughput(
    path: Path, device: torch.device, dtype: str, backend: str, batch: int, new_tokens: int, root: Path
) -> List[Dict]:
    adapters = make_adapters(path, root, device)
    names = [None, *adapters]
    ps = prompts(batch, seed=6)
    e = engine(
        path,
        device,
        dtype,
        backend,
        "auto",
        max_num_seqs=batch,
        max_num_batched_tokens=2048,
        lora={"adapters": adapters, "max_loras": 4, "max_lora_rank": 8},
    )
    rows = []
    for label, pick in [
        ("base only", lambda i: None),
        ("4 models: base + 3 adapters, round robin", lambda i: names[i % 4]),
    ]:

        def run(count=batch, tokens=new_tokens, pick=pick):
            for i, p in enumerate(ps[:count]):
                e.add(e.make_request(EngineInput(p, greedy_params(tokens), lora_name=pick(i))))
            while e.has_unfinished():
                e.step()

        run(4, 4)  # warm: the adapters' graph, the adapters in their slots
        s = timed(run)
        rows.append(
            {
                "batch": label,
                "forward_mode": e.runner.forward.mode,
                "seconds": s,
                "tokens_per_s": batch * new_tokens / s,
            }
        )
    rows[1]["vs_base"] = rows[0]["seconds"] / rows[1]["seconds"]
    return rows


def structured_parity(path: Path, device: torch.device, backend: str, compile: str) -> Dict:
    from xgrammar.contrib.hf import LogitsProcessor

    from batcher.structured_outputs import StructuredOutputs

    e = engine(path, device, "float32", backend, compile, num_kv_blocks=512, block_size=16)
    specs = {k: StructuredOutputs(**v) for k, v in CONSTRAINTS.items()}
    p, plain, n = prompts(1, seed=7)[0], prompts(2, seed=8), 40
    outs = e.generate(
        [p] * len(specs) + plain,
        [greedy_params(n, ignore_eos=False, structured_outputs=s) for s in specs.values()]
        + [greedy_params(12)] * len(plain),
    )
    model = hf_model(path, torch.float32, device)
    rows = {}
    for (kind, spec), out in zip(specs.items(), outs):
        want = hf_greedy(
            model,
            p,
            n,
            logits_processor=[LogitsProcessor(e.builder.grammars.compile(spec))],
            eos_token_id=sorted(e.eos_token_ids),
        )
        rows[kind] = {"exact": out.token_ids == want, "finish": out.finish_reason, "text": out.text[:60]}
    rows["json"]["parses"] = is_item(outs[2].text)
    for i, out in enumerate(outs[len(specs) :]):
        rows[f"plain/{i}"] = {"exact": out.token_ids == hf_greedy(model, plain[i], 12)}
    return {
        "backend": backend,
        "compile": compile,
        "forward_mode": e.runner.forward.mode,
        "exact": all(r["exact"] for r in rows.values()),
        "rows": rows,
    }


def is_item(text: str) -> bool:
    """Whether `text` is JSON valid against ITEM_SCHEMA."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(ITEM_SCHEMA).is_valid(value)


def int8_compare(path: Path, device: torch.device, backend: str, batches: List[int]) -> List[Dict]:
    """Weight-only int8 against bf16: greedy tokens, then decode steps of `b` ~256-token sequences
    (one engine per format, sized for the largest batch; its graphs cover the smaller ones)."""
    ps, n = prompts(6, seed=9), 24
    outs, rows = {}, []
    for q in (None, "int8"):
        e = engine(
            path,
            device,
            "bfloat16",
            backend,
            "auto",
            block_size=16,
            quantization=q,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, max(batches)),
        )
        outs[q] = [o.token_ids for o in e.generate(ps, [greedy_params(n)] * len(ps))]
        model = e.runner.model  # int8 weights are buffers
        weight_mb = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 1e6
        for b in batches:
            long = [p[:8] * 32 for p in prompts(b, seed=10 + b)]
            e.generate(long, [greedy_params(1)] * b)  # prefill into the prefix cache, out of the timing
            before = (e.stats().steps, e.stats().forward_seconds)
            e.generate(long, [greedy_params(32)] * b)
            st = e.stats()
            rows.append(
                {
                    "check": f"decode step, {q or 'bf16'}, batch {b}",
                    "unit": "ms",
                    "weight_mb": round(weight_mb),
                    "value": round((st.forward_seconds - before[1]) / max(1, st.steps - before[0]) * 1e3, 3),
                }
            )
        del e, model
    rows.insert(
        0,
        {
            "check": "int8 tokens until the first difference from bf16 (of 24)",
            "value": [first_difference(a, b) for a, b in zip(outs["int8"], outs[None])],
        },
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", type=Path, default=CONFIGS / "llama-1b-like.json")
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct")
    ap.add_argument(
        "--sections",
        default="lora,structured,int8,async,compile_after_async",
        help="in this order; async last: after it, compiles in this thread fell back to eager on an H100",
    )
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/gpu_features.json"))
    a = ap.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    backend = "triton" if cuda else "reference"
    batch, new_tokens = a.batch or (64 if cuda else 4), a.new_tokens or (128 if cuda else 8)
    report: Dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny = build_model_dir(a.config, True, device, tmp / "tiny", a.tokenizer)
        big = build_model_dir(a.config, not cuda, device, tmp / "big", a.tokenizer)
        compiles = ["off", "auto"]
        for section in a.sections.split(","):
            t0 = time.perf_counter()
            try:
                if section == "async":
                    rows = [async_streams(tiny, device, backend, c) for c in compiles]
                elif section == "lora":
                    adapters = make_adapters(tiny, tmp / "adapters", device)
                    rows = [lora_parity(tiny, adapters, device, backend, c) for c in compiles]
                    report["lora_throughput"] = lora_throughput(
                        big, device, "bfloat16" if cuda else "float32", backend, batch, new_tokens, tmp / "big_adapters"
                    )
                    print_table(f"LoRA: {batch} prompts x {new_tokens} tokens", report["lora_throughput"])
                elif section == "structured":
                    rows = [structured_parity(tiny, device, backend, c) for c in compiles]
                elif section == "int8":
                    rows = int8_compare(big, device, backend, [1, 64] if cuda else [1, 2])
                elif section == "compile_after_async":  # a compile in this thread after the async section's
                    e = engine(tiny, device, "float32", backend, "auto", num_kv_blocks=64, block_size=16)
                    rows = [{"forward_mode": e.runner.forward.mode}]
                else:
                    raise ValueError(f"unknown section {section!r}")
                report[section] = rows
                print_table(section, rows)
            except Exception as exc:  # one broken part must not hide the others' figures
                report[f"{section}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"\n== {section}: FAILED {report[f'{section}_error']}")
            report.setdefault("section_seconds", {})[section] = round(time.perf_counter() - t0, 1)
            a.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()

"""The GPU forward in one call: `python -m load_tests.gpu_forward` on a machine with a CUDA device.

Run on an H100 on 2026-11-26 (figures and the command that ran it: docs/forward.md#cuda). On CPU,
`--device cpu --tiny` runs every part that is not CUDA-only.

A random-weight Llama-shaped model is built from a config kept in the repo (weights cannot be carried
to the device machine) and saved with the SmolLM2 tokenizer as a local model directory. Then:
1. parity: the engine's greedy tokens against HF `generate`, in float32 (exact expected) and bfloat16
   (tokens until the first difference reported), for each attention backend (reference; triton on CUDA)
   and compile off / auto;
2. throughput on one batch of prompts: the engine, HF static batching (`generate` on the padded
   batch), transformers' continuous batching (`model.generate_batch`);
3. decode step time against the roofline: (weight bytes + KV bytes read) / HBM bandwidth.
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

CONFIGS = Path(__file__).parent / "configs"
HBM_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "L4": 300.0}  # vendor figures, GB/s
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.3,
)


def build_model_dir(
    config_path: Path, tiny: bool, device: torch.device, out: Path, tokenizer: str, dtype: torch.dtype = torch.float32
) -> Path:
    """A random-weight model directory from a HF config (weights cannot be carried to a device),
    built and saved in `dtype` (bf16: half an 8B model's 32 GB in fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from batcher.model_files import load_tokenizer

    cfg = LlamaConfig(**{**json.loads(config_path.read_text()), **(TINY if tiny else {})})
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out)
    del model
    load_tokenizer(tokenizer).save_pretrained(out)
    return out


def prompts(n: int, seed: int = 0) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(100, 40000, (int(torch.randint(8, 120, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def hf_model(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_greedy(model, prompt: List[int], n: int, **kw) -> List[int]:
    """HF `generate`, greedy; EOS neither stops nor is suppressed unless `kw` names one."""
    ids = torch.tensor([prompt], device=model.device)
    kw.setdefault("eos_token_id", None)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw
    )
    return out[0, len(prompt) :].tolist()


def first_difference(got: List[int], want: List[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def engine(path: Path, device: torch.device, dtype: str, backend: str, compile: str, **kw):
    from batcher import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(model=str(path), device=device.type, dtype=dtype, attention_backend=backend, compile=compile, **kw)
    )


def greedy_params(n: int, **kw):
    """Greedy sampling of `n` tokens, EOS ignored unless `kw` says otherwise (more SamplingParams fields)."""
    from batcher import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, **({"ignore_eos": True} | kw))


def greedy(n: int, count: int):
    return [greedy_params(n)] * count


def parity(path: Path, device: torch.device, backends: List[str], compiles: List[str], dtypes: List[str]) -> List[Dict]:
    rows = []
    ps, n = prompts(6, seed=1), 24
    for dtype in dtypes:
        ref = hf_model(path, getattr(torch, dtype), device)
        expected = [hf_greedy(ref, p, n) for p in ps]
        del ref
        for backend in backends:
            for comp in compiles:
                row = {"dtype": dtype, "backend": backend, "compile": comp}
                try:
                    e = engine(path, device, dtype, backend, comp, num_kv_blocks=512, block_size=16)
                    got = [o.token_ids for o in e.generate(ps, greedy(n, len(ps)))]
                    same = [first_difference(g, x) for g, x in zip(got, expected)]
                    row.update(
                        exact=got == expected, tokens_until_first_difference=same, forward_mode=e.runner.forward.mode
                    )
                except Exception as exc:  # report and go on: one failing backend must not hide the others
                    row.update(error=f"{type(exc).__name__}: {exc}"[:300])
                rows.append(row)
    return rows


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def throughput(path: Path, device: torch.device, dtype: str, backend: str, batch: int, new_tokens: int) -> List[Dict]:
    ps = prompts(batch, seed=2)
    total = batch * new_tokens
    rows = []
    e = engine(path, device, dtype, backend, "auto", max_num_seqs=batch, max_num_batched_tokens=2048)
    e.generate(ps[:2], greedy(4, 2))  # warm
    s = timed(lambda: e.generate(ps, greedy(new_tokens, batch)))
    rows.append({"system": f"iterserve ({backend}, {e.runner.forward.mode})", "seconds": s, "tokens_per_s": total / s})
    e = None  # its KV cache goes before HF's model comes
    model = hf_model(path, getattr(torch, dtype), device)
    width = max(len(p) for p in ps)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
    run = lambda: model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    run()  # warm
    s = timed(run)
    rows.append({"system": "HF generate, static batch", "seconds": s, "tokens_per_s": total / s})
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        model.generate_batch(inputs=ps[:2], generation_config=gen)  # warm (graphs, kernels)
        s = timed(lambda: model.generate_batch(inputs=ps, generation_config=gen))
        rows.append(
            {"system": "transformers continuous batching (generate_batch)", "seconds": s, "tokens_per_s": total / s}
        )
    except Exception as exc:  # the API moves between transformers versions: report, don't stop
        rows.append(
            {
                "system": "transformers continuous batching (generate_batch)",
                "error": f"{type(exc).__name__}: {exc}"[:300],
            }
        )
    return rows


def roofline(
    path: Path, device: torch.device, dtype: str, backend: str, batches: List[int], hbm_gbps: float
) -> List[Dict]:
    """Decode step time of `b` sequences with ~context tokens each vs the bytes a step must read."""
    from batcher.model_files import kv_geometry

    rows = []
    context, steps = 256, 32
    for b in batches:
        e = engine(path, device, dtype, backend, "auto", max_num_seqs=b, max_num_batched_tokens=max(2048, b))
        ps = [p[:8] * 32 for p in prompts(b, seed=3)]  # 256-token prompts
        e.generate(ps, greedy(1, b))  # compiles and fills the prefix cache: prefill out of the timing
        before = (e.stats().steps, e.stats().forward_seconds)
        e.generate(ps, greedy(steps, b))
        st = e.stats()
        # One prefill step (prefix hit: only the last block recomputed) then decode steps.
        step_s = (st.forward_seconds - before[1]) / max(1, st.steps - before[0])
        cfg = e.runner.model.config
        weight_bytes = sum(p.numel() * p.element_size() for p in e.runner.model.parameters())
        layers, hkv, hd = kv_geometry(cfg)
        kv_bytes = b * (context + steps // 2) * layers * 2 * hkv * hd * torch.finfo(getattr(torch, dtype)).bits // 8
        bound = (weight_bytes + kv_bytes) / (hbm_gbps * 1e9) if hbm_gbps else float("nan")
        rows.append(
            {
                "batch": b,
                "step_ms": step_s * 1e3,
                "roofline_ms": bound * 1e3,
                "fraction_of_roofline": bound / step_s if step_s else float("nan"),
                "weight_mb": weight_bytes / 1e6,
                "kv_mb": kv_bytes / 1e6,
            }
        )
        del e
    return rows


def _hbm(device: torch.device, override: float) -> float:
    if override or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in HBM_GBPS.items() if k in name), 0.0)


def print_table(title: str, rows: List[Dict]) -> None:
    print(f"\n== {title}")
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))


def _run_section(
    section: str,
    report: Dict,
    path: Path,
    device: torch.device,
    dtype: str,
    backends: List[str],
    batch: int,
    new_tokens: int,
    hbm_override: float,
    parity_dtypes: List[str],
) -> None:
    if section == "parity":
        report["parity"] = parity(path, device, backends, ["off", "auto"], parity_dtypes)
        print_table("parity: engine vs HF generate (greedy)", report["parity"])
    elif section == "throughput":
        report["throughput"] = []
        for backend in backends:
            rows = throughput(path, device, dtype, backend, batch, new_tokens)
            report["throughput"] += rows[: None if backend == backends[-1] else 1]
        print_table(f"throughput: {batch} prompts x {new_tokens} new tokens, {dtype}", report["throughput"])
    elif section == "roofline":
        hbm = _hbm(device, hbm_override)
        batches = [1, 8, 64] if device.type == "cuda" else [1, 2]
        report["roofline"] = roofline(path, device, dtype, backends[-1], batches, hbm)
        print_table(f"decode step vs roofline (HBM {hbm or 'unknown'} GB/s)", report["roofline"])
    else:
        raise ValueError(f"unknown section {section!r}; known: parity, throughput, roofline")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", type=Path, default=CONFIGS / "llama-1b-like.json")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of the config's family (CPU check)")
    ap.add_argument("--dtype", default=None, help="throughput/roofline dtype (default bfloat16 on CUDA)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--hbm-gbps", type=float, default=0.0, help="override the device's HBM bandwidth")
    ap.add_argument(
        "--tokenizer",
        default="smollm2-135m-instruct",
        help="a model name or tokenizer directory (a device machine has no embedded model)",
    )
    ap.add_argument(
        "--sections",
        default="parity,throughput,roofline",
        help="which parts, in this order (the JSON is written after each)",
    )
    ap.add_argument("--backends", default=None, help="attention backends (default: reference, and triton on CUDA)")
    ap.add_argument("--parity-dtypes", default="float32,bfloat16")
    ap.add_argument("--out", type=Path, default=Path("results/gpu_forward.json"))
    a = ap.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    backends = a.backends.split(",") if a.backends else ["reference", "triton"] if cuda else ["reference"]
    batch, new_tokens = a.batch or (64 if cuda else 4), a.new_tokens or (128 if cuda else 8)
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "config": str(a.config),
        "tiny": a.tiny,
        "dtype": dtype,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model_dir(a.config, a.tiny, device, Path(tmp) / "model", a.tokenizer)
        for section in a.sections.split(","):
            t0 = time.perf_counter()
            try:
                _run_section(
                    section,
                    report,
                    path,
                    device,
                    dtype,
                    backends,
                    batch,
                    new_tokens,
                    a.hbm_gbps,
                    a.parity_dtypes.split(","),
                )
            except Exception as exc:  # one broken part must not hide the others' figures
                report[f"{section}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"\n== {section}: FAILED {report[f'{section}_error']}")
            report.setdefault("section_seconds", {})[section] = round(time.perf_counter() - t0, 1)
            a.out.write_text(json.dumps(report, indent=1))  # a run cut short keeps what it measured
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()

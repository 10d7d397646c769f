"""The quality cost of bf16 and weight-only int8 against float32, on the embedded model.

    python -m load_tests.forward_quality [--model smollm2-135m-instruct] [--json results/forward_quality.json]

For each of float32, bfloat16 and int8 (bf16 activations), loaded as the engine loads them
(batcher.model_loader.load_model), int8 twice: a tied lm_head runs in int8 for products of a few rows
(decode steps of up to 4 sequences) and on the bf16 embedding for more (batcher/quantization.py), so
"int8" forces the int8 head everywhere and "int8/bf16 head" the bf16 head everywhere:
- perplexity on a fixed public-domain text (load_tests/forward_quality.txt: Lincoln, Austen, Dickens,
  Melville, Darwin, Carroll), in windows of --window tokens, and the mean KL divergence from float32's
  next-token distribution over the same positions;
- greedy agreement with float32 on --prompts fixed chat prompts (the tokenizer's chat template),
  --max-tokens each, HF generate one prompt at a time: prompts whose whole output is identical, mean
  tokens before the first difference, and teacher-forced top-1 agreement (float32's output fed to the
  variant: share of positions where the variant's greedy choice is float32's token; no cascade after
  a first difference).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from batcher.model_files import EMBEDDED_MODEL
from batcher.model_loader import load_model
from batcher.quantization import Int8WeightLinear

TEXT = Path(__file__).with_name("forward_quality.txt")
VARIANTS = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8": (torch.bfloat16, "int8"),
    "int8/bf16 head": (torch.bfloat16, "int8"),
}
ALWAYS, NEVER = 1 << 30, 0  # Int8WeightLinear.max_packed_rows: int8 kernel for every product, or none
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers and explain why they are prime.",
    "Who wrote Romeo and Juliet?",
    "Give me three tips for sleeping better.",
    "What is 12 times 7?",
    "Tell me a joke about computers.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What causes the seasons on Earth?",
    "Name five fruits that are red.",
    "Write a short thank-you note to a teacher.",
    "What is the difference between weather and climate?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
    "Suggest a name for a pet goldfish.",
    "What does a CPU do?",
    "Summarise the story of Cinderella in three sentences.",
    "How many legs does a spider have?",
]


@torch.inference_mode()
def text_scores(models, ids, window):
    """Per variant: (perplexity, mean KL from fp32) over every next-token position of `ids`."""
    nll = {v: 0.0 for v in models}
    kl = {v: 0.0 for v in models}
    count = 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window + 1]])
        inputs, targets = chunk[:, :-1], chunk[0, 1:]
        ref = None
        for v, model in models.items():
            logprobs = torch.log_softmax(model(inputs).logits[0].float(), dim=-1)
            nll[v] += float(F.nll_loss(logprobs, targets, reduction="sum"))
            if ref is None:
                ref = logprobs
            kl[v] += float(F.kl_div(logprobs, ref, log_target=True, reduction="sum"))
        count += len(targets)
    return {v: (torch.exp(torch.tensor(nll[v] / count)).item(), kl[v] / count) for v in models}, count


@torch.inference_mode()
def greedy(model, prompt_ids, max_tokens):
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def teacher_forced_top1(model, prompt_ids, tokens):
    logits = model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1]
    return int((logits.argmax(dim=-1) == torch.tensor(tokens)).sum())


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--prompts", type=int, default=20, help=f"chat prompts, at most {len(CHATS)}")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    ap.add_argument("--json", default="results/forward_quality.json", help="where the figures go as JSON")
    args = ap.parse_args(argv)
    started = time.monotonic()
    models = {}
    for v, (dtype, quantization) in VARIANTS.items():
        models[v], tok = load_model(args.model, dtype, torch.device("cpu"), quantization=quantization)
        head = models[v].get_output_embeddings()
        if isinstance(head, Int8WeightLinear) and head._tied:
            head.max_packed_rows = ALWAYS if v == "int8" else NEVER
    text_ids = tok(TEXT.read_text())["input_ids"]
    scores, positions = text_scores(models, text_ids, args.window)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in CHATS[: args.prompts]
    ]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    reference = [greedy(models["fp32"], p, args.max_tokens) for p in prompt_ids]
    rows = {}
    for v, model in models.items():
        outs = reference if v == "fp32" else [greedy(model, p, args.max_tokens) for p in prompt_ids]
        top1 = sum(teacher_forced_top1(model, p, r) for p, r in zip(prompt_ids, reference))
        rows[v] = {
            "perplexity": scores[v][0],
            "kl_from_fp32": scores[v][1],
            "identical_outputs": sum(o == r for o, r in zip(outs, reference)),
            "mean_tokens_before_difference": sum(first_difference(o, r) for o, r in zip(outs, reference)) / len(outs),
            "teacher_forced_top1": top1 / sum(len(r) for r in reference),
        }
    n = len(prompt_ids)
    print(
        f"{args.model}: perplexity over {positions} tokens of forward_quality.txt; {n} chat prompts x "
        f"{args.max_tokens} greedy tokens against fp32"
    )
    print(
        f"{'':14} {'perplexity':>10} {'KL vs fp32':>11} {'identical':>10} {'tokens to 1st diff':>19} {'top-1 (forced)':>15}"
    )
    for v, r in rows.items():
        print(
            f"{v:14} {r['perplexity']:10.3f} {r['kl_from_fp32']:11.5f} {r['identical_outputs']:>5d}/{n:<4d}"
            f" {r['mean_tokens_before_difference']:19.1f} {r['teacher_forced_top1']:15.3f}"
        )
    out = {
        "model": args.model,
        "text_tokens": positions,
        "window": args.window,
        "prompts": n,
        "max_tokens": args.max_tokens,
        "variants": rows,
        "seconds": round(time.monotonic() - started, 1),
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()

"""Hugging Face `generate` as the correctness oracle for the engine's greedy output."""

from __future__ import annotations

import functools
import random
from typing import List

import torch

from batcher.model_loader import load_model


@functools.lru_cache(maxsize=None)
def reference_model(name: str):
    model, tokenizer = load_model(name, torch.float32, torch.device("cpu"), seed=0)
    return model, tokenizer


def hf_greedy(name: str, prompt_ids: List[int], max_new_tokens: int) -> List[int]:
    """Greedy tokens from HF generate, EOS neither stopping nor suppressed (the engine's ignore_eos)."""
    model, _ = reference_model(name)
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


def mixed_prompts(name: str, n_random: int = 4, seed: int = 0) -> List[List[int]]:
    """A few chat prompts plus random-token prompts of mixed lengths."""
    _, tok = reference_model(name)
    chats = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers and explain why they are prime.",
    ]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in chats
    ]
    ids = [tok(p)["input_ids"] for p in prompts]
    rng = random.Random(seed)
    ids += [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 90))] for _ in range(n_random)]
    return ids

"""Turns logits into tokens: batched argmax for greedy rows, per-request generators for seeded ones."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from batcher.outputs import TokenLogprob
from batcher.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0):
        self._rng = torch.Generator().manual_seed(seed)  # for requests without a seed of their own
        self._generators: Dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._rng
        g = self._generators.get(request_id)
        if g is None:
            g = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        return g

    def sample(self, logits: torch.Tensor, request_ids: List[str],
               params: List[SamplingParams]) -> Tuple[List[int], List[Optional[TokenLogprob]]]:
        """logits: (S, vocab) float on any device. Returns token ids and, where asked, logprobs."""
        logits = logits.cpu()
        tokens = logits.argmax(dim=-1)
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_one(logits[i], p, self._generator(request_ids[i], p))
        token_list = tokens.tolist()
        logprobs: List[Optional[TokenLogprob]] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            lp = torch.log_softmax(logits[wanted], dim=-1)
            for row, i in enumerate(wanted):
                k = params[i].logprobs
                top = torch.topk(lp[row], k) if k else None
                logprobs[i] = TokenLogprob(
                    token_id=token_list[i],
                    logprob=float(lp[row, token_list[i]]),
                    top_logprobs=dict(zip(top.indices.tolist(), top.values.tolist())) if top else {},
                )
        return token_list, logprobs

    @staticmethod
    def _sample_one(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))

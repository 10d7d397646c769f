"""Turns logits into tokens: penalties, biases, min_tokens and grammar masks as batched tensors over
the rows that ask for them, then batched argmax for greedy rows and per-request generators for seeded ones."""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from batcher.grammar import TokenMasks
from batcher.outputs import TokenLogprob
from batcher.sampling_params import SamplingParams
from batcher.sequence import Sequence


class Sampler:
    """Logprobs are of the model's raw logits (log_softmax before any penalty, bias, min_tokens mask
    or temperature), as vLLM returns by default: what the model thought, not what the request
    steered. Greedy and sampled choices are made on the processed logits."""

    def __init__(self, seed: int = 0, eos_token_ids: Iterable[int] = ()):
        self._rng = torch.Generator().manual_seed(seed)  # for requests without a seed of their own
        self._generators: Dict[str, Dict[int, torch.Generator]] = {}  # request id -> choice index -> its own
        self._eos_token_ids = sorted(eos_token_ids)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self._rng
        choices = self._generators.setdefault(seq.request_id, {})
        g = choices.get(seq.index)
        if g is None:
            g = choices[seq.index] = torch.Generator().manual_seed(choice_seed(seq.params.seed, seq.index))
        return g

    @torch.inference_mode()  # the runner's logits are inference tensors, processed in place
    def sample(
        self, logits: torch.Tensor, seqs: List[Sequence], masks: Optional[TokenMasks] = None
    ) -> Tuple[List[int], List[Optional[TokenLogprob]]]:
        """logits: (S, vocab) float on any device, one row per sequence in `seqs` (their token ids so
        far are the penalties' history); `masks`: the grammar masks of the constrained rows. Returns
        token ids and, where asked, logprobs."""
        params = [s.params for s in seqs]
        if masks is None and all(p.greedy and p.logprobs is None and not p.processes_logits for p in params):
            # Plain greedy: the argmax where the logits are (on a GPU, one copy of S ids, not S x vocab).
            return logits.argmax(dim=-1).tolist(), [None] * len(params)
        logits = logits.cpu()
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Raw logits are kept (one copy of the batch's) only when a row reports logprobs of them.
        processed = self.process_logits(logits, seqs, masks, in_place=not wanted)
        tokens = processed.argmax(dim=-1)
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_one(processed[i], p, self._generator(seqs[i]))
        token_list = tokens.tolist()
        logprobs: List[Optional[TokenLogprob]] = [None] * len(params)
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

    def process_logits(
        self, logits: torch.Tensor, seqs: List[Sequence], masks: Optional[TokenMasks] = None, in_place: bool = False
    ) -> torch.Tensor:
        """`logits` itself when no sequence asks for processing (no tensor is built); otherwise the
        logits with the asking rows processed (a new tensor, or `logits` itself when in_place), in vLLM's order: logit_bias, the min_tokens mask,
        repetition penalty, frequency and presence penalties, then the grammar's mask (last, so
        nothing it disallows comes back)."""
        masked = set(masks.rows) if masks is not None else set()
        rows = [i for i, s in enumerate(seqs) if s.params.processes_logits or i in masked]
        if not rows:
            return logits
        picked = [seqs[i] for i in rows]
        sub = logits[rows]  # a copy: the raw logits stay as they are for logprobs
        _add_logit_bias(sub, picked)
        _mask_stops(sub, picked, self._eos_token_ids)
        _repetition_penalty(sub, picked)
        _frequency_presence_penalties(sub, picked)
        if masks is not None:
            masks.apply(sub, rows)
        out = logits if in_place else logits.clone()
        out[torch.tensor(rows)] = sub
        return out

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


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed`: the seed itself for choice 0 (so n=1
    samples as before), a hash of both for the others (distinct streams; seed + index, as vLLM does,
    would give a request seeded s+1 the same first choice as this one's second)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")  # in [0, 2**64): manual_seed's range


# Each helper below works in place on `sub` (one row per sequence in `seqs`), only on the rows whose
# params ask for it, with one scatter or gather per batch: no Python loop over the vocabulary.


def _flat_ids(seqs: List[Sequence], which: List[int], ids_of) -> Tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of `ids_of(seq)` for rows `which`, as two flat long tensors."""
    lists = [ids_of(seqs[r]) for r in which]
    rows = torch.repeat_interleave(torch.tensor(which), torch.tensor([len(x) for x in lists]))
    return rows, torch.tensor([t for x in lists for t in x], dtype=torch.long)


def _add_logit_bias(sub: torch.Tensor, seqs: List[Sequence]) -> None:
    which = [r for r, s in enumerate(seqs) if s.params.logit_bias]
    if which:
        rows, ids = _flat_ids(seqs, which, lambda s: list(s.params.logit_bias))
        bias = torch.tensor([b for r in which for b in seqs[r].params.logit_bias.values()], dtype=sub.dtype)
        sub[rows, ids] += bias  # each (row, id) once: a dict's keys are distinct


def _mask_stops(sub: torch.Tensor, seqs: List[Sequence], eos_token_ids: List[int]) -> None:
    """Before min_tokens output tokens, no token that would stop the sequence: EOS (unless
    ignore_eos, which makes EOS an ordinary token) and stop_token_ids."""
    vocab = sub.shape[-1]

    def stops(s: Sequence) -> List[int]:
        ids = set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else set(eos_token_ids))
        return sorted(t for t in ids if 0 <= t < vocab)

    which = [r for r, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
    if which:
        rows, ids = _flat_ids(seqs, which, stops)
        sub[rows, ids] = float("-inf")


def _repetition_penalty(sub: torch.Tensor, seqs: List[Sequence]) -> None:
    which = [r for r, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if not which:
        return
    rows, ids = _flat_ids(seqs, which, lambda s: s.token_ids)  # prompt and output
    seen = torch.zeros_like(sub, dtype=torch.bool).index_put_((rows, ids), torch.tensor(True))
    penalty = torch.ones(sub.shape[0], 1, dtype=sub.dtype)
    penalty[which, 0] = torch.tensor([seqs[r].params.repetition_penalty for r in which], dtype=sub.dtype)
    sub.copy_(torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub))


def _frequency_presence_penalties(sub: torch.Tensor, seqs: List[Sequence]) -> None:
    """OpenAI's: logit -= frequency_penalty * count + presence_penalty * (count > 0), counting the
    output tokens only (two subtractions, as vLLM rounds them)."""
    which = [
        r
        for r, s in enumerate(seqs)
        if (s.params.frequency_penalty or s.params.presence_penalty) and s.num_output_tokens
    ]
    if not which:
        return
    rows, ids = _flat_ids(seqs, which, lambda s: s.output_token_ids)
    counts = torch.zeros_like(sub).index_put_((rows, ids), torch.ones(len(ids), dtype=sub.dtype), accumulate=True)
    freq = torch.tensor([s.params.frequency_penalty for s in seqs], dtype=sub.dtype).unsqueeze(1)
    pres = torch.tensor([s.params.presence_penalty for s in seqs], dtype=sub.dtype).unsqueeze(1)
    sub -= freq * counts
    sub -= pres * (counts > 0).to(sub.dtype)

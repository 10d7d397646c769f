"""Workloads of the load generator: lists of BenchRequest, seeded, so every system gets the same load.

- random:   prompts of random common words (about one token each), lengths uniform in
            [len * (1 - range), len * (1 + range)] like vllm's random dataset; or random token ids
            (`token_ids=True`, completions only: exact prompt lengths, no tokenizer needed);
- variance: the seeds' experiment: fixed prompt length, output lengths exponential (mean) capped at
            `cap`, EOS ignored (load_tests.workload's draws, so the offline benchmark's lengths);
- chats:    shared-prefix multi-turn chats: sessions over a few long system prompts, each turn sent
            after the previous answer, with it in the history;
- jsonl:    one request per line: {"prompt": ...} or {"messages": [...]}, optional "max_tokens" and
            "followups" (later user turns);
- trace:    a request trace's requests (cluster.request_traces), sent at the trace's times by the caller:
            token-id prompts (completions) that share exactly the prefixes the trace's block ids share.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import List, Optional, Tuple

from cluster.request_traces import RequestTrace, prompt_token_ids
from load_tests.bench_client import BenchRequest
from load_tests.workload import capped_lengths, exponential_draws, random_prompts

# Common English words: each is one token (with its leading space) in Llama/SmolLM2-style BPE vocabularies.
WORDS = (
    "the of and to in is was for on as with by he at from his an were are which this be or has had "
    "not but one all their there been if more when will would who so no she other its time may these "
    "two first any new after some could most over made only such years many those then them well "
    "great world state city long make way part used like work even back life good each high where "
    "through both game local group under found same year house water early small old place end"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def _prompt(api: str, text_or_ids):
    return {"prompt": text_or_ids} if api == "completions" else {"messages": [{"role": "user", "content": text_or_ids}]}


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    api: str = "chat",
    seed: int = 0,
    token_ids: bool = False,
    token_range: Tuple[int, int] = (17, 49152),
) -> List[BenchRequest]:
    """`num` requests with random prompts of ~input_len tokens and output_len tokens (EOS ignored)."""
    if token_ids and api != "completions":
        raise ValueError("token-id prompts need the completions API")
    rng = random.Random(f"random-{seed}")
    out = []
    for i in range(num):
        n_in, n_out = _lengths(rng, input_len, range_ratio), _lengths(rng, output_len, range_ratio)
        if token_ids:
            prompt = random_prompts(1, n_in, token_range, seed * 1_000_003 + i)[0]
        else:
            prompt = f"{i}: " + words(rng, max(1, n_in - 2))  # a distinct start: no shared prefixes
        out.append(BenchRequest(**_prompt(api, prompt), max_tokens=n_out, ignore_eos=True))
    return out


def variance_requests(
    num: int,
    input_len: int,
    mean_output: float,
    cap: int,
    api: str = "chat",
    seed: int = 0,
    token_ids: bool = False,
    token_range: Tuple[int, int] = (17, 49152),
) -> List[BenchRequest]:
    """The seeds' variance experiment: capped-exponential output lengths, EOS ignored."""
    lengths = capped_lengths(exponential_draws(num, mean_output, seed), cap)
    prompts = random_requests(num, input_len, 1, 0.0, api, seed, token_ids, token_range)
    return [
        BenchRequest(prompt=p.prompt, messages=p.messages, max_tokens=n, ignore_eos=True)
        for p, n in zip(prompts, lengths)
    ]


def shared_prefix_chats(
    num_sessions: int,
    num_prefixes: int = 4,
    prefix_len: int = 256,
    turns: int = 3,
    user_len: int = 32,
    max_tokens: int = 16,
    seed: int = 0,
) -> List[BenchRequest]:
    """Multi-turn chats whose system prompts are shared: session i uses prefix i % num_prefixes."""
    rng = random.Random(f"chats-{seed}")
    systems = [f"System prompt {k}. " + words(rng, prefix_len) for k in range(num_prefixes)]
    out = []
    for i in range(num_sessions):
        user = [f"User {i} turn {t}: " + words(rng, user_len) for t in range(turns)]
        messages = [{"role": "system", "content": systems[i % num_prefixes]}, {"role": "user", "content": user[0]}]
        out.append(BenchRequest(messages=messages, followups=tuple(user[1:]), max_tokens=max_tokens, ignore_eos=True))
    return out


def jsonl_requests(
    path: str, api: str = "chat", max_tokens: int = 128, num: Optional[int] = None, ignore_eos: bool = False
) -> List[BenchRequest]:
    """Requests from a JSONL file; a line's "max_tokens" overrides `max_tokens`."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if api == "chat" and "messages" not in row and "prompt" in row:
            row["messages"] = [{"role": "user", "content": row["prompt"]}]
        if ("messages" if api == "chat" else "prompt") not in row:
            raise ValueError(f"{path}:{n}: needs {'messages or prompt' if api == 'chat' else 'prompt'}")
        out.append(
            BenchRequest(
                prompt=row.get("prompt"),
                messages=row.get("messages"),
                followups=tuple(row.get("followups", ())),
                max_tokens=int(row.get("max_tokens", max_tokens)),
                ignore_eos=ignore_eos,
            )
        )
        if num is not None and len(out) >= num:
            break
    return out


class TraceRequests(Sequence):
    """A trace's requests as BenchRequests, each built when asked for (a long trace's prompts do not
    fit in memory together): token-id prompts from prompt_token_ids (completions API), max_tokens =
    the trace's output tokens (at least 1, at most `output_cap`), EOS ignored unless told otherwise."""

    def __init__(
        self,
        trace: RequestTrace,
        token_range: Tuple[int, int],
        token_scale: float = 1.0,
        output_cap: Optional[int] = None,
        ignore_eos: bool = True,
        seed: int = 0,
    ):
        self.trace, self.token_range, self.token_scale = trace, token_range, token_scale
        self.output_cap, self.ignore_eos, self.seed = output_cap, ignore_eos, seed

    def __len__(self) -> int:
        return len(self.trace)

    @property
    def total_turns(self) -> int:
        """One turn each (run_load reads this rather than build every prompt to count them)."""
        return len(self.trace)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        n_out = max(1, int(self.trace.output_tokens[i]))
        return BenchRequest(
            prompt=prompt_token_ids(self.trace, i, self.token_range, self.token_scale, self.seed),
            max_tokens=min(n_out, self.output_cap or n_out),
            ignore_eos=self.ignore_eos,
        )

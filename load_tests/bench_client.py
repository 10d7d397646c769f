"""The load generator's core: send requests to any OpenAI-compatible server and time every one.

    records, duration = (r := await run_load(Target(url), requests, arrivals=offsets)).records, r.duration_s
    summary = bench_metrics.summarize(records, duration)

What is timed (streaming): TTFT = the first chunk that carries tokens (a role-only chunk, as
`transformers serve` sends at once, is not one); ITL = the gaps between later text chunks (a
server that merges tokens into one chunk shows fewer, longer gaps, as in `vllm bench serve`); e2e =
until the stream ends. Token counts come from the response's `usage` (asked for with
`stream_options.include_usage`); a server that sends none gets its token chunks counted instead
(`tokens_from_usage` False). A request counts as failed with its HTTP status (0: no response) and the
server's message, or with status 200 and an error when the stream broke off or carried an error event.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union


@dataclass(frozen=True)
class BenchRequest:
    """One unit of load. Completions take `prompt` (text or token ids); chat takes `messages` (or a text
    `prompt` as one user turn), and
    `followups` make it a multi-turn chat: each later user turn is sent after the previous answer
    arrives, with that answer in the history (one record per turn)."""

    prompt: Union[str, List[int], None] = None
    messages: Optional[List[dict]] = None
    followups: Tuple[str, ...] = ()
    max_tokens: int = 16
    ignore_eos: bool = True

    @property
    def num_turns(self) -> int:
        return 1 + len(self.followups)


@dataclass
class Target:
    """Where and how requests go. `ignore_eos_as`: 'field' sends `ignore_eos` (vLLM, iterserve);
    'generation_config' sends transformers serve's `generation_config` with EOS disabled."""

    base_url: str
    api: str = "chat"  # or "completions"
    model: Optional[str] = None  # None: the first of GET /v1/models
    stream: bool = True
    ignore_eos_as: str = "field"
    temperature: float = 0.0
    extra_body: Dict = field(default_factory=dict)
    headers: Dict[str, str] = field(default_factory=dict)
    record_headers: Tuple[str, ...] = ()  # response headers kept in each record (e.g. x-iterserve-replica)

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


@dataclass
class BenchRecord:
    """What happened to one request (one turn of a chat). Times in seconds; start_s from the run's start."""

    index: int  # position of its BenchRequest in the workload
    turn: int = 0
    start_s: float = 0.0
    status: int = 0  # HTTP status; 0 when no response came (connection error, timeout)
    error: str = ""
    ttft_s: Optional[float] = None
    itl_s: List[float] = field(default_factory=list)
    e2e_s: Optional[float] = None
    prompt_tokens: Optional[int] = None
    output_tokens: int = 0
    cached_tokens: Optional[int] = None
    tokens_from_usage: bool = False
    finish_reason: Optional[str] = None
    headers: Dict[str, str] = field(default_factory=dict)
    output_text: Optional[str] = None  # the answer (benchmarks compare greedy answers across systems)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def tpot_s(self) -> Optional[float]:
        """Time per output token after the first: (e2e - TTFT) / (output tokens - 1)."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LoadResult:
    records: List[BenchRecord]
    duration_s: float  # from the first send to the last answer


def request_body(target: Target, model: str, messages_or_prompt, max_tokens: int, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": target.temperature, "stream": target.stream}
    body["messages" if target.api == "chat" else "prompt"] = messages_or_prompt
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos and target.ignore_eos_as == "field":
        body["ignore_eos"] = True
    elif ignore_eos and target.ignore_eos_as == "generation_config":
        body["generation_config"] = json.dumps({"eos_token_id": -1, "do_sample": target.temperature > 0})
    return {**body, **target.extra_body}


def _chunk_text(event: dict, api: str) -> Optional[str]:
    """The text of a chunk that carries tokens ('' when they decode to nothing yet); None for a chunk
    that carries none: usage only, finish only, or a chat role announcement without content."""
    choices = event.get("choices") or []
    if not choices:
        return None
    if api != "chat":
        return choices[0].get("text")
    delta = choices[0].get("delta") or {}
    content = delta.get("content")
    return content if content or (content is not None and "role" not in delta) else None


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error") or json.loads(raw).get("detail") or raw.decode()
    except (ValueError, AttributeError):
        return raw.decode(errors="replace")[:500]
    return (err.get("message") if isinstance(err, dict) else str(err))[:500]


async def send_one(
    client, target: Target, model: str, payload, max_tokens: int, ignore_eos: bool, record: BenchRecord, t_run0: float
) -> str:
    """Sends one request, fills `record`, returns the answer's text."""
    url = f"{target.root}/v1/{'chat/completions' if target.api == 'chat' else 'completions'}"
    body = request_body(target, model, payload, max_tokens, ignore_eos)
    t0 = t_run0 + record.start_s
    text: List[str] = []
    usage = None
    async with client.stream("POST", url, json=body, headers=target.headers) as r:
        record.status = r.status_code
        record.headers = {h: r.headers[h] for h in target.record_headers if h in r.headers}
        if r.status_code != 200:
            record.error = _error_message(await r.aread())
            record.e2e_s = time.perf_counter() - t0
            return ""
        if not target.stream:
            data = json.loads(await r.aread())
            record.e2e_s = record.ttft_s = time.perf_counter() - t0
            choice = data["choices"][0]
            text.append(choice["message"]["content"] if target.api == "chat" else choice["text"])
            record.finish_reason, usage = choice.get("finish_reason"), data.get("usage")
        else:
            last, chunks, done = t0, 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = _error_message(data.encode())
                    break
                usage = event.get("usage") or usage
                piece = _chunk_text(event, target.api)
                choices = event.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    record.finish_reason = choices[0]["finish_reason"]
                if piece is None:
                    continue
                now = time.perf_counter()
                if record.ttft_s is None:
                    record.ttft_s = now - t0
                else:
                    record.itl_s.append(now - last)
                last, chunks = now, chunks + 1
                text.append(piece)
            record.e2e_s = time.perf_counter() - t0
            record.output_tokens = chunks
            if not done and not record.error and record.finish_reason is None:
                record.error = "stream ended without [DONE] or a finish_reason"
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens", record.output_tokens)
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        record.tokens_from_usage = True
    return "".join(text)


def think_times(think_s: float, seed: int, index: int, turns: int) -> List[float]:
    """Seconds chat `index`'s user thinks before each of its turns (0 before the first): exponential,
    mean `think_s`, seeded per chat, so every router of a benchmark meets the same users."""
    rng = random.Random(f"think:{seed}:{index}")
    return [0.0] + [rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0 for _ in range(turns - 1)]


async def _session(
    client,
    target: Target,
    model: str,
    index: int,
    req: BenchRequest,
    timeout_s: float,
    t_run0: float,
    records: List[BenchRecord],
    on_done,
    think: Sequence[float] = (),
) -> None:
    """All turns of one BenchRequest, in order, each `think[turn]` seconds after the last answer;
    a failed turn ends the chat."""
    history = list(req.messages or ([{"role": "user", "content": req.prompt}] if isinstance(req.prompt, str) else []))
    for turn in range(req.num_turns):
        if turn:
            history.append({"role": "user", "content": req.followups[turn - 1]})
            if turn < len(think) and think[turn] > 0:
                await asyncio.sleep(think[turn])
        record = BenchRecord(index=index, turn=turn, start_s=time.perf_counter() - t_run0)
        records.append(record)
        payload = history if target.api == "chat" else req.prompt
        try:
            answer = await asyncio.wait_for(
                send_one(client, target, model, payload, req.max_tokens, req.ignore_eos, record, t_run0), timeout_s
            )
            record.output_text = answer
        except asyncio.TimeoutError:
            record.error = f"timeout after {timeout_s:g} s"
        except Exception as e:  # connection refused or reset, malformed stream: a failure, not a crash
            record.error = f"{type(e).__name__}: {e}"[:500]
        if record.e2e_s is None:
            record.e2e_s = time.perf_counter() - t_run0 - record.start_s
        on_done()
        if not record.ok:
            return
        history.append({"role": "assistant", "content": answer})


async def resolve_model(client, target: Target) -> str:
    if target.model:
        return target.model
    r = await client.get(f"{target.root}/v1/models", headers=target.headers)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_load(
    target: Target,
    requests: Sequence[BenchRequest],
    arrivals: Optional[Sequence[float]] = None,
    max_concurrency: Optional[int] = None,
    duration_s: Optional[float] = None,
    timeout_s: float = 600.0,
    progress: bool = False,
    client=None,
    think_s: float = 0.0,
    seed: int = 0,
) -> LoadResult:
    """Sends `requests` (request i at `arrivals[i]` seconds from the start; None: all at once), at most
    `max_concurrency` in flight (chats hold their slot for all their turns), none started after
    `duration_s`; each request gets `timeout_s`. A chat's user thinks a while before each later turn
    (`think_s`: the mean, exponential, seeded by `seed`; 0: sent as the last answer ends). Returns
    every sent request's record, in send order."""
    import httpx

    if arrivals is not None and len(arrivals) < len(requests):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    own = client is None
    if own:
        conns = max_concurrency or len(requests)
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=conns + 8, max_keepalive_connections=conns + 8),
        )
    # A lazy sequence (a trace's requests) tells its count: summing would build every prompt first.
    turns = getattr(requests, "total_turns", None)
    bar = _progress(turns if turns is not None else sum(r.num_turns for r in requests), progress)
    try:
        model = await resolve_model(client, target)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        records: List[BenchRecord] = []

        async def one(i: int, req: BenchRequest) -> None:
            think = think_times(think_s, seed, i, req.num_turns)
            if gate is None:
                return await _session(client, target, model, i, req, timeout_s, t0, records, bar.update, think)
            async with gate:
                await _session(client, target, model, i, req, timeout_s, t0, records, bar.update, think)

        t0 = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            at = arrivals[i] if arrivals is not None else 0.0
            if duration_s is not None and at >= duration_s:
                break
            wait = t0 + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                break
            tasks.append(asyncio.create_task(one(i, req)))
        await asyncio.gather(*tasks)
        return LoadResult(sorted(records, key=lambda r: (r.start_s, r.index, r.turn)), time.perf_counter() - t0)
    finally:
        bar.close()
        if own:
            await client.aclose()


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="req", dynamic_ncols=True, leave=False)

"""The soak's mixed traffic: streams, non-streamed requests, client disconnects and bad requests at
Poisson arrivals, each ending in one outcome.

Outcomes: `ok` (answered in full: a finish_reason, and [DONE] when streamed), `disconnected` (the
client left mid-stream on purpose after its first chunks), `expected_4xx` (a bad request refused with
a 4xx and an error body), `error` (anything else: a 5xx, an error event, a broken stream, a refused
connection; unexpected), `lost` (no answer within the request timeout, or still open when the run's
drain ended).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import httpx

from load_tests.arrivals import arrival_offsets
from load_tests.bench_client import BenchRecord, Target, resolve_model, send_one

KINDS = ("stream", "plain", "disconnect", "bad")
OUTCOMES = ("ok", "disconnected", "expected_4xx", "error", "lost")
DEFAULT_MIX = {"stream": 0.5, "plain": 0.25, "disconnect": 0.15, "bad": 0.1}
OUTPUT_TOKENS = 32  # streams and plain requests alike (EOS ignored), so their latencies compare over time
DISCONNECT_AFTER_EVENTS = 3


@dataclass
class SoakRecord:
    kind: str
    start_s: float
    outcome: str = "lost"
    status: int = 0
    error: str = ""
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None


def bad_requests(model: str) -> List[dict]:
    """Requests the server must refuse with a 4xx: (path, json body) or (path, raw bytes)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return [
        {"path": "completions", "json": {"model": model, "prompt": "hi", "temperature": -1}},
        {"path": "completions", "json": {"model": model, "prompt": "hi", "max_tokens": 100_000}},
        {"path": "chat/completions", "json": {"model": model, "messages": []}},
        {"path": "chat/completions", "json": {**chat, "no_such_field": 1}},
        {"path": "chat/completions", "json": {**chat, "model": "no-such-model"}},
        {"path": "chat/completions", "json": {**chat, "n": 9}},
        {"path": "completions", "raw": b'{"prompt": "unterminated'},
    ]


def user_prompt(i: int, rng: random.Random) -> str:
    topics = ("rivers", "bridges", "tea", "owls", "clocks", "maps", "salt", "glass")
    return f"Request {i}: write a few sentences about {rng.choice(topics)} and {rng.choice(topics)}."


class SoakClient:
    """Sends one request of a kind and classifies what came back."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, timeout_s: float):
        self.client, self.model, self.timeout_s = client, model, timeout_s
        self.stream_target = Target(base_url, api="chat", model=model, stream=True)
        self.plain_target = Target(base_url, api="chat", model=model, stream=False)
        self.root = self.stream_target.root
        self.bad = bad_requests(model)

    async def send(self, rec: SoakRecord, i: int, rng: random.Random, t0: float) -> None:
        """Fills `rec` (its kind and start set by the caller)."""
        try:
            await asyncio.wait_for(self._send(rec.kind, i, rng, t0, rec), self.timeout_s)
        except asyncio.TimeoutError:
            rec.outcome, rec.error = "lost", f"no answer within {self.timeout_s:g} s"
        except Exception as e:  # connection refused or reset, malformed answer: unexpected
            rec.outcome, rec.error = "error", f"{type(e).__name__}: {e}"[:300]
        if rec.e2e_s is None:
            rec.e2e_s = time.perf_counter() - t0 - rec.start_s

    async def _send(self, kind: str, i: int, rng: random.Random, t0: float, rec: SoakRecord) -> None:
        messages = [{"role": "user", "content": user_prompt(i, rng)}]
        if kind in ("stream", "plain"):
            target = self.stream_target if kind == "stream" else self.plain_target
            r = BenchRecord(index=i, start_s=rec.start_s)
            await send_one(self.client, target, self.model, messages, OUTPUT_TOKENS, True, r, t0)
            rec.status, rec.error, rec.ttft_s, rec.e2e_s = r.status, r.error, r.ttft_s, r.e2e_s
            complete = r.ok and r.finish_reason is not None and r.output_tokens == OUTPUT_TOKENS
            rec.outcome = "ok" if complete else "error"
            if r.ok and not complete:
                rec.error = f"incomplete answer: finish_reason {r.finish_reason}, {r.output_tokens} tokens"
        elif kind == "disconnect":
            await self._disconnect(messages, rec)
        else:
            await self._bad(self.bad[i % len(self.bad)], rec)

    async def _disconnect(self, messages: List[dict], rec: SoakRecord) -> None:
        """Opens a long stream and leaves after a few chunks (the server must abort and free it)."""
        body = {"model": self.model, "messages": messages, "max_tokens": 512, "ignore_eos": True, "stream": True}
        events = 0
        async with self.client.stream("POST", f"{self.root}/v1/chat/completions", json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.outcome, rec.error = "error", (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if '"error"' in line:
                    rec.outcome, rec.error = "error", line[:300]
                    return
                events += 1
                if events == DISCONNECT_AFTER_EVENTS:
                    rec.outcome = "disconnected"  # leaving the block closes the connection mid-stream
                    return
        rec.outcome, rec.error = "error", f"stream ended after {events} events, before the client left"

    async def _bad(self, bad: dict, rec: SoakRecord) -> None:
        url = f"{self.root}/v1/{bad['path']}"
        if "raw" in bad:
            r = await self.client.post(url, content=bad["raw"], headers={"content-type": "application/json"})
        else:
            r = await self.client.post(url, json=bad["json"])
        rec.status = r.status_code
        try:
            has_body = "message" in r.json()["error"]
        except (ValueError, KeyError, TypeError):
            has_body = False
        if 400 <= r.status_code < 500 and has_body:
            rec.outcome = "expected_4xx"
        else:
            rec.outcome, rec.error = "error", f"bad request {bad.get('json', bad.get('raw'))!r} got {r.status_code}"


def pick_kind(rng: random.Random, mix: Dict[str, float]) -> str:
    return rng.choices(list(mix), weights=list(mix.values()))[0]


async def run_traffic(
    base_url: str,
    duration_s: float,
    rate: float,
    mix: Dict[str, float] = DEFAULT_MIX,
    seed: int = 0,
    timeout_s: float = 120.0,
    drain_s: float = 180.0,
    model: Optional[str] = None,
) -> List[SoakRecord]:
    """Sends Poisson arrivals at `rate` for `duration_s`, then waits up to `drain_s` for the last
    answers. Every sent request comes back as one record; any still open after the drain is `lost`."""
    rng = random.Random(f"soak-{seed}")
    offsets = arrival_offsets(int(rate * duration_s * 2) + 16, rate, seed=seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:
        model = model or await resolve_model(client, Target(base_url))
        soak = SoakClient(client, base_url, model, timeout_s)
        t0 = time.perf_counter()
        tasks: List[asyncio.Task] = []
        records: List[SoakRecord] = []
        for i, at in enumerate(offsets):
            if at >= duration_s:
                break
            wait = t0 + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            records.append(SoakRecord(kind=pick_kind(rng, mix), start_s=time.perf_counter() - t0))
            tasks.append(asyncio.create_task(soak.send(records[-1], i, random.Random(f"{seed}-{i}"), t0)))
        _, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for task in pending:  # its record stays `lost`
            task.cancel()
        for rec, task in zip(records, tasks):
            if task in pending:
                rec.error = f"still open {drain_s:g} s after the traffic stopped"
        return records

"""Locust load test for any OpenAI-compatible server, with the load generator's TTFT / ITL / TPOT.

    locust -f load_tests/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 2m \
        --workload variance --cap 128

Each simulated user sends the workload's requests (load_tests.bench_workloads, same seeds and options
as `python -m load_tests.bench`) one after another, streaming. Locust's own row for the POST times
only the response headers of a stream, so every answer also fires custom events that Locust aggregates
with percentiles like any request: `TTFT` (first chunk with tokens), `ITL` (each later chunk gap),
`TPOT` ((e2e - TTFT) / (output tokens - 1), tokens from `usage`) and `E2E` (until the stream ends).
A failed request is reported on the POST row with its status.
"""

from __future__ import annotations

import itertools
import json
import time

from locust import HttpUser, events, task

from load_tests import bench_workloads as wl
from load_tests.bench_client import Target, _chunk_text, _error_message, request_body


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--api", choices=("chat", "completions"), default="chat")
    parser.add_argument("--model", default="", help="default: the first of GET /v1/models")
    parser.add_argument("--workload", choices=("random", "variance", "chats"), default="random")
    parser.add_argument("--num-requests", type=int, default=256, help="workload size (users cycle through it)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--mean-output", type=float, default=32.0)
    parser.add_argument("--cap", type=int, default=128)
    parser.add_argument("--ignore-eos-as", choices=("field", "generation_config", "none"), default="field")
    parser.add_argument("--bench-seed", type=int, default=0)


def _workload(o):
    if o.workload == "variance":
        return wl.variance_requests(o.num_requests, o.input_len, o.mean_output, o.cap, o.api, o.bench_seed)
    if o.workload == "chats":
        return wl.shared_prefix_chats(o.num_requests, max_tokens=o.output_len, seed=o.bench_seed)
    return wl.random_requests(o.num_requests, o.input_len, o.output_len, 0.0, o.api, o.bench_seed)


_shared = {}  # the workload and a counter shared by every user of this process


@events.test_start.add_listener
def _build(environment, **_) -> None:
    _shared["requests"] = _workload(environment.parsed_options)
    _shared["next"] = itertools.count()


class OpenAIUser(HttpUser):
    def on_start(self) -> None:
        o = self.environment.parsed_options
        model = o.model
        if not model:
            model = self.client.get("/v1/models", name="/v1/models").json()["data"][0]["id"]
        self.target = Target(self.host, api=o.api, model=model, ignore_eos_as=o.ignore_eos_as)
        self.path = "/v1/chat/completions" if o.api == "chat" else "/v1/completions"

    def _fire(self, kind: str, seconds: float, length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=self.path,
            response_time=seconds * 1000.0,
            response_length=length,
            exception=None,
            context={},
        )

    @task
    def generate(self) -> None:
        reqs = _shared["requests"]
        req = reqs[next(_shared["next"]) % len(reqs)]
        history = list(req.messages or [{"role": "user", "content": req.prompt}])
        for turn in range(req.num_turns):
            if turn:
                history.append({"role": "user", "content": req.followups[turn - 1]})
            answer = self._one(history if self.target.api == "chat" else req.prompt, req)
            if answer is None:
                return
            history.append({"role": "assistant", "content": answer})

    def _one(self, payload, req):
        body = request_body(
            self.target,
            self.target.model,
            payload,
            req.max_tokens,
            req.ignore_eos and self.target.ignore_eos_as != "none",
        )
        t0 = time.perf_counter()
        ttft, last, chunks, usage, text = None, t0, 0, None, []
        with self.client.post(self.path, json=body, stream=True, catch_response=True, name=self.path) as r:
            if r.status_code != 200:
                r.failure(f"status {r.status_code}: {_error_message(r.content)}")
                return None
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    r.failure(f"stream error: {_error_message(line[5:].encode())}")
                    return None
                usage = event.get("usage") or usage
                piece = _chunk_text(event, self.target.api)
                if piece is None:
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                    self._fire("TTFT", ttft)
                else:
                    self._fire("ITL", now - last)
                last, chunks = now, chunks + 1
                text.append(piece)
            e2e = time.perf_counter() - t0
            tokens = usage["completion_tokens"] if usage else chunks
            if ttft is not None and tokens > 1:
                self._fire("TPOT", (e2e - ttft) / (tokens - 1), tokens)
            self._fire("E2E", e2e, tokens)
            r.success()
        return "".join(text)

"""Observability on real Serve: Prometheus metrics scraped from Ray's metrics agent, and the ingress's
one JSON log line per request read from its Serve log file.

A dedicated app (one tiny-llama replica, a 24-block KV cache) gets a known workload, so the scraped
counters must equal what the clients were told and what the engine counted, exactly.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import time

import httpx
import pytest
from conftest import tiny_config
from prometheus_client.parser import text_string_to_metric_families

from deployments import metrics

APP = "obs"
KV_BLOCKS = 24  # 192 tokens: six concurrent 60-token streams cannot all fit, so some are preempted
SYSTEM = "You are a terse assistant. Answer every question with as few words as you possibly can."
SECRET_PROMPT = "the violet walrus recites sonnets at midnight"  # must never reach a log
API_KEY = "sk-obs-test-key-never-logged"


@pytest.fixture(scope="module")
def obs(serve_cluster):
    config = tiny_config()
    config["engine"]["num_kv_blocks"] = KV_BLOCKS
    url = serve_cluster.deploy(APP, config)
    client = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})
    try:
        yield _run_workload(client)
    finally:
        client.close()
        serve_cluster.delete(APP)


def _chat(client, **extra):
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": SECRET_PROMPT}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return client.post("/v1/chat/completions", json=body)


def _stream(client, max_tokens: int):
    body = {
        "prompt": f"{SECRET_PROMPT}, again and again",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return r.headers, events


def _run_workload(client) -> dict:
    """Known traffic; returns what the clients saw."""
    seen = {"ok": [], "errors": [], "timing": {}}  # ok: (id, stream, usage, replica, text); timing: id -> header
    for _ in range(2):  # the same chat twice: the second finds its prompt's full blocks cached
        r = _chat(client)
        assert r.status_code == 200, r.text
        b = r.json()
        seen["ok"].append(
            (b["id"], False, b["usage"], r.headers["X-Iterserve-Replica"], b["choices"][0]["message"]["content"])
        )
        seen["timing"][b["id"]] = r.headers["Server-Timing"]
    r = client.post("/v1/completions", json={"prompt": "One token only", "max_tokens": 1, "ignore_eos": True})
    assert r.status_code == 200, r.text
    b = r.json()
    seen["ok"].append((b["id"], False, b["usage"], r.headers["X-Iterserve-Replica"], b["choices"][0]["text"]))
    seen["timing"][b["id"]] = r.headers["Server-Timing"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for headers, events in pool.map(lambda _: _stream(client, 60), range(6)):
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            seen["ok"].append((events[0]["id"], True, events[-1]["usage"], headers["X-Iterserve-Replica"], text))
            seen["timing"][events[0]["id"]] = headers["Server-Timing"]
    for bad in ({"model": "no-such-model"}, {"n": 0}, {"max_tokens": 5000}):
        r = _chat(client, **bad)
        seen["errors"].append((r.status_code, r.json()["error"]["type"]))
    r = client.post("/v1/completions", json={"prompt": "x" * 80_000})  # over the body limit: 413 before parsing
    seen["errors"].append((r.status_code, r.json()["error"]["type"]))
    assert seen["errors"] == [
        (404, "invalid_request_error"),
        (400, "invalid_request_error"),
        (400, "invalid_request_error"),
        (413, "invalid_request_error"),
    ]
    seen["replicas"] = {ok[3] for ok in seen["ok"]}
    return seen


def _scrape(port: int) -> list:
    """(name, labels, value) of every iterserve sample of app APP on the node's metrics endpoint."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("ray_iterserve_") and s.labels.get("application") == APP
    ]


def _total(samples, name, **labels) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items()))


def test_metrics_scraped_after_requests(serve_cluster, obs):
    from ray import serve

    ok = obs["ok"]
    [replica] = obs["replicas"]
    stats = serve.get_deployment_handle("LLMServer", app_name=APP).stats.remote().result()
    prompt_tokens = sum(u["prompt_tokens"] for _, _, u, _, _ in ok)
    output_tokens = sum(u["completion_tokens"] for _, _, u, _, _ in ok)
    assert output_tokens == 2 * 5 + 1 + 6 * 60
    assert stats["prompt_tokens"] == prompt_tokens and stats["generated_tokens"] == output_tokens
    assert stats["prefix_cache_hits"] > 0 and stats["preemptions"] > 0
    expected = {  # (series, labels) -> value, once the replica's refresh and Ray's export caught up
        ("ray_iterserve_requests_total", (("finish_reason", "length"),)): len(ok),
        ("ray_iterserve_time_to_first_token_seconds_count", ()): len(ok),
        ("ray_iterserve_e2e_request_latency_seconds_count", ()): len(ok),
        ("ray_iterserve_time_per_output_token_seconds_count", ()): len(ok) - 1,  # not the 1-token request
        ("ray_iterserve_prompt_tokens_total", ()): prompt_tokens,
        ("ray_iterserve_generation_tokens_total", ()): output_tokens,
        ("ray_iterserve_prefix_cache_hit_tokens_total", ()): stats["prefix_cache_hits"],
        ("ray_iterserve_prefix_cache_query_tokens_total", ()): stats["prefix_cache_queries"],
        ("ray_iterserve_preemptions_total", ()): stats["preemptions"],
        ("ray_iterserve_num_requests_waiting", ()): 0,
        ("ray_iterserve_num_requests_running", ()): 0,
        ("ray_iterserve_kv_cache_usage_ratio", ()): 0,
        ("ray_iterserve_kv_blocks_free", ()): KV_BLOCKS,  # every block back
        ("ray_iterserve_errors_total", (("error_type", "invalid_request_error"), ("status_code", "404"))): 1,
        ("ray_iterserve_errors_total", (("error_type", "invalid_request_error"), ("status_code", "400"))): 2,
        ("ray_iterserve_errors_total", (("error_type", "invalid_request_error"), ("status_code", "413"))): 1,
    }
    deadline, got = time.monotonic() + 60, {}  # Ray exports every few seconds; the deadline is against a hang
    while True:
        samples = _scrape(serve_cluster.metrics_port)
        got = {key: _total(samples, key[0], **dict(key[1])) for key in expected}
        names = {n for n, _, _ in samples}
        if (got == expected and metrics.exported_names() <= names) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert got == expected
    assert metrics.exported_names() <= names, metrics.exported_names() - names
    assert {n for n, _, _ in samples} <= metrics.exported_names()
    # Engine-side series carry the LLM replica's id; the error counter the ingress replica's.
    for name, labels, _ in samples:
        if name.startswith("ray_iterserve_errors"):
            assert labels["replica"] not in ("", replica)
        else:
            assert labels["replica"] == replica, (name, labels)
    assert {lab["finish_reason"] for n, lab, _ in samples if n == "ray_iterserve_requests_total"} == {"length"}
    # Histograms: every TTFT below the last finite bucket of 60 s, counted cumulatively.
    ttft_le_60 = _total(samples, "ray_iterserve_time_to_first_token_seconds_bucket", le="60.0")
    assert ttft_le_60 == len(ok)


def _request_lines(app: str) -> list:
    import ray

    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    lines = []
    for path in glob.glob(os.path.join(logs, "serve", f"replica_{app}_OpenAIIngress_*.log")):
        with open(path) as f:
            lines += [json.loads(line[line.index('{"event"') :]) for line in f if '"event":"iterserve_request"' in line]
    return lines


def test_one_log_line_per_request_without_text(obs):
    ok = obs["ok"]
    deadline = time.monotonic() + 60  # against a hang only: the lines come as soon as Serve's log flushes
    while len(lines := _request_lines(APP)) < len(ok) + 3 and time.monotonic() < deadline:
        time.sleep(0.5)  # the 413 is refused before a request id exists: no line for it
    by_id = {line["request_id"]: line for line in lines}
    assert len(by_id) == len(lines) == len(ok) + 3  # one line per request, the 404 and both 400s included
    for rid, stream, usage, replica, _ in ok:
        line = by_id[rid]
        assert line["status_code"] == 200 and line["error_type"] is None and line["finish_reason"] == "length"
        assert line["stream"] is stream and line["replica_id"] == replica
        assert (line["prompt_tokens"], line["output_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert line["e2e_s"] > 0
        assert (line["ttft_s"] is not None) is stream and (not stream or 0 < line["ttft_s"] <= line["e2e_s"])
        # Server-Timing (ms) tells the same clocks: the replica's TTFT and the prompt's preparing sit
        # within the ingress's TTFT (streams; whole answers have no ttft part).
        timing = {k: float(v) for k, _, v in (p.strip().partition(";dur=") for p in obs["timing"][rid].split(","))}
        assert set(timing) == (
            {"prepare", "replica-ttft", "ttft", "from-replica"} if stream else {"prepare", "replica-ttft"}
        )
        assert timing["prepare"] == pytest.approx(line["prepare_s"] * 1000, abs=0.1) and timing["prepare"] > 0
        assert timing["replica-ttft"] == pytest.approx(line["replica_ttft_s"] * 1000, abs=0.1)
        assert 0 < line["replica_ttft_s"] < line["e2e_s"]
        if stream:
            assert timing["ttft"] == pytest.approx(line["ttft_s"] * 1000, abs=0.1)
            assert timing["prepare"] + timing["replica-ttft"] < timing["ttft"]
            # The first chunk's way back from the replica is part of the routing and hops.
            assert 0 <= timing["from-replica"] < timing["ttft"] - timing["prepare"] - timing["replica-ttft"]
            assert timing["from-replica"] == pytest.approx(line["from_replica_s"] * 1000, abs=0.1)
    failed = sorted(
        (line["status_code"], line["error_type"]) for line in lines if line["request_id"] not in {o[0] for o in ok}
    )
    # unknown model, n=0, too long
    assert failed == [(400, "invalid_request_error"), (400, "invalid_request_error"), (404, "invalid_request_error")]
    assert any(line["cached_tokens"] > 0 for line in lines)  # the repeated chat hit the prefix cache
    # No prompt or output text and no API key in any of the app's replica logs.
    import ray

    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    text = "".join(open(p).read() for p in glob.glob(os.path.join(logs, "serve", f"replica_{APP}_*.log")))
    assert SECRET_PROMPT not in text and "violet walrus" not in text and API_KEY not in text
    outputs = [t for *_, t in ok if len(t.strip()) >= 8]
    assert outputs and not any(t in text for t in outputs)

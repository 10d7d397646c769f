"""The load generator: arrival processes (no server), then short runs against the tiny test app."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
from pathlib import Path

import numpy as np
import pytest

from cluster.request_traces import bundled, load_request_trace
from load_tests import bench
from load_tests.arrivals import arrival_offsets, gaps
from load_tests.bench_client import BenchRequest, Target, run_load, think_times
from load_tests.bench_metrics import percentile, summarize
from load_tests.bench_workloads import shared_prefix_chats, variance_requests

# ---- arrivals: statistical checks with a fixed seed ---------------------------------------------


def _ks_exponential(xs, rate) -> float:
    """Kolmogorov-Smirnov distance between the sample and Exp(rate)."""
    xs, n = sorted(xs), len(xs)
    return max(
        max(abs((i + 1) / n - (1 - math.exp(-rate * x))), abs(i / n - (1 - math.exp(-rate * x))))
        for i, x in enumerate(xs)
    )


def test_poisson_arrivals_have_exponential_gaps_at_the_rate():
    offsets = arrival_offsets(4000, rate=5.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    g = gaps(offsets)
    assert abs(np.mean(g) - 0.2) < 0.2 * 0.05  # mean gap 1/rate within 5%
    assert _ks_exponential(g, 5.0) < 1.36 / math.sqrt(len(g))  # KS test at the 5% level
    # The wrong rate is rejected by the same test: the check can fail.
    assert _ks_exponential(g, 4.0) > 1.36 / math.sqrt(len(g))


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_change_the_spread(burstiness):
    g = gaps(arrival_offsets(4000, rate=2.0, burstiness=burstiness, seed=2))
    assert abs(np.mean(g) - 0.5) < 0.5 * 0.08
    cv = np.std(g) / np.mean(g)
    assert abs(cv - 1 / math.sqrt(burstiness)) < 0.1 / math.sqrt(burstiness)  # Gamma(k): CV = 1/sqrt(k)


def test_infinite_rate_sends_everything_at_once_and_seeds_repeat():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(50, 3.0, seed=7) == arrival_offsets(50, 3.0, seed=7) != arrival_offsets(50, 3.0, seed=8)


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for p in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(np.percentile(xs, p))


def test_serving_bench_config_moves_the_port_and_sets_the_engine_threads():
    from deployments.config import AppConfig
    from load_tests.servers import run_config

    path = str(Path(__file__).resolve().parent.parent / "serve_config.yaml")
    plain = run_config(path, 8123)
    before = plain["applications"][0]["args"]
    # Values the user's config does not have, so that taking effect is visible.
    threads, cpus = before["engine"].get("num_threads", 1) + 1, before["replica"].get("num_cpus", 1) + 1
    config = run_config(path, 8123, {"engine": {"num_threads": threads}, "replica": {"num_cpus": cpus}})
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}
    args = config["applications"][0]["args"]
    assert args["engine"]["num_threads"] == threads and args["replica"]["num_cpus"] == cpus
    # Only the named fields change; the rest is the user's config, still valid.
    assert {k: v for k, v in args["engine"].items() if k != "num_threads"} == {
        k: v for k, v in before["engine"].items() if k != "num_threads"
    }
    assert {k: v for k, v in args["replica"].items() if k != "num_cpus"} == {
        k: v for k, v in before["replica"].items() if k != "num_cpus"
    }
    assert args["router"] == before["router"] and args["autoscaling"] == before["autoscaling"]
    AppConfig(**args)


# ---- against the tiny app (two replicas, real Ray Serve) -----------------------------------------


def _close(a, b):
    return a == pytest.approx(b, rel=1e-9, abs=1e-9)


def test_generator_short_run_every_request_succeeds_and_metrics_agree(tiny_app, tmp_path):
    out = tmp_path / "bench.json"
    result = bench.main(
        [
            "--base-url",
            tiny_app,
            "--api",
            "completions",
            "--workload",
            "variance",
            "--num-requests",
            "12",
            "--input-len",
            "16",
            "--mean-output",
            "6",
            "--cap",
            "12",
            "--request-rate",
            "40",
            "--goodput",
            "ttft:60000",
            "tpot:60000",
            "--json",
            str(out),
            "--no-progress",
            "--record-header",
            "Content-Type",
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["runs"][0]["summary"] == json.loads(json.dumps(result["runs"][0]["summary"]))
    [run] = saved["runs"]
    s, records = run["summary"], run["records"]
    expected = variance_requests(12, 16, 6, 12, "completions")
    assert s["requests"] == s["completed"] == len(records) == 12 and s["failed"] == 0 and s["failures"] == []
    assert sorted(r["index"] for r in records) == list(range(12))
    for r in records:  # EOS ignored: every request got exactly what it asked for
        assert r["status"] == 200 and r["error"] == "" and r["tokens_from_usage"]
        assert r["output_tokens"] == expected[r["index"]].max_tokens and r["prompt_tokens"] > 0
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["finish_reason"] == "length"
        assert all(x >= 0 for x in r["itl_s"]) and r["ttft_s"] + sum(r["itl_s"]) <= r["e2e_s"] + 1e-6
    # Every metric is there, and the percentiles are those of the per-request records.
    for name, values in {
        "ttft_ms": [r["ttft_s"] for r in records],
        "e2e_ms": [r["e2e_s"] for r in records],
        "itl_ms": [x for r in records for x in r["itl_s"]],
        "tpot_ms": [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in records if r["output_tokens"] > 1],
    }.items():
        assert s[name]["count"] == len(values) > 0
        for p in ("p50", "p90", "p99"):
            assert _close(s[name][p], np.percentile(np.array(values) * 1000, float(p[1:])))
        assert _close(s[name]["mean"], np.mean(values) * 1000)
    assert s["output_tokens"] == sum(r.max_tokens for r in expected)
    assert _close(s["output_throughput"], s["output_tokens"] / s["duration_s"])
    assert _close(s["request_throughput"], 12 / s["duration_s"])
    assert s["goodput"]["good_requests"] == 12 and s["goodput"]["slos_ms"] == {"ttft": 60000, "tpot": 60000}
    # Arrivals were spread (40 req/s): the last request started about 11 gaps after the first.
    starts = sorted(r["start_s"] for r in records)
    assert starts[-1] - starts[0] > 0.5 * max(arrival_offsets(12, 40.0))
    assert {r["headers"]["content-type"].split(";")[0] for r in records} == {"text/event-stream"}


def test_goodput_counts_only_requests_within_every_slo(tiny_app):
    reqs = variance_requests(6, 8, 4, 8, "completions", seed=3)
    res = asyncio.run(run_load(Target(tiny_app, api="completions"), reqs))
    ttfts = sorted(r.ttft_s * 1000 for r in res.records)
    cut = (ttfts[2] + ttfts[3]) / 2  # half the requests answered their first token under it
    s = summarize(res.records, res.duration_s, {"ttft": cut})
    assert s["goodput"]["good_requests"] == 3
    assert _close(s["goodput"]["request_goodput"], 3 / res.duration_s)


def test_failed_requests_are_counted_with_their_status(tiny_app):
    ok = BenchRequest(prompt="Hello there", max_tokens=4)
    too_long = BenchRequest(prompt="Hello there", max_tokens=10**6)  # over max_model_len: 400
    res = asyncio.run(run_load(Target(tiny_app, api="completions"), [ok, too_long, ok]))
    s = summarize(res.records, res.duration_s)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    [failure] = s["failures"]
    assert failure["index"] == 1 and failure["status"] == 400 and "max_model_len" in failure["error"]
    assert s["failures_by_status"] == {"400": 1}
    unknown = asyncio.run(run_load(Target(tiny_app, model="no-such-model"), [ok, ok]))  # chat: prompt -> user turn
    s = summarize(unknown.records, unknown.duration_s)
    assert s["failed"] == 2 and s["failures_by_status"] == {"404": 2} and s["output_tokens"] == 0
    assert s["ttft_ms"]["p50"] is None and s["request_throughput"] == 0


def test_no_server_is_status_0_not_a_crash():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    res = asyncio.run(
        run_load(Target(f"http://127.0.0.1:{port}/v1", model="m"), [BenchRequest(prompt="x")] * 2, timeout_s=10)
    )
    assert [r.status for r in res.records] == [0, 0] and all("Connect" in r.error for r in res.records)


def test_concurrency_and_duration_bounds(tiny_app):
    reqs = variance_requests(8, 8, 6, 8, "completions", seed=4)
    res = asyncio.run(run_load(Target(tiny_app, api="completions"), reqs, max_concurrency=2))
    assert len(res.records) == 8 and all(r.ok for r in res.records)
    events = sorted([(r.start_s, 1) for r in res.records] + [(r.start_s + r.e2e_s, -1) for r in res.records])
    assert max(np.cumsum([d for _, d in events])) <= 2
    # Arrivals far from the 1 s bound on either side: what is sent does not hang on how late the
    # event loop wakes on a busy machine.
    arrivals = [0.0, 0.1, 0.2, 0.3, 2.0, 2.1, 2.2, 2.3]
    res = asyncio.run(run_load(Target(tiny_app, api="completions"), reqs, arrivals, duration_s=1.0))
    assert sorted(r.index for r in res.records) == [0, 1, 2, 3]


def test_multi_turn_chats_carry_the_answer_into_the_next_turn(tiny_app):
    chats = shared_prefix_chats(3, num_prefixes=1, prefix_len=40, turns=2, user_len=6, max_tokens=5)
    res = asyncio.run(run_load(Target(tiny_app), chats))
    assert len(res.records) == 6 and all(r.ok and r.output_tokens == 5 for r in res.records)
    by = {(r.index, r.turn): r for r in res.records}
    for i in range(3):
        first, second = by[(i, 0)], by[(i, 1)]
        assert second.start_s >= first.start_s + first.e2e_s  # turn 2 waits for turn 1's answer
        assert second.prompt_tokens > first.prompt_tokens + 5  # ...and holds it and the new user turn


def test_chat_users_think_between_turns(tiny_app):
    assert think_times(0.0, 0, 1, 3) == [0.0, 0.0, 0.0]
    thinks = [think_times(0.3, 7, i, 2) for i in range(3)]
    assert thinks == [think_times(0.3, 7, i, 2) for i in range(3)]  # seeded: every router meets the same users
    assert len({t[1] for t in thinks}) == 3 and all(t[0] == 0.0 and t[1] > 0 for t in thinks)
    chats = shared_prefix_chats(3, num_prefixes=1, prefix_len=40, turns=2, user_len=6, max_tokens=5)
    res = asyncio.run(run_load(Target(tiny_app), chats, think_s=0.3, seed=7))
    assert len(res.records) == 6 and all(r.ok for r in res.records)
    by = {(r.index, r.turn): r for r in res.records}
    for i in range(3):
        first, second = by[(i, 0)], by[(i, 1)]
        assert second.start_s >= first.start_s + first.e2e_s + thinks[i][1] - 0.01  # the event loop's clock


# ---- trace replay -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--api", "chat"], "replays token-id prompts .* through the completions API"),
        (["--request-rate", "4"], "a trace's own times are the arrivals"),
    ],
)
def test_trace_replay_refuses_options_that_do_not_apply(extra, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--base-url", "http://127.0.0.1:9", "--workload", "trace", "--trace", "azure_code_2023", *extra])
    assert re.search(message, capsys.readouterr().err)


def test_trace_replay_names_the_bundled_traces_for_an_unknown_one():
    with pytest.raises(
        SystemExit, match="no bundled trace 'azure'; have azure_code_2023, azure_conv_2023, mooncake_conversation"
    ):
        bench.main(["--base-url", "http://127.0.0.1:9", "--workload", "trace", "--trace", "azure"])


def test_trace_replay_transforms_in_order_window_speedup_rate_duration_number():
    args = bench.parse_args(
        [
            "--base-url",
            "http://127.0.0.1:9",
            "--workload",
            "trace",
            "--trace",
            "azure_code_2023",
            "--window-s",
            "600",
            "1200",
            "--speedup",
            "2",
            "--rate-scale",
            "1.5",
            "--duration-s",
            "200",
            "--num-requests",
            "400",
        ]
    )
    trace = bench.load_trace(args)
    assert args.api == "completions"
    assert trace.notes == ["window 600-1200 s", "time x1/2", "rate x1.5", "window 0-200 s", "first 400 requests"]
    source = load_request_trace(bundled("azure_code_2023"))
    in_window = ((source.t_s >= 600) & (source.t_s < 1000)).sum()  # 200 s at speedup 2
    assert len(trace) == min(400, len(trace)) and trace.t_s[-1] < 200
    whole = bench.load_trace(
        bench.parse_args(
            ["--base-url", "x", "--workload", "trace", "--trace", "azure_code_2023", "--window-s", "600", "1000"]
        )
    )
    assert len(whole) == in_window and whole.notes == ["window 600-1000 s"]  # no bound: all of it


def test_trace_replay_spreads_a_recorded_ticks_requests_unless_at_ticks():
    base = ["--base-url", "x", "--workload", "trace", "--trace", "mooncake_conversation", "--window-s", "0", "60"]
    spread, together = (
        bench.load_trace(bench.parse_args(base)),
        bench.load_trace(bench.parse_args(base + ["--at-ticks"])),
    )
    assert spread.notes[0] == "each 3 s tick's requests spread over it" and together.notes == ["window 0-60 s"]
    assert len(np.unique(together.t_s)) == 20 and len(np.unique(spread.t_s)) == len(spread)  # 20 ticks of 3 s


def test_trace_replay_reads_a_trace_file_of_your_own(tmp_path):
    from cluster.request_traces import write_request_trace
    from cluster.synthetic_traces import sessions

    made = sessions(300, 1.0, seed=5)
    path = write_request_trace(made, tmp_path / "mine.jsonl.gz")
    trace = bench.load_trace(bench.parse_args(["--base-url", "x", "--workload", "trace", "--trace", str(path)]))
    assert trace.name == "mine" and trace.hash_ids == made.hash_ids and np.array_equal(trace.t_s, made.t_s)


def test_trace_requests_carry_each_request_lengths_capped():
    from load_tests.bench_workloads import TraceRequests

    trace = load_request_trace(bundled("mooncake_conversation")).head(50)
    requests = TraceRequests(trace, (17, 49152), token_scale=0.1, output_cap=64)
    assert len(requests) == requests.total_turns == 50 and len(requests[10:20]) == 10
    for i in (0, 4, 49, -1):
        r = requests[i]
        assert len(r.prompt) == round(trace.input_tokens[i] * 0.1) and r.ignore_eos
        assert r.max_tokens == min(64, trace.output_tokens[i]) and r.messages is None
    assert requests[-1] == requests[49] and min(trace.output_tokens) <= 64 < max(trace.output_tokens)
    with pytest.raises(IndexError):
        requests[50]


def test_trace_replay_sends_each_request_at_its_time_with_its_lengths(tiny_app, tmp_path):
    out = tmp_path / "trace.json"
    result = bench.main(
        [
            "--base-url",
            tiny_app,
            "--workload",
            "trace",
            "--trace",
            "azure_code_2023",
            "--window-s",
            "0",
            "60",
            "--num-requests",
            "6",
            "--token-scale",
            "0.01",
            "--output-cap",
            "5",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert json.loads(out.read_text())["runs"][0]["trace"] == json.loads(json.dumps(result["runs"][0]["trace"]))
    [run] = result["runs"]
    trace = load_request_trace(bundled("azure_code_2023")).head(6)
    assert run["trace"]["requests"] == 6 and run["trace"]["notes"] == ["window 0-60 s", "first 6 requests"]
    assert result["args"]["api"] == "completions" and run["summary"]["failed"] == 0
    records = sorted(run["records"], key=lambda r: r["index"])
    assert [r["index"] for r in records] == list(range(6))
    for r, t, n_in, n_out in zip(records, trace.t_s, trace.input_tokens, trace.output_tokens):
        assert r["prompt_tokens"] == max(1, round(n_in * 0.01))  # token-id prompts: exact lengths
        assert r["output_tokens"] == min(n_out, 5) and r["finish_reason"] == "length"
        assert r["start_s"] >= t - 0.005  # never early; the trace spreads them over half a second
    assert records[-1]["start_s"] - records[0]["start_s"] > 0.5 * (trace.t_s[5] - trace.t_s[0])


def test_trace_replay_prompts_share_the_prefix_blocks_they_name(tiny_app):
    # Mooncake's requests all begin with block 0: at token scale 0.05 that is 26 tokens, three of the
    # tiny app's 8-token KV blocks. Sent one at a time over its two replicas, the third request finds
    # a replica that has the block cached already, and nothing past it (every later block differs).
    result = bench.main(
        [
            "--base-url",
            tiny_app,
            "--workload",
            "trace",
            "--trace",
            "mooncake_conversation",
            "--num-requests",
            "4",
            "--speedup",
            "1000",
            "--token-scale",
            "0.05",
            "--output-cap",
            "2",
            "--max-concurrency",
            "1",
            "--json",
            "",
            "--no-progress",
        ]
    )
    records = sorted(result["runs"][0]["records"], key=lambda r: r["index"])
    assert all(r["status"] == 200 and r["error"] == "" for r in records) and len(records) == 4
    assert records[0]["cached_tokens"] == 0 and all(r["cached_tokens"] in (0, 24) for r in records)
    assert max(r["cached_tokens"] for r in records[2:]) == 24

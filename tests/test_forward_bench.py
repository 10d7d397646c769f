"""The forward benchmark's pieces without llama.cpp: its figures from recorded events, its targets and
table, and its two scenarios against the tiny test app (real Ray Serve)."""

from __future__ import annotations

import asyncio
import re

import pytest

from load_tests import forward_bench as fb
from load_tests.bench_client import BenchRecord, LoadResult, Target


def _record(i: int, start: float, ttft: float, e2e: float, tokens: int, status: int = 200) -> BenchRecord:
    return BenchRecord(
        index=i,
        start_s=start,
        status=status,
        ttft_s=ttft,
        e2e_s=e2e,
        output_tokens=tokens,
        prompt_tokens=40,
        error="" if status == 200 else "overloaded",
    )


def test_single_user_figures_are_first_token_percentiles_and_per_stream_decode_speed():
    # (ttft, e2e, tokens): decode speed = (tokens - 1) / (e2e - ttft)
    rows = [(0.10, 1.10, 11), (0.20, 0.70, 11), (0.30, 2.30, 11), (0.40, 0.90, 6), (0.05, 0.05, 1)]
    records = [_record(i, 5.0 * i, *row) for i, row in enumerate(rows)]
    records.append(_record(9, 30.0, 0.01, 0.02, 3, status=503))  # failed: counts nowhere
    f = fb.single_figures(LoadResult(records, 31.0))
    # TTFTs of the 5 answered: 0.05 0.10 0.20 0.30 0.40 -> p50 0.20 s; p90 at rank 3.6: 0.30 + 0.6 x 0.10
    assert f["ttft_p50_ms"] == pytest.approx(200.0) and f["ttft_p90_ms"] == pytest.approx(360.0)
    # Speeds 10, 20, 5, 10 tok/s (the one-token answer has none): p50 = 10
    assert f["decode_tok_s_p50"] == pytest.approx(10.0)
    assert (f["requests"], f["completed"], f["failed"]) == (6, 5, 1) and f["output_lengths"] == [1, 6, 11]
    assert f["errors"] == ["overloaded"] and len(f["records"]) == 6
    assert fb.decode_speed(records[1]) == pytest.approx(20.0) and fb.decode_speed(records[4]) is None


def test_burst_figures_are_output_tokens_over_the_burst():
    records = [_record(i, 0.0, 0.1 * (i + 1), 2.0, 64) for i in range(4)]
    f = fb.burst_figures(LoadResult(records, 2.5))
    assert f["output_tok_s"] == pytest.approx(4 * 64 / 2.5)
    assert f["ttft_p50_ms"] == pytest.approx(250.0) and f["output_lengths"] == [64]


def _figures(ttft: float, decode: float, burst: float) -> dict:
    return {
        "single": {"ttft_p50_ms": ttft, "ttft_p90_ms": ttft * 2, "decode_tok_s_p50": decode},
        "burst": {"output_tok_s": burst, "ttft_p50_ms": 500.0},
    }


def _system(ttft: float, decode: float, burst: float, burst_failed: int = 0) -> dict:
    runs = [{"single": {"failed": 0}, "burst": {"failed": burst_failed}}]
    return {"figures": _figures(ttft, decode, burst), "runs": runs}


def test_targets_are_ratios_to_llamacpp_each_way():
    by_system = {"iterserve": _system(60.0, 80.0, 150.0), "llamacpp": _system(30.0, 160.0, 100.0)}
    checks = {c["figure"]: c for c in fb.targets(by_system)}
    ttft, decode, burst = (
        checks[k] for k in ("single: TTFT p50 (ms)", "single: decode tok/s p50", "burst: output tok/s")
    )
    # Exactly at the bound is met (<= 2x, >= 0.5x, >= 1.5x) ...
    assert (ttft["ratio"], decode["ratio"], burst["ratio"]) == pytest.approx((2.0, 0.5, 1.5))
    assert ttft["met"] and decode["met"] and burst["met"]
    # ... and a little past it is missed, in the direction each target points.
    by_system["iterserve"]["figures"] = _figures(61.0, 79.0, 149.0)
    assert [c["met"] for c in fb.targets(by_system)] == [False, False, False]
    by_system["iterserve"]["figures"] = _figures(20.0, 300.0, 400.0)
    assert [c["met"] for c in fb.targets(by_system)] == [True, True, True]
    assert fb.targets({"iterserve": by_system["iterserve"]}) == []  # no peer: no ratios


def test_a_scenario_with_failed_requests_gives_no_ratio():
    # llama.cpp's burst timed out for 3 chats: its tokens/s covers less work, so no ratio, not met,
    # and the table says why; the single scenario, complete on both sides, keeps its verdicts.
    by_system = {"iterserve": _system(60.0, 80.0, 150.0), "llamacpp": _system(30.0, 160.0, 10.0, burst_failed=3)}
    checks = {c["figure"]: c for c in fb.targets(by_system)}
    burst = checks["burst: output tok/s"]
    assert burst["ratio"] is None and not burst["met"] and burst["failed_requests"] == 3
    assert checks["single: TTFT p50 (ms)"]["met"] and checks["single: TTFT p50 (ms)"]["ratio"] == pytest.approx(2.0)
    for system in by_system.values():
        for run in system["runs"]:
            for scenario in ("single", "burst"):
                run[scenario].update(completed=1, requests=1, output_lengths=[64])
    table = fb.format_table(by_system, list(checks.values()))
    line = next(x for x in table.splitlines() if x.startswith("burst: output tok/s"))
    assert re.search(r"150\.0 +10\.0 +- +>= 1\.5x failed requests: 3$", line), line


def test_medians_over_repeats_and_the_table_shows_them_with_the_verdicts():
    runs = [
        {
            "single": {
                **_figures(t, d, b)["single"],
                "completed": 3,
                "requests": 3,
                "failed": 0,
                "output_lengths": [5],
            },
            "burst": {**_figures(t, d, b)["burst"], "completed": 6, "requests": 6, "failed": 0, "output_lengths": [5]},
        }
        for t, d, b in ((50.0, 100.0, 90.0), (70.0, 40.0, 120.0), (10.0, 60.0, None))
    ]
    med = fb.medians(runs)
    assert med["single"]["ttft_p50_ms"] == 50.0 and med["single"]["decode_tok_s_p50"] == 60.0
    assert med["burst"]["output_tok_s"] == 105.0  # a run without the figure does not count
    by_system = {
        "iterserve": {"runs": runs, "figures": med},
        "llamacpp": {"runs": runs[:1], "figures": fb.medians(runs[:1])},
    }
    table = fb.format_table(by_system, fb.targets(by_system))
    line = next(x for x in table.splitlines() if x.startswith("burst: output tok/s"))
    assert "105.0" in line and "90.0" in line and "1.17x" in line and ">= 1.5x MISSED" in line
    line = next(x for x in table.splitlines() if x.startswith("single: TTFT p50"))
    assert "1.00x" in line and "<= 2x met" in line
    assert "9/9 5" in next(x for x in table.splitlines() if x.startswith("single: done"))


def test_unknown_systems_are_refused():
    with pytest.raises(SystemExit):
        fb.parse_args(["--systems", "iterserve,vllm"])


def test_scenarios_against_a_real_server_one_at_a_time_then_all_at_once(tiny_app):
    args = fb.parse_args(["--chats", "3", "--burst", "6", "--output-tokens", "5", "--input-len", "8"])
    requests = fb.workload(args)
    prompts = {name: [r.messages[0]["content"] for r in reqs] for name, reqs in requests.items()}
    assert not set(prompts["single"]) & set(prompts["burst"])  # no answer comes from the other's cache
    result = asyncio.run(fb.measure(Target(tiny_app), requests, repeat=2, timeout_s=60))
    assert len(result["runs"]) == 2
    for run in result["runs"]:
        single = sorted(run["single"]["records"], key=lambda r: r["start_s"])
        burst = run["burst"]["records"]
        assert len(single) == 3 and len(burst) == 6
        assert all(r["status"] == 200 and r["output_tokens"] == 5 for r in single + burst)  # EOS ignored
        for a, b in zip(single, single[1:]):  # one at a time: each starts after the previous ended
            assert b["start_s"] >= a["start_s"] + a["e2e_s"]
        assert max(r["start_s"] for r in burst) < min(r["start_s"] + r["e2e_s"] for r in burst)  # all in flight
        assert run["single"]["output_lengths"] == run["burst"]["output_lengths"] == [5]
        speeds = sorted(4 / (r["e2e_s"] - r["ttft_s"]) for r in single)
        assert run["single"]["decode_tok_s_p50"] == pytest.approx(speeds[1])
        assert run["single"]["ttft_p50_ms"] == pytest.approx(sorted(r["ttft_s"] for r in single)[1] * 1000)
        assert run["burst"]["output_tok_s"] == pytest.approx(30 / run["burst"]["duration_s"])
    for scenario, key in (("single", "ttft_p50_ms"), ("burst", "output_tok_s")):
        values = sorted(run[scenario][key] for run in result["runs"])
        assert result["figures"][scenario][key] == pytest.approx(sum(values) / 2)  # median of two

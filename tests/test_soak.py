"""The soak (load_tests/soak.py): a bounded run on real Serve, and its verdict arithmetic."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_config

from load_tests import soak
from load_tests.soak_traffic import SoakRecord


@pytest.mark.slow
def test_bounded_soak_on_tiny_llama(serve_cluster, tmp_path):
    """~25 s of mixed traffic at 4 req/s: no unexpected error, nothing lost, every kind answered as it
    should be, every KV block free once the traffic drained, RSS read from the replica."""
    url = serve_cluster.deploy("soak", tiny_config())
    out = tmp_path / "soak.json"
    try:
        code = soak.main(
            [
                "--base-url",
                url,
                "--app",
                "soak",
                "--minutes",
                "0.4",
                "--rate",
                "4",
                "--timeout-s",
                "60",
                "--drain-s",
                "60",
                "--json",
                str(out),
            ]
        )
    finally:
        serve_cluster.delete("soak")
    rep = json.loads(out.read_text())
    assert rep["unexpected_errors"] == 0 and rep["lost"] == 0, rep["errors"]
    assert code == 0
    kinds = rep["by_kind"]
    assert sum(sum(c.values()) for c in kinds.values()) == rep["requests"] >= 60
    assert kinds["stream"]["ok"] > 0 and kinds["plain"]["ok"] > 0
    assert kinds["disconnect"]["disconnected"] > 0 and kinds["bad"]["expected_4xx"] > 0
    assert rep["kv_blocks_all_free"] is True
    assert all(kv["free"] == kv["total"] > 0 for kv in rep["kv_blocks"].values())
    assert all(v > 50 * 2**20 for v in rep["rss_bytes"]["end"].values())  # a real process's RSS, read back
    assert rep["rss_growth_pct"] is not None
    t = rep["targets"]
    assert t["unexpected_errors"]["met"] and t["lost"]["met"] and t["kv_blocks_all_free"]["met"]
    assert not t["rss_growth_pct"]["enforced"] and not t["e2e_p99_drift_pct"]["enforced"]  # short run


def _ok(start_s: float, e2e_s: float) -> SoakRecord:
    return SoakRecord(kind="stream", start_s=start_s, outcome="ok", status=200, ttft_s=e2e_s / 2, e2e_s=e2e_s)


def test_verdict_counts_drift_growth_and_lost():
    records = [_ok(t, 1.0) for t in range(0, 12)] + [_ok(t, 1.5) for t in range(48, 60)]
    records += [
        SoakRecord(kind="bad", start_s=30, outcome="expected_4xx", status=400),
        SoakRecord(kind="plain", start_s=31, outcome="lost", error="open after the drain"),
    ]
    rss = {"before": {"r": 100}, "after_warmup": {"r": 200}, "end": {"r": 230}}
    end = {"r": {"running": 0, "waiting": 0, "kv_blocks_free": 8, "kv_blocks_total": 8}}
    rep = soak.report(records, minutes=1.0, rate=1.0, wall_s=61.0, rss=rss, end_stats=end)
    assert rep["latency"]["e2e_p99"]["drift_pct"] == 50.0
    assert rep["rss_growth_pct"] == 15.0
    assert rep["lost"] == 1 and rep["unexpected_errors"] == 0
    assert rep["unexpected_error_rate"] == 0.0 and rep["by_kind"]["bad"]["expected_4xx"] == 1
    short, full = soak.verdict(rep, enforce_all=False), soak.verdict(rep, enforce_all=True)
    assert short["lost"]["enforced"] and not short["lost"]["met"]
    assert not short["rss_growth_pct"]["enforced"] and full["rss_growth_pct"]["enforced"]
    assert full["rss_growth_pct"]["met"] is False and full["e2e_p99_drift_pct"]["met"] is False
    assert "MISSED" in soak.format_report(rep, full)

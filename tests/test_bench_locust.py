"""The locustfile: a short headless Locust run against the tiny app reports TTFT / ITL / TPOT / E2E events.

Locust runs in its own process: it monkey-patches sockets with gevent on import, which must not
happen inside the test session that drives Ray.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_locust_reports_ttft_itl_tpot_as_custom_events(tiny_app, tmp_path):
    prefix = tmp_path / "locust"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(ROOT / "load_tests" / "locustfile.py"),
        "--headless",
        "-u",
        "2",
        "-r",
        "2",
        "-t",
        "4s",
        "--host",
        tiny_app,
        "--csv",
        str(prefix),
        "--only-summary",
        "--api",
        "completions",
        "--workload",
        "variance",
        "--mean-output",
        "4",
        "--cap",
        "8",
        "--num-requests",
        "16",
        "--stop-timeout",
        "10",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(f"{prefix}_stats.csv"))}
    post = rows[("POST", "/v1/completions")]
    assert int(post["Request Count"]) >= 2 and int(post["Failure Count"]) == 0
    for kind in ("TTFT", "ITL", "TPOT", "E2E"):
        row = rows[(kind, "/v1/completions")]
        assert int(row["Request Count"]) > 0 and float(row["Median Response Time"]) > 0
    # One TTFT per request (the 2 users' last requests may be cut by the time limit after their first
    # token); TTFT within the request's own time.
    assert 0 <= int(rows[("TTFT", "/v1/completions")]["Request Count"]) - int(post["Request Count"]) <= 2
    assert int(rows[("E2E", "/v1/completions")]["Request Count"]) == int(post["Request Count"])
    assert float(rows[("TTFT", "/v1/completions")]["Median Response Time"]) <= float(
        rows[("E2E", "/v1/completions")]["Median Response Time"]
    )

"""A real 3-node Ray cluster on this machine (cluster.local) and the autoscaling burst scenario on it
(cluster.burst) run as subprocesses: the pytest process's own Ray (conftest) is never touched.

Bounds stated here: 1 -> 4 replicas within 60 s of the burst's start (measured 11.6-19.5 s on the
2-core machine), back to 1 within 60 s of the load dropping, or, where start-ups run slow, within three
start-ups (each read as the 1 -> 4 time, which includes one): the burst's clients run on 10 s after
the fleet is full, so it outlasts a start-up and the policy re-buys it like the first time (kept a
start-up after its last bucket; a burst shorter than a start-up would be kept YOUNG_HOLD of them).
Measured 21.2 s alone (41-81 s before the policy told the two apart). About 150 s in all.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Serve starts every replica within UP_BOUND_S of the burst (the policy's decision); they run within
# START_WAIT_S (their start-ups: 31 s to 4 running alone on 2 Zen 3 cores, 77 s once beside the suite's
# Serve cluster).
UP_BOUND_S, START_WAIT_S, DOWN_BOUND_S = 60, 180, 60


def _free_base_port() -> int:
    """A base port whose cluster range (base .. base + 399) is free now: below the OS's picks for
    bind(0), which the other pytest worker's Ray takes from all the time, and above free_port()'s."""
    for base in range(28000, 32400, 400):
        try:
            for p in (base, base + 1, base + 2, *range(base + 100, base + 400, 100)):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def _run(*args, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled")
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def local_cluster():
    # Short path: Ray's unix sockets live under it (108-byte limit).
    state = Path(tempfile.mkdtemp(prefix="isc-", dir="/tmp"))
    up = _run(
        "cluster.local", "up", "--workers", "2", "--dir", str(state), "--base-port", str(_free_base_port()), timeout=300
    )
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        yield json.loads(up.stdout.strip().splitlines()[-1])
    finally:
        down = _run("cluster.local", "down", "--dir", str(state), timeout=120)
        assert down.returncode == 0, down.stderr[-2000:]
        leftovers = subprocess.run(["pgrep", "-f", f"{state}/session_"], capture_output=True, text=True).stdout
        assert not leftovers.strip(), f"processes left running: {leftovers}"
        shutil.rmtree(state, ignore_errors=True)  # its logs stay where the cluster did not stop cleanly


@pytest.mark.slow
def test_status_shows_head_and_two_workers(local_cluster):
    out = _run("cluster.local", "status", "--dir", local_cluster["dir"], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and all(" alive " in line for line in lines)
    assert sorted(line.split()[1] for line in lines) == ["head", "worker-1", "worker-2"]


@pytest.mark.slow
def test_burst_scales_up_and_back_without_losing_a_request(local_cluster):
    out = _run(
        "cluster.burst",
        "--address",
        local_cluster["address"],
        "--max-replicas",
        "4",
        "--clients",
        "16",
        "--up-timeout-s",
        str(START_WAIT_S),
        "--down-timeout-s",
        "240",
        timeout=600,
    )  # the bound below depends on the run's start-up
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print({k: v for k, v in result.items() if k != "timeline"})
    timeline = " ".join(f"{t}:{n}" for t, n in result["timeline"])  # whole, where pytest cuts a list
    assert result["seconds_to_ask_max"] is not None and result["seconds_to_ask_max"] <= UP_BOUND_S, timeline
    assert result["seconds_to_max"] is not None, timeline
    down_bound = max(DOWN_BOUND_S, 3 * result["seconds_to_max"])
    assert result["seconds_to_min"] is not None and result["seconds_to_min"] <= down_bound, timeline
    assert result["nodes_with_replicas"] > 1
    # Every request sent during scale-up and scale-down was answered in full.
    assert result["sent"] > 50 and result["failed"] == 0 and result["ok"] == result["sent"], result["errors"]

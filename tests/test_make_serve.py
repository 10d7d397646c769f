"""Ctrl-C on `make serve` stops everything it started: `serve run`, its local Ray cluster, the replicas.

The child runs in its own session, as a terminal's foreground job would, with the SIGINT a terminal's
Ctrl-C sends to the whole process group. Every process it starts carries a marker in its environment
(Ray's processes inherit the driver's environment), so the test finds them all in /proc, whatever
Ray renamed them to, and can tell that none outlives the Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import List

import httpx
import pytest
import yaml

from cluster.local_serve import free_port

ROOT = Path(__file__).resolve().parent.parent
MARKER = "ITERSERVE_MAKE_SERVE_TEST"
STOP_BOUND_S = 30.0  # Ctrl-C to every process gone, at most
START_BOUND_S = 240.0  # a fresh local Ray cluster plus the app, on a busy 2-core machine


def marked_pids(token: str) -> List[int]:
    """Live processes whose environment carries MARKER=token (zombies have no environment left)."""
    needle = f"{MARKER}={token}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def tiny_serve_config(path: Path, port: int) -> Path:
    """serve_config.yaml with tiny-llama on loopback `port` (a free one)."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    args["engine"] = {"model": "tiny-llama", "num_threads": 1, "num_kv_blocks": 256}
    args["replica"]["num_cpus"] = 0
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_ctrl_c_on_make_serve_stops_everything_it_started(tmp_path):
    port, token = free_port(), uuid.uuid4().hex
    config = tiny_serve_config(tmp_path / "serve_config.yaml", port)
    # RAY_ADDRESS=local: `serve run` must start a new local cluster, never attach to this session's
    # Ray (ray.init exported its address) or to a `ray start` cluster another job left on the machine.
    env = {**os.environ, "RAY_ADDRESS": "local", MARKER: token}
    venv = Path(sys.executable).parent.parent
    # -o install -o model: the environment running this test is already installed and prepared.
    cmd = ["make", "-o", "install", "-o", "model", "serve", f"VENV={venv}", f"SERVE_CONFIG={config}"]
    log = open(tmp_path / "make_serve.log", "w")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )

    def log_tail() -> str:
        return (tmp_path / "make_serve.log").read_text()[-3000:]

    try:
        deadline = time.monotonic() + START_BOUND_S
        while True:
            assert proc.poll() is None, f"make serve exited with {proc.returncode}:\n{log_tail()}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"no /health 200 within {START_BOUND_S} s:\n{log_tail()}"
            time.sleep(1)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        started = marked_pids(token)
        # make, serve run, GCS, raylet, Serve controller, proxy, ingress, LLM replica at least.
        assert len(started) >= 8, started

        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        proc.wait(timeout=STOP_BOUND_S)
        exited = time.monotonic() - t0
        while marked_pids(token) and time.monotonic() - t0 < STOP_BOUND_S:
            time.sleep(0.5)
        left = marked_pids(token)
        assert not left, f"still running {STOP_BOUND_S} s after Ctrl-C: " + ", ".join(
            f"{pid} {_cmdline(pid)}" for pid in left
        )
        print(
            f"make serve: {len(started)} processes; make exited {exited:.1f} s after Ctrl-C, "
            f"all gone after {time.monotonic() - t0:.1f} s"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in marked_pids(token):  # only processes this test started carry its token
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"

"""`cluster.local_serve`: its own cluster on a free port (a picked port taken before Serve's proxy bound
it is replaced), stopped on an error; the ports it picks. The cluster runs in a subprocess driver: the
pytest worker may hold the session's Ray (conftest), and a process has one Ray.

CI once lost all 220 Serve tests to one "Failed to bind to address": the session cluster's port, the
OS's pick, was taken by one of Ray's processes between the pick and the proxy's bind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cluster.local_serve import PICK_RANGE, free_port

ROOT = Path(__file__).resolve().parent.parent

# The first port local_serve picks is one this driver listens on, as one of Ray's processes might.
_DRIVER = """
import json, os, socket, time
import httpx, ray
import cluster.local_serve as local_serve_module

os.environ["RAY_ADDRESS"] = "127.0.0.1:1"  # a user's cluster, named in the environment: never joined
taken = socket.socket()
taken.bind(("127.0.0.1", local_serve_module.free_port()))
taken.listen()
seen = {"busy": taken.getsockname()[1]}
picks, pick = iter([seen["busy"]]), local_serve_module.free_port
local_serve_module.free_port = lambda: next(picks, None) or pick()
try:
    with local_serve_module.local_serve(num_cpus=1, logging_level="ERROR") as server:
        seen["port"], seen["gcs"] = server.port, ray.get_runtime_context().gcs_address
        deadline = time.monotonic() + 60
        while "proxy" not in seen and time.monotonic() < deadline:  # it listens soon after serve.start
            try:
                # Serve's proxy answers (503 until it has a route table: no app is deployed here).
                seen["proxy"] = httpx.get(server.url + "/-/healthz", timeout=5).text
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("the block fails")
except RuntimeError as e:
    seen["raised"] = str(e)

def listening(address):
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0

seen.update(initialized=ray.is_initialized(), proxy_listening=listening(server.url[7:]),
            gcs_listening=listening(seen["gcs"]))
print(json.dumps(seen))
"""


def test_local_serve_starts_its_own_cluster_on_a_free_port_and_stops_serve_and_ray_on_error():
    out = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # Ray's raylet may print after the driver's JSON line.
    seen = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert seen["gcs"] != "127.0.0.1:1" and "proxy" in seen and seen["raised"] == "the block fails"
    assert seen["port"] != seen["busy"]  # the taken pick was replaced, and the proxy answered there
    assert not seen["initialized"] and not seen["proxy_listening"] and not seen["gcs_listening"]


def test_picked_ports_stay_out_of_the_ranges_ray_takes_from():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port() for _ in range(50)}
    # Above `ray start`'s worker ports (10002-19999), below the test clusters' (28000-32399) and the
    # OS's picks for bind(0).
    assert all(20000 <= port <= PICK_RANGE[1] < 28000 <= ephemeral_low for port in ports), sorted(ports)
    assert len(ports) > 40  # spread, so two pytest workers rarely race for one

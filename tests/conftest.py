"""Shared fixtures.

Serve tests: ONE real Ray cluster and Serve instance for the whole session (ray.init ~10 s,
serve.run ~6 s on this machine), with the test applications deployed lazily, each once.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Callable, Optional

import pytest

from cluster.local_serve import LocalServe, free_port, local_serve

# Replica processes inherit the driver's environment when ray.init starts the cluster here.
# Engines run eagerly unless a test asks to compile (tests/test_compiled_forward.py): compiling each of
# the suite's engines would cost minutes. Ray workers and `make serve` subprocesses inherit it.
os.environ.setdefault("ITERSERVE_COMPILE", "off")
# torch on one thread unless a test or config asks for more (set before any test module imports torch):
# `make test`'s two pytest workers keep both cores busy, where a second thread per process mostly
# waits on the first (engine parity: 47 CPU-s on one thread, 67 on two, for 8% more wall time alone).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")

TINY = "tiny-llama"
SMOL = "smollm2-135m-instruct"
SMOL_ENGINE = {"model": SMOL, "num_threads": 2, "kv_cache_memory_gib": 0.25}


def wait_until(predicate: Callable[[], Optional[object]], timeout_s: float, what: str):
    """Polls `predicate` until it returns something truthy (returned); fails naming `what` after
    `timeout_s`. The deadline only guards against a hang: a slow machine waits longer, never fails."""
    deadline = time.monotonic() + timeout_s
    while not (got := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return got


async def eventually(predicate: Callable[[], Optional[object]], timeout_s: float, what: str):
    """`wait_until` for a coroutine: polls `predicate` between sleeps that let the loop's other tasks
    run, until it returns something truthy (returned); fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (got := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.01)
    return got


def replica_stats(app: str, replicas: int = 2) -> dict:
    """Engine stats of every LLM replica of `app`, by replica id (the handle reaches a random one)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app)
    seen: dict = {}
    for _ in range(200):
        s = handle.stats.remote().result()
        seen[s["replica_id"]] = s
        if len(seen) == replicas:
            return seen
    raise AssertionError(f"reached only {len(seen)} of {replicas} replicas")


class ServeCluster:
    """The session's running Serve (`server`: its HTTP and metrics ports); deploys test apps on demand,
    each once."""

    def __init__(self, server: LocalServe):
        self.server = server
        self.metrics_port = server.metrics_port
        self._apps: dict = {}

    def url(self, app: str) -> str:
        return f"{self.server.url}/{app}"

    def deploy(self, name: str, config: dict) -> str:
        """Deploys `config` (AppConfig as a dict) as app `name` at /name once; returns its URL."""
        if name not in self._apps:
            self.server.deploy(name, config)
            self._apps[name] = config
        return self.url(name)

    def delete(self, name: str) -> None:
        """Removes app `name` (its replicas' memory goes back to later tests)."""
        from ray import serve

        serve.delete(name)
        self._apps.pop(name, None)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    # Under `-n N --dist loadgroup` (make test): every test on the session's Serve cluster runs in one
    # worker, so one cluster is started; the others spread over the remaining workers.
    for item in items:
        if "serve_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("serve"))


@pytest.fixture(scope="session")
def serve_cluster(request):
    # Grouped, or each worker would start a cluster of its own: xdist's groups silently stop working
    # on pytest 9.2 (pytest-dev/pytest-xdist#1386).
    if getattr(request.config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        loose = [
            i.nodeid
            for i in request.session.items
            if "serve_cluster" in i.fixturenames and not i.nodeid.endswith("@serve")
        ]
        if loose:
            pytest.fail(f"pytest-xdist did not group the Serve tests ({loose[0]}, ...)", pytrace=False)
    # A cluster of its own (never a user's); the metrics agent runs without the dashboard too, and a
    # known port lets tests scrape it.
    with local_serve(num_cpus=2, metrics_port=free_port()) as server:
        yield ServeCluster(server)


def tiny_config(**replica) -> dict:
    return {
        "engine": {
            "model": TINY,
            "dtype": "float32",
            "num_threads": 1,
            "num_kv_blocks": 512,
            "block_size": 8,
            "max_num_seqs": 16,
        },
        "replica": {"num_replicas": 1, **replica},
        "stream": {"interval_ms": 10},
    }


@pytest.fixture(scope="session")
def tiny_app(serve_cluster) -> str:
    """tiny-llama on two replicas (one torch thread each): routing, disconnects, most API tests."""
    return serve_cluster.deploy("tiny", tiny_config(num_replicas=2))


@pytest.fixture(scope="session")
def smol_app(serve_cluster) -> str:
    """The embedded SmolLM2 on one replica: greedy parity with the offline engine."""
    return serve_cluster.deploy("smol", {"engine": SMOL_ENGINE})


@pytest.fixture(scope="session")
def overload_app(serve_cluster) -> str:
    """One replica taking one request at a time, one more queued: the third concurrent is refused."""
    return serve_cluster.deploy("overload", tiny_config(max_ongoing_requests=1, max_queued_requests=1))


@pytest.fixture
def serving():
    """Makes `Serving`s (tests/router_harness.py: a router driven as Serve drives it, on an event loop
    of its own) and closes their loops after the test."""
    from tests.router_harness import Serving

    made = []

    def make(router, replicas):
        made.append(Serving(router, replicas))
        return made[-1]

    yield make
    for s in made:
        s.close()

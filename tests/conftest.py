"""Shared fixtures.

Serve tests: ONE real Ray cluster and Serve instance for the whole session (ray.init ~10 s,
serve.run ~6 s on this machine), with the test applications deployed lazily, each once.
"""
from __future__ import annotations

import os
import socket

import pytest

# Replica processes inherit the driver's environment when ray.init starts the cluster here.
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")

TINY = "tiny-llama"
SMOL = "smollm2-135m-instruct"
SMOL_ENGINE = {"model": SMOL, "num_threads": 2, "kv_cache_memory_gib": 0.25}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeCluster:
    """A running Ray cluster with Serve's HTTP proxy on `port` and the node's Prometheus metrics on
    `metrics_port`; deploys test apps on demand."""

    def __init__(self, port: int, metrics_port: int):
        self.port = port
        self.metrics_port = metrics_port
        self._apps: dict = {}

    def url(self, app: str) -> str:
        return f"http://127.0.0.1:{self.port}/{app}"

    def deploy(self, name: str, config: dict) -> str:
        """Deploys `config` (AppConfig as a dict) as app `name` at /name once; returns its URL."""
        if name not in self._apps:
            from ray import serve

            from deployments.app import build_app

            serve.run(build_app(config), name=name, route_prefix=f"/{name}")
            self._apps[name] = config
        return self.url(name)

    def delete(self, name: str) -> None:
        """Removes app `name` (its replicas' memory goes back to later tests)."""
        from ray import serve

        serve.delete(name)
        self._apps.pop(name, None)


@pytest.fixture(scope="session")
def serve_cluster():
    import ray
    from ray import serve

    # The metrics agent runs without the dashboard too; a known port lets tests scrape it.
    metrics_port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,  # never a user's cluster
             _metrics_export_port=metrics_port)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield ServeCluster(port, metrics_port)
    finally:
        serve.shutdown()
        ray.shutdown()


def tiny_config(**replica) -> dict:
    return {
        "engine": {"model": TINY, "num_threads": 1, "num_kv_blocks": 512, "block_size": 8,
                   "max_num_seqs": 16},
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

"""`local_serve()`: a Ray cluster with Serve on it for the length of a `with` block, for tests and
benchmarks alike. Serve's HTTP proxy listens on a loopback port (a free one unless given); Serve, then
Ray, are shut down when the block ends, on an error too.

With the default `address="local"` it always starts a new cluster in this process (Ray ignores
RAY_ADDRESS then): a user's running cluster is never joined, and never shut down. Only an address
passed explicitly (`cluster.burst --address`) joins an existing cluster; Serve is started there and
shut down at the end, and the cluster keeps running.
"""
from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import Iterator, Optional, Union


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LocalServe:
    """Where the running Serve answers: `url` is its HTTP proxy's base URL."""

    port: int
    metrics_port: Optional[int] = None  # the node's Prometheus metrics, when the caller chose the port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def deploy(self, name: str, config: dict) -> str:
        """Deploys `config` (an AppConfig as a dict) as Serve app `name` at /name; returns its URL."""
        from ray import serve

        from deployments.app import build_app

        serve.run(build_app(config), name=name, route_prefix=f"/{name}")
        return f"{self.url}/{name}"


@contextlib.contextmanager
def local_serve(num_cpus: Optional[float] = 2, port: Optional[int] = None, metrics_port: Optional[int] = None,
                address: str = "local", proxy_location: Optional[str] = None,
                logging_level: Union[int, str, None] = None) -> Iterator[LocalServe]:
    """Starts Ray (`num_cpus` logical CPUs, no dashboard, workers' logs not echoed) and Serve, yields a
    LocalServe, then shuts down Serve and Ray. `metrics_port`: the node's metrics export port (only
    for a cluster started here). `logging_level`: Ray's driver logging (None: Ray's default)."""
    import ray
    from ray import serve

    kwargs: dict = {"log_to_driver": False}
    if logging_level is not None:
        kwargs["logging_level"] = logging_level
    if address == "local":  # these configure a new node; Ray refuses them when joining a cluster
        kwargs.update(num_cpus=num_cpus, include_dashboard=False)
        if metrics_port is not None:
            kwargs["_metrics_export_port"] = metrics_port
    elif metrics_port is not None:
        raise ValueError("metrics_port is set by the cluster being joined, not by local_serve")
    port = port or free_port()
    ray.init(address=address, **kwargs)
    try:
        serve.start(proxy_location=proxy_location, http_options={"host": "127.0.0.1", "port": port})
        yield LocalServe(port, metrics_port)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

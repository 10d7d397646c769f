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
import random
import socket
from dataclasses import dataclass
from typing import Iterator, Optional, Union

# Ray's processes take ports all the time: the OS's picks for bind(0) (32768 and up on Linux) and
# random ones above them, and its workers' range (10002-19999 under `ray start`). A port the OS picked
# and released can be taken by one of them before the server binds it (CI lost every Serve test to
# that), so ports are picked between those ranges (the rest of the gap, 28000-32767, is left to the
# test clusters of `cluster.local`).
PICK_RANGE = (20000, 27999)
_pick = random.SystemRandom()  # not the `random` module's state: tests seed it, two workers would agree


def free_port() -> int:
    """A loopback port nothing is bound to now, from PICK_RANGE."""
    for _ in range(200):
        port = _pick.randint(*PICK_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {PICK_RANGE[0]}-{PICK_RANGE[1]} after 200 tries")


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
def local_serve(
    num_cpus: Optional[float] = 2,
    port: Optional[int] = None,
    metrics_port: Optional[int] = None,
    address: str = "local",
    proxy_location: Optional[str] = None,
    logging_level: Union[int, str, None] = None,
) -> Iterator[LocalServe]:
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
    ray.init(address=address, **kwargs)
    try:
        port = _start_serve(port, proxy_location)
        yield LocalServe(port, metrics_port)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _start_serve(port: Optional[int], proxy_location: Optional[str], tries: int = 3) -> int:
    """Starts Serve's proxy on `port`, or on a free port; a picked port taken before the proxy bound it
    is replaced by another (a given one is the caller's to choose). Returns the port."""
    from ray import serve

    for attempt in range(tries):
        chosen = port or free_port()
        try:
            serve.start(proxy_location=proxy_location, http_options={"host": "127.0.0.1", "port": chosen})
            return chosen
        except Exception as error:  # a RayTaskError wrapping the proxy's "Failed to bind"
            if port or attempt == tries - 1 or "Failed to bind" not in str(error):
                raise
            serve.shutdown()
    raise AssertionError("the last try returns or raises")

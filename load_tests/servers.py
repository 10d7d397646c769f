"""Servers a benchmark starts and stops itself: this application as a user runs it (`serve run`), and
the outside peer (`transformers serve --continuous-batching`); llama.cpp's server starts the same way
(load_tests/llamacpp_server.py). Each runs in its own process group,
is ready when GET /health answers 200, and is stopped with everything it started when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import yaml


@contextlib.contextmanager
def process_group(
    cmd: List[str], url: str, log_path: Path, start_timeout_s: float, stop_signal: int, env: Optional[dict] = None
) -> Iterator[subprocess.Popen]:
    import httpx

    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{' '.join(cmd[:2])} not ready after {start_timeout_s:.0f} s; see {log_path}")
            time.sleep(1)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, stop_signal)  # the group we started: the server and its workers
        try:
            proc.wait(45)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        proc.wait()
        log.close()


@contextlib.contextmanager
def peer_server(
    model_dir: str, port: int, log_path: Path, start_timeout_s: float = 300.0, threads: Optional[int] = None
) -> Iterator[str]:
    """`transformers serve MODEL_DIR --continuous-batching` (fp32, CPU); yields its base URL.
    `threads`: its torch threads (OMP_NUM_THREADS); None: torch's default, every core."""
    exe = Path(sys.executable).parent / "transformers"
    cmd = [
        str(exe),
        "serve",
        model_dir,
        "--continuous-batching",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    with process_group(cmd, url, log_path, start_timeout_s, signal.SIGTERM, env=env):
        yield url


def run_config(config_path: str, port: int, args_update: Optional[Dict[str, dict]] = None) -> dict:
    """The serve config at `config_path` served on 127.0.0.1:`port`, with `args_update`'s sections
    (e.g. {"engine": {"num_threads": 1}}) merged into the first application's args."""
    config = yaml.safe_load(Path(config_path).read_text())
    config.setdefault("http_options", {}).update({"host": "127.0.0.1", "port": port})
    app_args = config["applications"][0].setdefault("args", {})
    for section, values in (args_update or {}).items():
        app_args.setdefault(section, {}).update(values)
    return config


@contextlib.contextmanager
def serve_run(
    config_path: str,
    port: int,
    log_path: Path,
    start_timeout_s: float = 300.0,
    extra_env: Optional[dict] = None,
    args_update: Optional[Dict[str, dict]] = None,
) -> Iterator[str]:
    """`serve run CONFIG` exactly as `make serve` runs it (its own local Ray cluster), on `port`
    instead of the config's (and with `args_update`, see run_config); yields the application's base
    URL. Stopped with Ctrl-C (SIGINT)."""
    config = run_config(config_path, port, args_update)
    copy = log_path.with_name(log_path.stem + ".serve_config.yaml")
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(yaml.safe_dump(config, sort_keys=False))
    route = (config["applications"][0].get("route_prefix") or "/").rstrip("/")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a new cluster, never a user's
    env.update(extra_env or {})
    cmd = [str(Path(sys.executable).parent / "serve"), "run", str(copy)]
    url = f"http://127.0.0.1:{port}{route}"
    with process_group(cmd, url, log_path, start_timeout_s, signal.SIGINT, env=env):
        yield url

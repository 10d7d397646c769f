"""llama.cpp's server as an outside peer: the CPU user's usual pick, serving the embedded model's own
4-bit GGUF (`SmolLM2-135M-Instruct.Q4_1.gguf`, the file the embedded model is converted from).

`llamacpp_server(port, log)` runs `python -m load_tests.llamacpp_server` in its own process group (the
`xllamacpp` wheel, from the bench extra, embeds llama.cpp's C++ server: OpenAI API, `/health`,
continuous batching over parallel slots), yields its base URL once `/health` answers 200 (it answers
503 while the model loads), and stops the group when the block ends, on an error or Ctrl-C too.
It needs more HTTP threads than concurrent connections, or it drops the extra ones (requests past the
slots wait in its queue, each holding an HTTP thread); each of `slots`
slots holds `ctx_per_slot` tokens of KV (f16), so 64 x 1024 tokens take about 1.5 GB.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

from batcher.model_files import embedded_gguf
from load_tests.servers import process_group

DEFAULT_THREADS = 2
DEFAULT_SLOTS = 64
DEFAULT_CTX_PER_SLOT = 1024


def server_params(model_path: str, port: int, threads: int, slots: int, ctx_per_slot: int, http_threads: Optional[int]):
    """xllamacpp's CommonParams for llama.cpp's server on 127.0.0.1:`port`."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = model_path
    params.port = port
    params.hostnames = ["127.0.0.1"]
    params.n_parallel = slots
    # Split evenly over the slots; the default (0) gives every slot the model's full 8192 tokens.
    params.n_ctx = slots * ctx_per_slot
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.n_threads_http = http_threads or 4 * slots
    return params


@contextlib.contextmanager
def llamacpp_server(
    port: int,
    log_path: Path,
    model_path: Optional[str] = None,
    threads: int = DEFAULT_THREADS,
    slots: int = DEFAULT_SLOTS,
    ctx_per_slot: int = DEFAULT_CTX_PER_SLOT,
    http_threads: Optional[int] = None,
    start_timeout_s: float = 300.0,
) -> Iterator[str]:
    """llama.cpp's server on 127.0.0.1:`port` (default model: the embedded GGUF), `threads` compute
    threads, `slots` parallel sequences, `http_threads` (default 4 x slots; more than the connections
    a caller ever holds at once); yields its base URL."""
    if model_path is None:
        model_path = str(embedded_gguf())
    cmd = [
        sys.executable,
        "-m",
        "load_tests.llamacpp_server",
        "--model",
        model_path,
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--slots",
        str(slots),
        "--ctx-per-slot",
        str(ctx_per_slot),
    ]
    if http_threads:
        cmd += ["--http-threads", str(http_threads)]
    with process_group(cmd, f"http://127.0.0.1:{port}", log_path, start_timeout_s, signal.SIGTERM):
        yield f"http://127.0.0.1:{port}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m load_tests.llamacpp_server", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file; default: the embedded model's")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    p.add_argument("--slots", type=int, default=DEFAULT_SLOTS)
    p.add_argument("--ctx-per-slot", type=int, default=DEFAULT_CTX_PER_SLOT)
    p.add_argument("--http-threads", type=int, default=None)
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it at once, as SIGTERM does
    import xllamacpp

    if args.model is None:
        args.model = str(embedded_gguf())
    params = server_params(args.model, args.port, args.threads, args.slots, args.ctx_per_slot, args.http_threads)
    server = xllamacpp.Server(params)  # returns once the model is loaded; HTTP runs on its own threads
    print(f"llama.cpp server ready on {server.listening_address}", flush=True)
    signal.pause()  # until SIGTERM or SIGINT ends the process (their default action: no Python teardown)


if __name__ == "__main__":
    main()

"""Call a running iterserve app from another Ray job, through a Serve handle (no HTTP).

Start the app first (`make serve`, or `ray start --head`, `export RAY_AUTH_MODE=token`, `serve deploy serve_config.yaml`), then:

    python examples/handle_client.py --prompt "What is the capital of France?"

Requests and responses are typed pydantic models (deployments/protocol.py): GenerateRequest in,
GenerateResponse back (non-streaming) or GenerateChunk after GenerateChunk (streaming). Errors
arrive as deployments.errors.APIError with an HTTP-like status_code.
"""

from __future__ import annotations

import argparse
import json

import ray
from ray import serve

from deployments.errors import APIError
from deployments.protocol import ChatMessage, GenerateChunk, GenerateRequest, GenerateResponse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--app", default="iterserve", help="Serve application name (serve_config.yaml: iterserve)")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    args = ap.parse_args()

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)  # joins the running cluster
    handle = serve.get_app_handle(args.app)

    request = GenerateRequest(
        messages=[ChatMessage(role="user", content=args.prompt)], max_tokens=args.max_tokens, temperature=0.0
    )

    # Non-streaming: one typed response.
    response: GenerateResponse = handle.generate.remote(request).result()
    print(f"[generate] {response.text!r} ({response.completion_tokens} tokens, {response.finish_reason})")

    # Streaming: typed chunks as they are generated (the first token comes alone, at once).
    chunks: list[GenerateChunk] = []
    print("[stream]   ", end="", flush=True)
    for chunk in handle.options(stream=True).stream.remote(request):
        print(chunk.text, end="", flush=True)
        chunks.append(chunk)
    print(f"  ({len(chunks)} chunks, {chunks[-1].finish_reason})")

    # Errors are typed too.
    try:
        handle.generate.remote(GenerateRequest(prompt="hi", max_tokens=10**7)).result()
    except APIError as e:
        print(f"[error]    {e.status_code} {e.code}: {e.message}")

    if args.json:
        print(
            json.dumps(
                {
                    "text": response.text,
                    "streamed_text": "".join(c.text for c in chunks),
                    "num_chunks": len(chunks),
                    "first_chunk_tokens": len(chunks[0].token_ids),
                    "completion_tokens": response.completion_tokens,
                }
            )
        )


if __name__ == "__main__":
    main()

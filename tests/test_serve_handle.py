"""Python callers: typed requests through the app handle, from this driver and from another Ray job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from ray import serve

from deployments.errors import APIError
from deployments.protocol import ChatMessage, GenerateChunk, GenerateRequest, GenerateResponse

ROOT = Path(__file__).resolve().parent.parent


def test_typed_generate_and_stream(tiny_app):
    handle = serve.get_app_handle("tiny")
    request = GenerateRequest(prompt="Hello there", max_tokens=20, temperature=0, ignore_eos=True)
    response = handle.generate.remote(request).result()
    assert isinstance(response, GenerateResponse)
    assert response.completion_tokens == len(response.token_ids) == 20 and response.finish_reason == "length"

    chunks = list(handle.options(stream=True).stream.remote(request))
    assert all(isinstance(c, GenerateChunk) for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == response.token_ids
    assert "".join(c.text for c in chunks) == response.text
    assert len(chunks[0].token_ids) == 1  # the first token is flushed alone
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


def test_typed_errors_through_the_handle(tiny_app):
    handle = serve.get_app_handle("tiny")
    with pytest.raises(APIError) as info:
        handle.generate.remote(GenerateRequest(prompt="hi", max_tokens=10_000)).result()
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as info:
        list(handle.options(stream=True).stream.remote(GenerateRequest(prompt=[10**9], max_tokens=2)))
    assert info.value.status_code == 400


def test_second_ray_job_streams_through_the_app_handle(tiny_app):
    """examples/handle_client.py as a separate driver: ray.init(address="auto") + get_app_handle."""
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "handle_client.py"),
            "--app",
            "tiny",
            "--prompt",
            "Hi",
            "--max-tokens",
            "12",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["streamed_text"] == summary["text"]  # greedy: both calls give the same answer
    assert summary["num_chunks"] >= 2 and summary["first_chunk_tokens"] == 1
    assert "[error]    400 context_length_exceeded" in proc.stdout

    expected = (
        serve.get_app_handle("tiny")
        .generate.remote(
            GenerateRequest(messages=[ChatMessage(role="user", content="Hi")], max_tokens=12, temperature=0)
        )
        .result()
    )
    assert summary["text"] == expected.text

"""`serve_config.gpu.yaml` on a GPU, as a user deploys it: `python -m load_tests.gpu_serve`.

The file's application (bf16, `auto` attention and compile: Triton and CUDA graphs, LLMRouter,
QueueDepthPolicy) on a local Ray cluster with Serve on loopback, with three changes a one-GPU machine
without hub access needs: a random-weight model directory built from `--config` (with one PEFT
adapter, to serve LoRA too), max_replicas and the ingress's replicas at 1. Over real HTTP: a chat
answer, a stream (SSE to `[DONE]`, Server-Timing), `--concurrency` streams at once (all 200, tokens/s),
the adapter by name, a JSON-schema answer that parses, a bad request's 400 with the server serving on.
Prints a table, writes JSON (--out), shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import httpx
import torch
import yaml

from load_tests.gpu_features import ITEM_SCHEMA, is_item, make_adapters
from load_tests.gpu_forward import CONFIGS, build_model_dir

ROOT = Path(__file__).resolve().parent.parent


def app_config(model_dir: Path, adapters: Dict[str, str], device: str) -> dict:
    cfg = yaml.safe_load((ROOT / "serve_config.gpu.yaml").read_text())["applications"][0]["args"]
    cfg["engine"].update(
        model=str(model_dir),
        device=device,
        max_model_len=1024,
        lora={"adapters": adapters, "max_loras": 2},
        kv_cache_memory_gib=8.0 if device == "cuda" else 0.25,
    )
    cfg["served_model_name"] = "random-1b"
    if device != "cuda":
        cfg["replica"]["num_gpus"] = 0
    cfg["ingress"]["num_replicas"] = 1
    cfg["autoscaling"]["max_replicas"] = 1  # one GPU
    return cfg


def chat(model: str, text: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, **kw}


async def checks(url: str, concurrency: int) -> List[Dict]:
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        t0 = time.perf_counter()
        r = await c.post("/v1/chat/completions", json=chat("random-1b", "Hello there", max_tokens=16))
        body = r.json()
        rows.append(
            {
                "check": "chat answer",
                "status": r.status_code,
                "ok": r.status_code == 200 and body["usage"]["completion_tokens"] > 0,
                "detail": f"{time.perf_counter() - t0:.2f} s, usage {body.get('usage')}",
            }
        )
        async with c.stream(
            "POST", "/v1/chat/completions", json=chat("random-1b", "Count", max_tokens=32, stream=True)
        ) as s:
            lines = [line async for line in s.aiter_lines() if line.startswith("data: ")]
            timing = s.headers.get("server-timing", "")
        rows.append(
            {
                "check": "stream",
                "status": s.status_code,
                "ok": s.status_code == 200 and lines[-1] == "data: [DONE]" and "replica-ttft" in timing,
                "detail": f"{len(lines)} events; Server-Timing: {timing}",
            }
        )

        async def one(i: int) -> int:
            body = chat("random-1b", f"Request {i}: tell me a story", max_tokens=128)
            body["ignore_eos"] = True
            r = await c.post("/v1/chat/completions", json=body)
            return r.json()["usage"]["completion_tokens"] if r.status_code == 200 else -r.status_code

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(i) for i in range(concurrency)))
        s = time.perf_counter() - t0
        rows.append(
            {
                "check": f"{concurrency} requests at once x 128 tokens",
                "status": 200 if min(got) > 0 else min(got),
                "ok": all(g == 128 for g in got),
                "detail": f"{s:.2f} s, {sum(max(g, 0) for g in got) / s:.0f} tokens/s over HTTP",
            }
        )
        base = await c.post("/v1/chat/completions", json=chat("random-1b", "Hello there", max_tokens=16))
        lora = await c.post("/v1/chat/completions", json=chat("a", "Hello there", max_tokens=16))
        lb, bb = lora.json(), base.json()
        rows.append(
            {
                "check": "LoRA adapter 'a'",
                "status": lora.status_code,
                "ok": lora.status_code == 200
                and lb["model"] == "a"
                and lb["choices"][0]["message"]["content"] != bb["choices"][0]["message"]["content"],
                "detail": f"adapter {lb['choices'][0]['message']['content'][:40]!r} vs base {bb['choices'][0]['message']['content'][:40]!r}",
            }
        )
        fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM_SCHEMA, "strict": True}}
        r = await c.post(
            "/v1/chat/completions", json=chat("random-1b", "An item as JSON", max_tokens=40, response_format=fmt)
        )
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""
        rows.append(
            {"check": "response_format json_schema", "status": r.status_code, "ok": is_item(text), "detail": text[:60]}
        )
        r = await c.post("/v1/chat/completions", json=chat("random-1b", "x", max_tokens=-1))
        after = await c.get("/v1/models")
        rows.append(
            {
                "check": "bad request, then serving on",
                "status": r.status_code,
                "ok": r.status_code == 400 and "error" in r.json() and after.status_code == 200,
                "detail": r.json().get("error", {}).get("message", "")[:80],
            }
        )
    return rows


def _gpu_memory_mib() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi unavailable"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIGS / "llama-1b-like.json")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of the config's family")
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-cpus", type=float, default=8)
    ap.add_argument("--device", default="cuda", help="the engine's device (cpu: try this here, slowly)")
    ap.add_argument("--out", type=Path, default=Path("results/gpu_serve.json"))
    a = ap.parse_args()
    from cluster.local_serve import local_serve

    report: Dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(a.config, a.tiny, torch.device("cpu"), Path(tmp) / "model", a.tokenizer)
        adapters = make_adapters(model, Path(tmp) / "adapters", torch.device("cpu"), names=["a"])
        cfg = app_config(model, adapters, a.device)
        with local_serve(num_cpus=a.num_cpus) as srv:
            t0 = time.perf_counter()
            url = srv.deploy("gpu", cfg)
            report["deploy_s"] = round(time.perf_counter() - t0, 1)
            report["gpu_memory_used"] = _gpu_memory_mib()
            report["checks"] = asyncio.run(checks(url, a.concurrency))
    print(f"deployed in {report['deploy_s']} s; GPU memory used: {report['gpu_memory_used']}")
    print("check | status | ok | detail")
    for r in report["checks"]:
        print(f"{r['check']} | {r['status']} | {r['ok']} | {r['detail']}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

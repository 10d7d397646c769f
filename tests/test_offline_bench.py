"""The offline benchmark: workload generation, report arithmetic, and one tiny end-to-end run."""

from __future__ import annotations

import json

import pytest

from load_tests.offline_report import add_ratios, check_targets, format_cap, format_targets
from load_tests.workload import capped_lengths, representative_subset, variance_workloads


def test_workloads_are_seeded_and_capped():
    caps = [8, 32, 128]
    a = variance_workloads(caps, num_prompts=50, prompt_len=12, mean_output=32, token_range=(17, 1000), seed=3)
    b = variance_workloads(caps, num_prompts=50, prompt_len=12, mean_output=32, token_range=(17, 1000), seed=3)
    assert a == b
    c = variance_workloads(caps, num_prompts=50, prompt_len=12, mean_output=32, token_range=(17, 1000), seed=4)
    assert c[0].requests != a[0].requests
    for cap, w in zip(caps, a):
        assert len(w.requests) == 50
        assert all(len(r.prompt_token_ids) == 12 for r in w.requests)
        assert all(17 <= t < 1000 for r in w.requests for t in r.prompt_token_ids)
        assert all(1 <= r.max_tokens <= cap for r in w.requests)
    # Same prompts and the same underlying draw across caps: only the cap changes.
    for small, large in zip(a, a[1:]):
        assert small.cap < large.cap
        for rs, rl in zip(small.requests, large.requests):
            assert rs.prompt_token_ids == rl.prompt_token_ids
            assert rs.max_tokens == min(rl.max_tokens, small.cap)
    assert capped_lengths([0.0, 0.2, 7.5, 500.0], cap=8) == [1, 1, 8, 8]


def test_representative_subset_spans_the_length_distribution():
    w = variance_workloads([128], num_prompts=128, seed=0)[0]
    idx = representative_subset(w, 16)
    assert len(idx) == len(set(idx)) == 16 and idx == sorted(idx)
    full_mean = w.output_tokens / 128
    sub_mean = sum(w.requests[i].max_tokens for i in idx) / 16
    assert abs(sub_mean - full_mean) / full_mean < 0.15
    assert representative_subset(w, 500) == list(range(128))


def _entry(tps, **metrics):
    return {
        "num_requests": 4,
        "output_tokens": 40,
        "wall_seconds": 40 / tps,
        "tokens_per_second": tps,
        "length_errors": 0,
        "metrics": metrics,
    }


def test_ratios_and_targets():
    systems = {
        "hf_naive": _entry(10.0),
        "hf_static16": _entry(20.0),
        "transformers_cb": _entry(30.0),
        "engine_continuous": _entry(50.0, forward_share=0.9, kv_slot_use=0.9),
        "engine_fast": _entry(90.0),
    }
    add_ratios(systems)
    assert systems["engine_continuous"]["ratios"] == pytest.approx(
        {"vs_naive": 5.0, "vs_static16": 2.5, "vs_transformers_cb": 50 / 30}
    )  # never against itself
    assert systems["engine_fast"]["ratios"]["vs_engine_eager"] == pytest.approx(1.8)
    checks = {c["metric"]: c["met"] for c in check_targets(systems, 128)}
    assert checks == {
        "vs_naive": True,
        "vs_static16": True,
        "vs_transformers_cb": True,
        "forward_share": True,
        "kv_slot_use": False,
        "vs_engine_eager": False,
    }
    text = format_cap(
        {
            "cap": 128,
            "workload": {
                "num_requests": 4,
                "prompt_tokens": 16,
                "output_tokens": 40,
                "output_len_mean": 10.0,
                "output_len_max": 20,
            },
            "systems": systems,
        }
    )
    assert "iterserve engine, continuous" in text and "5.00x" in text
    assert "MISSED" in format_targets(check_targets(systems, 128))


def _embedded_tokenizer_present() -> bool:
    from batcher.model_files import EMBEDDED_MODEL, cache_home

    return (cache_home() / "models" / EMBEDDED_MODEL / "model.safetensors").exists()


@pytest.mark.skipif(not _embedded_tokenizer_present(), reason="needs the converted embedded model's tokenizer")
def test_offline_end_to_end_tiny(tmp_path):
    from load_tests.offline import main

    out = tmp_path / "offline.json"
    assert (
        main(
            [
                "--model",
                "tiny-llama",
                "--num-prompts",
                "6",
                "--prompt-len",
                "8",
                "--mean-output",
                "6",
                "--caps",
                "4,12",
                "--naive-subset",
                "3",
                "--num-kv-blocks",
                "128",
                "--max-num-seqs",
                "16",
                "--max-num-batched-tokens",
                "64",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["cap"] for r in report["results"]] == [4, 12]
    for cap_result in report["results"]:
        systems = cap_result["systems"]
        assert set(systems) == {
            "hf_naive",
            "hf_static16",
            "transformers_cb",
            "engine_static",
            "engine_continuous",
            "engine_fast",
        }
        assert systems["hf_naive"]["num_requests"] == 3 and systems["hf_naive"]["subset"]
        for entry in systems.values():
            assert entry["length_errors"] == 0  # every request produced exactly its requested tokens
        assert systems["hf_static16"]["output_tokens"] == cap_result["workload"]["output_tokens"]
        assert 0 < systems["engine_continuous"]["metrics"]["kv_slot_use"] <= 1
    assert {c["metric"] for c in report["targets"]} >= {"vs_naive", "forward_share", "kv_slot_use", "vs_engine_eager"}

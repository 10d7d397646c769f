"""The multi-LoRA fleet benchmark (load_tests/lora_fleet_bench.py): its plan, and one smallest run on real Serve."""

from __future__ import annotations

import json

import pytest

from deployments.config import AppConfig
from load_tests import lora_fleet_bench as bench


def test_fleets_give_both_systems_the_same_threads_and_adapters():
    args = bench.parse_args(["--adapters", "1,8,32", "--cpus", "2"])
    paths = {f"a{i}": f"/adapters/a{i}" for i in range(32)}
    plan = {k: bench.fleets(args, paths, k) for k in args.adapters}
    for k, by_system in plan.items():
        (mux,) = by_system["multiplexed"].values()
        assert mux["engine"]["lora"]["adapters"] == {f"a{i}": f"/adapters/a{i}" for i in range(k)}
        assert mux["engine"]["lora"]["max_loras"] == min(k, 8) and mux["engine"]["lora"]["max_cpu_loras"] == k
        assert mux["engine"]["num_threads"] == 2 and mux["replica"]["num_replicas"] == 1
        for cfg in (c for configs in by_system.values() for c in configs.values()):
            AppConfig(**cfg)  # every config deploys as written
    assert "per-adapter" not in plan[32]  # 32 replicas + 32 ingresses: over --per-adapter-max-k
    per = plan[8]["per-adapter"]
    assert sorted(a for c in per.values() for a in c["engine"]["lora"]["adapters"]) == sorted(f"a{i}" for i in range(8))
    assert {c["engine"]["num_threads"] for c in per.values()} == {1}  # 8 one-thread replicas share the 2 cores
    assert [c["engine"]["num_threads"] for c in plan[1]["per-adapter"].values()] == [2]


def test_workload_is_seeded_round_robin_and_shared_by_the_systems():
    args = bench.parse_args(["--seed", "3"])
    work = bench.workload(args, 8, 20, 32)
    assert work == bench.workload(args, 8, 20, 32)
    assert [a for a, _ in work] == [f"a{i % 8}" for i in range(20)]
    assert all(r.max_tokens == 32 and r.ignore_eos for _, r in work)
    assert len({r.messages[0]["content"] for _, r in work}) == 20
    assert bench.workload(args, 8, 20, 2, salt="warmup") != work


def test_comparison_is_multiplexed_over_per_adapter():
    mux = {
        "output_tokens_per_s": 300.0,
        "output_tokens_per_cpu_s": 100.0,
        "ttft_ms_p50": 50.0,
        "answers": ["x", "y", "z"],
    }
    per = {
        "output_tokens_per_s": 100.0,
        "output_tokens_per_cpu_s": 50.0,
        "ttft_ms_p50": 100.0,
        "answers": ["x", "q", "z"],
    }
    c = bench.compare({"multiplexed": mux, "per-adapter": per})
    assert c == {
        "throughput_ratio": 3.0,
        "per_cpu_s_ratio": 2.0,
        "ttft_p50_ratio": 0.5,
        "answers_equal": 2,
        "answers": 3,
    }
    assert bench.compare({"multiplexed": mux}) == {}


@pytest.mark.slow
def test_smallest_run_on_real_serve(serve_cluster, tmp_path):
    """One adapter (tiny-llama, fp32), both systems on the session's Serve: every request answered with
    exactly max_tokens tokens, the same greedy answers from both (the same weights and engine config at
    K=1), a throughput ratio reported, the apps deleted afterwards."""
    from ray import serve

    out = tmp_path / "fleet.json"
    result = bench.main(
        [
            "--model",
            "tiny-llama",
            "--dtype",
            "float32",
            "--adapters",
            "1",
            "--num-requests",
            "6",
            "--concurrency",
            "3",
            "--max-tokens",
            "4",
            "--adapters-dir",
            str(tmp_path / "adapters"),
            "--json",
            str(out),
        ],
        server=serve_cluster.server,
    )
    assert json.loads(out.read_text())["results"]["1"]["comparison"]["answers"] == 6
    res = result["results"][1]
    for system in bench.SYSTEMS:
        m = res["systems"][system]
        assert m["failed"] == 0 and m["requests"] == 6 and m["output_tokens"] == 6 * 4, m["failures"]
        assert m["output_tokens_per_s"] > 0 and m["ttft_ms_p50"] > 0
        assert m["fleet_cpu_s"] > 0  # the fleet's processes were found by their titles
    assert res["comparison"]["answers_equal"] == 6
    assert res["comparison"]["throughput_ratio"] > 0
    assert not {"mux1", "k1a0"} & set(serve.status().applications)

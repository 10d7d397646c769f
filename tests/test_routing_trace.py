"""The routing benchmark's workloads: the trace's infinite-cache yardstick, how busy a trace keeps a
fleet, when chat users arrive (plain data, no Ray), and the trace requests it refuses to send."""

import pytest

from load_tests.routing import prefill_load, targets
from load_tests.routing_chats import chat_starts
from load_tests.routing_trace import infinite_cache_share, trace_workload


def test_the_infinite_cache_serves_each_prompts_longest_earlier_prefix_of_full_blocks():
    shared = list(range(100, 116))  # two blocks of 8
    prompts = [shared + [1, 2, 3], shared + [4, 5], shared[:8] + [6] * 9, shared[:8]]
    # 0, 16, 8, and none of the last: a lookup never covers the block holding the prompt's last
    # token (its logits must be computed), as in the engine
    assert infinite_cache_share(prompts, 8) == pytest.approx((0 + 16 + 8 + 0) / (19 + 18 + 17 + 8))


def window(speedup: float, token_scale: float = 1 / 64):
    return trace_workload(
        "mooncake_conversation", 0.0, 120.0, speedup, 1.0, token_scale, 1 / 16, 32, 1900, block_size=8
    )


def test_a_trace_keeps_a_fleet_as_busy_as_its_uncached_tokens_against_the_presets_prefill():
    slow, fast = window(3.0), window(6.0)
    assert fast.infinite_cache_share == pytest.approx(slow.infinite_cache_share)
    rate = slow.description["uncached_prompt_tokens_per_s"]
    assert fast.description["uncached_prompt_tokens_per_s"] == pytest.approx(2 * rate, rel=0.02)
    # Twice the arrivals, twice the load; twice the replicas, half of it; a costlier prefill, more.
    cpu = prefill_load(slow, "cpu-smollm2", 4)
    assert prefill_load(fast, "cpu-smollm2", 4) == pytest.approx(2 * cpu, rel=0.02)
    assert prefill_load(slow, "cpu-smollm2", 8) == pytest.approx(cpu / 2)
    gpu = prefill_load(slow, "h100-qwen2.5-32b-fp8", 4)
    assert cpu > 10 * gpu
    assert prefill_load(window(3.0, 1 / 4), "h100-qwen2.5-32b-fp8", 4) > 2 * gpu  # longer prompts, busier


def test_the_trace_workload_spreads_a_ticks_requests_unless_asked_to_send_them_at_the_tick():
    import numpy as np

    spread = np.array(window(3.0).arrivals)
    together = np.array(
        trace_workload(
            "mooncake_conversation", 0.0, 120.0, 3.0, 1.0, 1 / 64, 1 / 16, 32, 1900, block_size=8, at_ticks=True
        ).arrivals
    )
    assert len(np.unique(together)) <= 41 < len(together)  # 120 s of 3 s ticks, all of a tick's at once
    assert len(np.unique(spread)) == len(spread)


def test_chat_users_who_think_arrive_spread_and_a_closed_loop_sends_everyone_at_once():
    assert chat_starts(16, 0.0, seed=0) is None  # run_load sends every session at t=0
    starts = chat_starts(16, 3.0, seed=0)
    assert starts == sorted(starts) == chat_starts(16, 3.0, seed=0)  # in order, seeded: each router meets the same
    assert 0.0 <= starts[0] and starts[-1] <= 3.0 and len(set(starts)) == 16
    assert starts[-1] - starts[0] > 1.5  # spread over the think time, not a crowd


def test_balance_is_a_target_only_where_each_replica_has_requests_in_flight():
    def run(per_replica):
        return {
            "failed": 0,
            "cached_share": 0.9,
            "ttft_ms_p90": 50.0,
            "inflight_max_over_mean": 2.8,
            "inflight_per_replica": per_replica,
        }

    loaded = dict(targets("skew", {"llm-router": run(4.0), "serve-default": run(4.0)}))
    assert loaded["max/mean in-flight <= 1.5"] is False
    light = dict(targets("skew", {"llm-router": run(0.3), "serve-default": run(0.3)}))
    assert "max/mean in-flight <= 1.5" not in light and light["nothing failed"]


def test_the_benchmark_refuses_trace_requests_longer_than_the_presets_context(monkeypatch, capsys):
    import deployments.app
    from load_tests.routing import main

    def deployed(*_):
        raise AssertionError("the benchmark got past its arguments")

    monkeypatch.setattr(deployments.app, "build_app", deployed)
    with pytest.raises(SystemExit) as refused:  # 8,192 tokens: a cut at 11,200 let 657 of 1,750 fail
        main(["--workloads", "trace", "--preset", "h100-llama3-8b-measured", "--trace-max-prompt", "11200"])
    assert refused.value.code == 2
    assert "context of 8192 tokens" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="got past"):  # the 8B commands' cut fits
        main(["--workloads", "trace", "--preset", "h100-llama3-8b-measured", "--trace-max-prompt", "8000"])

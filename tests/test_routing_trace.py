"""The routing benchmark's trace workload: the infinite-cache yardstick and how busy a trace keeps a
fleet (plain data, no Ray)."""
import pytest

from load_tests.routing import prefill_load
from load_tests.routing_trace import infinite_cache_share, trace_workload


def test_the_infinite_cache_serves_each_prompts_longest_earlier_prefix_of_full_blocks():
    shared = list(range(100, 116))  # two blocks of 8
    prompts = [shared + [1, 2, 3], shared + [4, 5], shared[:8] + [6] * 9, shared[:8]]
    # 0, 16, 8, and none of the last: a lookup never covers the block holding the prompt's last
    # token (its logits must be computed), as in the engine
    assert infinite_cache_share(prompts, 8) == pytest.approx((0 + 16 + 8 + 0) / (19 + 18 + 17 + 8))


def window(speedup: float, token_scale: float = 1 / 64):
    return trace_workload("mooncake_conversation", 0.0, 120.0, speedup, 1.0, token_scale, 1 / 16, 32, 1900,
                          block_size=8)


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
    together = np.array(trace_workload("mooncake_conversation", 0.0, 120.0, 3.0, 1.0, 1 / 64, 1 / 16, 32, 1900,
                                       block_size=8, at_ticks=True).arrivals)
    assert len(np.unique(together)) <= 41 < len(together)  # 120 s of 3 s ticks, all of a tick's at once
    assert len(np.unique(spread)) == len(spread)

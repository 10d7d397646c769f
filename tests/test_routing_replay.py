"""The routing benchmark's replay of decisions through the step-time model (plain data, no Ray)."""
import pytest

from batcher.simulated import StepTimeModel
from load_tests.routing_replay import assigned, exact_loads, replay
from router.scoring import EngineShape

STEP = StepTimeModel(fixed_s=0.01, prefill_token_s=1e-4, decode_seq_s=1e-3, context_token_s=0.0)
SHAPE = EngineShape(block_size=8, max_num_batched_tokens=100, max_num_seqs=4)


def test_prompts_queue_in_arrival_order_in_chunks_and_decodes_ride_along():
    a, b = list(range(150)), list(range(1000, 1050))
    out = replay([a, b], [3, 2], [0.0, 0.0], assigned(["r", "r"]), STEP, SHAPE, 1)
    # a: 100 tokens, then its last 50 with b's first 50 (a's first token ends that step); b's
    # prompt is done in that step too.
    first = STEP.step_seconds(100, 0, 0)
    second = first + STEP.step_seconds(100, 0, 0)
    assert out.ttft_s == pytest.approx([second, second])
    assert out.cached_tokens == [0, 0]


def test_a_prefix_is_cached_only_on_the_replica_that_computed_it():
    shared = list(range(64))
    prompts = [shared + [1], shared + [2], shared + [3]]
    out = replay(prompts, [1, 1, 1], [0.0, 1.0, 2.0], assigned(["x", "x", "y"]), STEP, SHAPE, 2)
    assert out.cached_tokens == [0, 64, 0]  # the second on the holder, the third elsewhere
    assert out.ttft_s[1] == pytest.approx(STEP.step_seconds(1, 0, 0))
    assert out.ttft_s[2] == pytest.approx(STEP.step_seconds(65, 0, 0))


def test_exact_loads_spread_a_burst_that_one_replica_would_queue():
    prompts = [list(range(i * 1000, i * 1000 + 400)) for i in range(8)]
    arrivals, tokens = [0.001 * i for i in range(8)], [4] * 8
    piled = replay(prompts, tokens, arrivals, assigned(["a"] * 8), STEP, SHAPE, 4)
    spread = replay(prompts, tokens, arrivals, exact_loads(prompts, tokens, STEP, SHAPE), STEP, SHAPE, 4)
    assert spread.ttft_ms(90) < piled.ttft_ms(90) / 2


def test_the_benchmark_prints_the_replayed_ttfts_beside_the_measured_ones(capsys):
    from load_tests.routing import report

    row = {"requests": 10, "failed": 0, "cached_share": 0.3, "ttft_ms_p50": 300.0, "ttft_ms_p90": 500.0,
           "ttft_ms_p99": 700.0, "output_tokens_per_s": 100.0, "inflight_max_over_mean": 1.2,
           "infinite_cache_share": 0.3, "prefill_load": 0.5, "exact_loads_ttft_ms_p50": 180.0,
           "exact_loads_ttft_ms_p90": 380.0}
    results = {4: {"trace": {"serve-default": {**row, "modelled_ttft_ms_p50": 290.0, "modelled_ttft_ms_p90": 690.0,
                                               "outside_engine_ms_p50": 70.0, "outside_engine_ms_p90": 120.0},
                             "llm-router": {**row, "modelled_ttft_ms_p50": 200.0, "modelled_ttft_ms_p90": 401.0,
                                            "outside_engine_ms_p50": 81.0, "outside_engine_ms_p90": 150.0}}}}
    report(results, "h100-llama3-8b")
    out = capsys.readouterr().out
    assert ("serve-default        replayed p50 290 / p90 690 ms, exact loads p50 180 / p90 380 ms, "
            "outside p50 70 / p90 120 ms") in out
    assert "llm-router           replayed p50 200 / p90 401 ms" in out and "outside p50 81 / p90 150 ms" in out


def test_a_chat_run_replays_each_turn_with_its_history_in_send_order():
    from batcher.model_loader import load_tokenizer
    from deployments.prompts import prompt_token_ids
    from deployments.protocol import GenerateRequest
    from load_tests.bench_client import BenchRecord, BenchRequest
    from load_tests.routing_replay import REPLICA_HEADER, chat_turns

    tok = load_tokenizer("smollm2-135m-instruct")
    work = [BenchRequest(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}],
                         followups=("More.",), max_tokens=5),
            BenchRequest(messages=[{"role": "user", "content": "Other."}], max_tokens=7)]
    rec = lambda i, turn, t, answer, replica, ok=True: BenchRecord(
        index=i, turn=turn, start_s=t, status=200 if ok else 0, ttft_s=0.1, output_text=answer,
        headers={REPLICA_HEADER: replica})
    records = [rec(0, 0, 0.0, "Hello.", "a"), rec(1, 0, 0.5, None, "b", ok=False), rec(0, 1, 1.0, "Sure.", "b")]
    prompts, budgets, sent, replicas, ttfts = chat_turns(work, records, tok)
    assert sent == [0.0, 1.0] and replicas == ["a", "b"] and budgets == [5, 5]  # the failed turn left out
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More."}]
    assert prompts[1] == prompt_token_ids(tok, GenerateRequest(messages=second))
    assert prompts[1][:len(prompts[0])] == prompts[0]  # a later turn extends the earlier one's prompt

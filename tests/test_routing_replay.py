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

    row = {
        "requests": 10,
        "failed": 0,
        "cached_share": 0.3,
        "ttft_ms_p50": 300.0,
        "ttft_ms_p90": 500.0,
        "ttft_ms_p99": 700.0,
        "output_tokens_per_s": 100.0,
        "inflight_max_over_mean": 1.2,
        "infinite_cache_share": 0.3,
        "prefill_load": 0.5,
        "exact_loads_ttft_ms_p50": 180.0,
        "exact_loads_ttft_ms_p90": 380.0,
    }
    results = {
        4: {
            "trace": {
                "serve-default": {
                    **row,
                    "modelled_ttft_ms_p50": 290.0,
                    "modelled_ttft_ms_p90": 690.0,
                    "outside_engine_ms_p50": 70.0,
                    "outside_engine_ms_p90": 120.0,
                },
                "llm-router": {
                    **row,
                    "modelled_ttft_ms_p50": 200.0,
                    "modelled_ttft_ms_p90": 401.0,
                    "outside_engine_ms_p50": 81.0,
                    "outside_engine_ms_p90": 150.0,
                },
            }
        }
    }
    report(results, "h100-llama3-8b")
    out = capsys.readouterr().out
    assert (
        "serve-default        replayed p50 290 / p90 690 ms, exact loads p50 180 / p90 380 ms, "
        "outside p50 70 / p90 120 ms"
    ) in out
    assert "llm-router           replayed p50 200 / p90 401 ms" in out and "outside p50 81 / p90 150 ms" in out


def test_a_chat_run_replays_each_turn_with_its_history_in_send_order():
    from batcher.model_files import load_tokenizer
    from deployments.prompts import prompt_token_ids
    from deployments.protocol import GenerateRequest
    from load_tests.bench_client import BenchRecord, BenchRequest
    from load_tests.routing_replay import REPLICA_HEADER, chat_turns

    tok = load_tokenizer("smollm2-135m-instruct")
    work = [
        BenchRequest(
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}],
            followups=("More.",),
            max_tokens=5,
        ),
        BenchRequest(messages=[{"role": "user", "content": "Other."}], max_tokens=7),
    ]
    rec = lambda i, turn, t, answer, replica, ok=True: BenchRecord(
        index=i,
        turn=turn,
        start_s=t,
        status=200 if ok else 0,
        ttft_s=0.1,
        output_text=answer,
        headers={REPLICA_HEADER: replica},
    )
    records = [rec(0, 0, 0.0, "Hello.", "a"), rec(1, 0, 0.5, None, "b", ok=False), rec(0, 1, 1.0, "Sure.", "b")]
    prompts, budgets, sent, replicas, kept = chat_turns(work, records, tok)
    assert sent == [0.0, 1.0] and replicas == ["a", "b"] and budgets == [5, 5]  # the failed turn left out
    assert kept == [records[0], records[2]]
    second = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "More."},
    ]
    assert prompts[1] == prompt_token_ids(tok, GenerateRequest(messages=second))
    assert prompts[1][: len(prompts[0])] == prompts[0]  # a later turn extends the earlier one's prompt


def test_the_server_timing_header_splits_what_a_request_spent_outside_the_model(capsys):
    from load_tests.bench_client import BenchRecord
    from load_tests.routing import report
    from load_tests.routing_replay import TIMING_HEADER, decisions_ttfts

    prompts = [list(range(i * 100, i * 100 + 50)) for i in range(4)]
    modelled = replay(prompts, [2] * 4, [0.0, 1.0, 2.0, 3.0], assigned(["a"] * 4), STEP, SHAPE, 1).ttft_s
    # Each: the client's TTFT 40 ms over the modelled one; the replica saw 10 ms more than the model,
    # the ingress spent 2 ms preparing and 8 in routing and hops (5 on the way there, 3 back), HTTP the
    # remaining 20.
    records = [
        BenchRecord(
            index=i,
            start_s=float(i),
            status=200,
            ttft_s=m + 0.040,
            headers={
                TIMING_HEADER: f"prepare;dur=2.0, replica-ttft;dur={(m + 0.010) * 1000:.3f}, ttft;dur={(m + 0.020) * 1000:.3f}, "
                "from-replica;dur=3.0"
            },
        )
        for i, m in enumerate(modelled)
    ]
    records[3] = None  # a failed request counts in none of the parts
    out = decisions_ttfts(prompts, [2] * 4, [0.0, 1.0, 2.0, 3.0], ["a"] * 4, STEP, SHAPE, 1, records)
    expected = {
        "outside_engine": 40,
        "replica_over_model": 10,
        "prepare": 2,
        "routing_and_hops": 8,
        "to_replica": 5,
        "from_replica": 3,
        "proxy_and_http": 20,
    }
    for part, ms in expected.items():
        assert out[f"{part}_ms_p50"] == pytest.approx(ms, abs=0.01) and out[f"{part}_ms_p90"] == pytest.approx(
            ms, abs=0.01
        )
    row = {
        "requests": 4,
        "failed": 1,
        "cached_share": 0.0,
        "ttft_ms_p50": 1.0,
        "ttft_ms_p90": 1.0,
        "ttft_ms_p99": 1.0,
        "output_tokens_per_s": 1.0,
        "inflight_max_over_mean": None,
        "exact_loads_ttft_ms_p50": 1.0,
        "exact_loads_ttft_ms_p90": 1.0,
    }
    report({1: {"shared": {"llm-router": {**row, **out}}}}, "h100-llama3-8b")
    assert (
        "replica - replayed p50 10 / p90 10, prepare p50 2 / p90 2, routing and hops p50 8 / p90 8, "
        "of it to the replica p50 5 / p90 5, and back p50 3 / p90 3, proxy and HTTP p50 20 / p90 20 ms"
    ) in capsys.readouterr().out


def test_rounds_pool_each_routers_requests_and_alternate_the_routers_order():
    from load_tests.bench_client import BenchRecord
    from load_tests.routing import round_order
    from load_tests.routing_metrics import RoundResult, pool_rounds, summarize
    from load_tests.routing_replay import TIMING_HEADER, decisions_ttfts

    assert [round_order(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    prompts = [list(range(i * 100, i * 100 + 50)) for i in range(3)]
    arrivals = [0.0, 1.0, 2.0]
    modelled = replay(prompts, [2] * 3, arrivals, assigned(["a"] * 3), STEP, SHAPE, 1).ttft_s

    def one_round(outside_s: float, failed: int, pushes: float) -> RoundResult:
        records = [
            BenchRecord(
                index=i,
                start_s=float(i),
                status=200,
                ttft_s=m + outside_s,
                e2e_s=m + outside_s,
                prompt_tokens=50,
                cached_tokens=10,
                headers={
                    TIMING_HEADER: f"prepare;dur=1.0, replica-ttft;dur={m * 1000:.3f}, "
                    f"ttft;dur={m * 1000 + 2:.3f}, from-replica;dur=1.0"
                },
            )
            for i, m in enumerate(modelled)
        ]
        samples = {}
        m = {
            **summarize(records + [BenchRecord(index=9, status=503)] * failed, 3.0, 1),
            **decisions_ttfts(prompts, [2] * 3, arrivals, ["a"] * 3, STEP, SHAPE, 1, records, samples),
            "index_exchange": {"pushes_per_s": pushes},
        }
        return RoundResult(m, records + [BenchRecord(index=9, status=503)] * failed, 3.0, samples)

    first, second = one_round(0.040, 0, 2.0), one_round(0.080, 1, 4.0)
    pooled = pool_rounds([first, second], 1)
    # Every request of both rounds counts once: half of them 40 ms outside the engine, half 80. The
    # mean of the rounds' percentiles would say 60 ms at p90.
    assert pooled["outside_engine_ms_p50"] == pytest.approx(60, abs=0.01)
    assert pooled["outside_engine_ms_p90"] == pytest.approx(80, abs=0.01)
    assert pooled["ttft_ms_p90"] > (first.metrics["ttft_ms_p90"] + second.metrics["ttft_ms_p90"]) / 2
    assert pooled["requests"] == 7 and pooled["failed"] == 1 and pooled["cached_share"] == pytest.approx(0.2)
    assert pooled["modelled_ttft_ms_p90"] == pytest.approx(first.metrics["modelled_ttft_ms_p90"])
    assert pooled["index_exchange"] == {"pushes_per_s": 3.0}
    assert pooled["rounds"] == [first.metrics, second.metrics]
    assert pool_rounds([first], 1) is first.metrics  # one round: as measured, nothing added
    # A round where a request failed has no replayed figures: the other rounds' still pool.
    failed = RoundResult(
        summarize([BenchRecord(index=0, status=503)], 3.0, 1), [BenchRecord(index=0, status=503)], 3.0, {}
    )
    assert pool_rounds([failed, first], 1)["outside_engine_ms_p90"] == pytest.approx(40, abs=0.01)


def test_routers_that_know_each_others_requests_at_once_decide_as_one_and_blind_ones_pile_up():
    """load_tests.routing_staleness: a burst of long unique prompts, one report before it (all idle).
    Two routers that know each other's sends at once are one router; never knowing them, each sees
    only its own sends and both pile onto the replicas that look light."""
    from load_tests.routing_staleness import stale_reports

    prompts = [list(range(i * 1000, i * 1000 + 400)) for i in range(8)]
    arrivals, tokens = [0.001 * i for i in range(8)], [4] * 8

    def run(routers, known_after_s):
        return replay(
            prompts,
            tokens,
            arrivals,
            stale_reports(prompts, tokens, STEP, SHAPE, routers, 10.0, known_after_s),
            STEP,
            SHAPE,
            4,
        )

    one, shared, blind = run(1, 0.0), run(2, 0.0), run(2, float("inf"))
    assert shared.ttft_s == one.ttft_s
    assert blind.ttft_ms(90) > one.ttft_ms(90)


def test_the_staleness_model_prints_each_delay_against_one_router(tmp_path, capsys):
    from load_tests.routing_staleness import main

    out = main(["--trace-window-s", "20", "--delays", "0,inf", "--json", str(tmp_path / "s.json")])
    assert [(r["routers"], r["known_after_s"]) for r in out["runs"]] == [(1, 0.0), (2, 0.0), (2, float("inf"))]
    # Each router keeps its own window of the requests it sent (the load bound's share, the ties), as
    # each LLMRouter does: known at once, two routers decide nearly as one; never, worse.
    one, shared, blind = (r["ttft_ms_p90"] for r in out["runs"])
    assert shared <= 1.05 * one and shared < blind
    assert "MODEL" in capsys.readouterr().out and (tmp_path / "s.json").exists()

"""The occupancy trace (real engine runs), the experiment's targets and its report with the plots."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from conftest import tiny_config

from batcher import EngineConfig, EngineInput, LLMEngine, SamplingParams
from batcher.trace import FINISHED, GENERATED, IDLE, PROMPT
from load_tests import experiment
from load_tests.bench_metrics import format_sweep
from load_tests.experiment_report import saturation_rate, targets, write_report
from load_tests.occupancy import occupancy_pair
from load_tests.workload import capped_lengths, exponential_draws, random_prompts

LENGTHS = capped_lengths(exponential_draws(12, 6.0, seed=1), 20)


def _traced_run(scheduling: str, slots: int = 4, trace_steps: int = 1000):
    engine = LLMEngine(
        EngineConfig(
            model="tiny-llama",
            num_threads=1,
            max_num_seqs=slots,
            static_batch_size=slots,
            scheduling=scheduling,
            trace_steps=trace_steps,
            num_kv_blocks=256,
        )
    )
    for i, (prompt, n) in enumerate(zip(random_prompts(12, 10, (17, 4000), seed=1), LENGTHS)):
        engine.add_request(
            EngineInput(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), request_id=f"r{i}")
        )
    while engine.has_unfinished():
        engine.step()
    return engine.trace


def _cells_of(trace, rid):
    return [
        (t, step.cells[slot]) for t, step in enumerate(trace.steps) for slot, r in step.request_ids.items() if r == rid
    ]


@pytest.mark.parametrize("scheduling", ["static", "continuous"])
def test_trace_records_each_request_prompt_generated_finished(scheduling):
    trace = _traced_run(scheduling)
    for i, n in enumerate(LENGTHS):
        cells = _cells_of(trace, f"r{i}")
        steps, kinds = [t for t, _ in cells], [k for _, k in cells]
        assert steps == list(range(steps[0], steps[0] + len(steps)))  # one slot, every step until it ends
        # The prompt step samples the first token; then one step per token; the last is the finishing one.
        assert kinds == ([FINISHED] if n == 1 else [PROMPT] + [GENERATED] * (n - 2) + [FINISHED])
        slots = {slot for step in trace.steps for slot, r in step.request_ids.items() if r == f"r{i}"}
        assert len(slots) == 1
    assert trace.num_slots <= 4 and all(len(step.cells) <= 4 for step in trace.steps)


def test_static_batches_wait_for_their_longest_member_continuous_refills():
    static, cont = _traced_run("static"), _traced_run("continuous")
    # Static: a new batch starts only when the old one has fully ended (no decode beside a prompt).
    assert all(GENERATED not in s.cells.values() for s in static.steps if PROMPT in s.cells.values())
    # Continuous: new prompts join while others decode, so the same work takes fewer steps.
    assert any(GENERATED in s.cells.values() and PROMPT in s.cells.values() for s in cont.steps)
    assert len(cont.steps) < len(static.steps)
    assert cont.utilization(4) > static.utilization(4)
    grid = static.grid(4)
    assert len(grid) == 4 and len(grid[0]) == len(static.steps) and IDLE in {c for row in grid for c in row}


def test_trace_is_bounded():
    assert len(_traced_run("continuous", trace_steps=5).steps) == 5


def test_saturation_and_targets_are_computed_from_the_rows():
    def row(rate, ttft_growth, tok_s, e2e, good):
        # 9 requests whose TTFT grows from 0.2 s by `ttft_growth` s from first to last (a growing queue)
        records = [
            {"status": 200, "error": "", "start_s": i / rate, "ttft_s": 0.2 + ttft_growth * i / 8} for i in range(9)
        ]
        return {
            "rate": rate,
            "records": records,
            "summary": {
                "output_throughput": tok_s,
                "e2e_ms": {"p50": e2e},
                "goodput": {"request_goodput": good, "slos_ms": {"ttft": 1}},
            },
        }

    static = [row(1, 0.1, 30, 900, 0.9), row(2, 3.0, 40, 3000, 0.5), row(4, 6.0, 40, 6000, 0.2)]
    cont = [row(1, 0.0, 31, 800, 0.95), row(2, 0.2, 60, 1000, 1.8), row(4, 1.5, 90, 2000, 2.5)]
    peer = [row(1, 0.1, 30, 850, 0.9), row(2, 2.0, 50, 2500, 1.0), row(4, 4.0, 52, 5000, 0.3)]
    assert saturation_rate(static) == 2 and saturation_rate(cont) == 4 and saturation_rate(cont[:2]) is None
    checks = {t["target"].split()[1]: t for t in targets({"static": static, "continuous": cont, "peer": peer})}
    assert checks[">="]["met"] and checks[">="]["value"] == pytest.approx(90 / 40)
    assert checks["p50"]["met"] and checks["goodput"]["met"] and checks["goodput"]["value"] == pytest.approx(1.8)
    cont[0]["summary"]["e2e_ms"]["p50"] = 950  # slower than static at 1 req/s: the target is missed
    cont[2]["summary"]["output_throughput"] = 70
    checks = {t["target"].split()[1]: t for t in targets({"static": static, "continuous": cont})}
    assert not checks["p50"]["met"] and not checks[">="]["met"] and "goodput" not in checks


def test_experiment_report_from_real_sweeps_writes_plots_page_and_json(serve_cluster, tiny_app, tmp_path):
    static_cfg = tiny_config()
    static_cfg["engine"].update(scheduling="static", static_batch_size=4)
    urls = {"static": serve_cluster.deploy("bench-static", static_cfg), "continuous": tiny_app}
    args = experiment.parse_args(["--quick", "--model", "tiny-llama", "--rates", "4,16", "--timeout-s", "60"])
    requests = experiment.variance_requests(args.num_requests, 12, args.mean_output, args.cap, "chat", 0)
    try:
        by_system = {
            name: experiment.run_sweep(name, experiment.Target(url), requests, args, {"ttft": 5000})
            for name, url in urls.items()
        }
    finally:  # idle, an app still costs ~0.08 of a core (Serve's and Ray's loops): not for the rest of the suite
        serve_cluster.delete("bench-static")
    occupancy = occupancy_pair("tiny-llama", num_requests=12, slots=4, threads=1)
    result = write_report(tmp_path, args, by_system, occupancy, {"ttft": 5000}, 1.0)
    page = (tmp_path / "index.html").read_text()
    saved = json.loads((tmp_path / "experiment.json").read_text())
    # The page shows what the JSON holds: its images (sweeps and occupancy: three plots), the sweep
    # table of its rows, and each of its targets with its verdict and detail.
    assert re.findall(r"src='([^']+)'", page) == [Path(p).name for p in saved["images"]] and len(saved["images"]) == 3
    assert html.escape(format_sweep([r for rows in saved["systems"].values() for r in rows])) in page
    for t in saved["targets"]:
        shown = re.search(r"(met|MISSED) +" + re.escape(html.escape(t["target"])) + r": ([^\n<]*)", page)
        assert shown and shown[1] == ("met" if t["met"] else "MISSED") and shown[2] == html.escape(t["detail"]), t
    assert [len(saved["systems"][s]) for s in ("static", "continuous")] == [2, 2]
    assert all(r["summary"]["completed"] == 8 for s in saved["systems"].values() for r in s)
    assert {t["target"].split()[1] for t in result["targets"]} == {">=", "p50"}
    assert [o["stats"]["scheduling"] for o in saved["occupancy"]] == ["static", "continuous"]
    assert saved["occupancy"][0]["trace"]["steps"]

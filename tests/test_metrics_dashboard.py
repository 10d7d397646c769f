"""The metric definitions, the Grafana dashboard built on them and the request log line (no Ray)."""

from __future__ import annotations

import contextvars
import json
import logging
import re
from pathlib import Path

from deployments import metrics, request_log
from deployments.protocol import GenerateResponse

DASHBOARD = Path(__file__).resolve().parent.parent / "cluster" / "grafana_iterserve.json"


def _exprs(dashboard: dict) -> list:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_dashboard_uses_only_defined_metrics_and_all_of_them():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dashboard)
    used = {name for e in exprs for name in re.findall(r"\b(ray_iterserve_[a-z0-9_]+)", e)}
    assert used and used <= metrics.exported_names(), used - metrics.exported_names()
    for spec in metrics.SPECS:  # every metric is on some panel
        assert set(spec.exported()) & used, spec.name
    known_labels = set(metrics.LABELS) | {lab for s in metrics.SPECS for lab in s.labels} | {"le"}
    for e in exprs:
        grouped = {lab.strip() for g in re.findall(r"by \(([^)]*)\)", e) for lab in g.split(",")}
        matched = set(re.findall(r"([a-z_]+)=~?\"", e))
        assert grouped | matched <= known_labels, e


def test_dashboard_refers_only_to_variables_and_metrics_it_has():
    """Imported into any Grafana, no panel is left empty: every `$variable` used (Grafana's `$__`
    built-ins aside) is defined, every panel and query reads the datasource variable rather than a
    fixed datasource, and the variables' own queries read defined metrics."""
    dashboard = json.loads(DASHBOARD.read_text())
    defined = {v["name"]: v for v in dashboard["templating"]["list"]}
    used = {name for name in re.findall(r"\$\{?(\w+)", json.dumps(dashboard)) if not name.startswith("__")}
    assert used and used <= set(defined), used - set(defined)
    sources = {f"${{{name}}}" for name, v in defined.items() if v["type"] == "datasource"}
    for p in dashboard["panels"]:
        assert {p["datasource"]["uid"]} | {t["datasource"]["uid"] for t in p["targets"]} <= sources, p["title"]
    queried = {
        name
        for v in defined.values()
        if v["type"] == "query"
        for name in re.findall(r"\b(ray_iterserve_[a-z0-9_]+)", json.dumps(v["query"]))
    }
    assert queried <= metrics.exported_names(), queried - metrics.exported_names()


def _capture():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    return records, handler


def test_request_log_line_is_json_once_without_text():
    records, handler = _capture()
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:

        def run():
            request_log.failed(500, "internal_error")  # nothing begun in this context: no line
            record = request_log.begin("cmpl-1", stream=True)
            record.prepared()
            record.first_token(0.002)
            out = GenerateResponse(
                request_id="cmpl-1",
                text="SECRET OUTPUT",
                token_ids=[5, 6],
                finish_reason="stop",
                prompt_tokens=7,
                completion_tokens=2,
                cached_tokens=4,
                replica_id="r1",
            )
            record.write(200, out)
            request_log.failed(503, "service_unavailable_error")  # already written: ignored

        contextvars.copy_context().run(run)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert len(records) == 1
    message = records[0].getMessage()
    line = json.loads(message)
    assert line == {
        **line,
        "event": "iterserve_request",
        "request_id": "cmpl-1",
        "stream": True,
        "status_code": 200,
        "error_type": None,
        "finish_reason": "stop",
        "prompt_tokens": 7,
        "output_tokens": 2,
        "cached_tokens": 4,
        "replica_id": "r1",
    }
    assert 0 <= line["ttft_s"] <= line["e2e_s"] and 0 <= line["prepare_s"] <= line["ttft_s"]
    assert line["replica_ttft_s"] == 0.002  # the first chunk's (the answer in `out` has none)
    assert "SECRET" not in message

"""The experiment's report: the sweep table, the targets, the pictures, an HTML page and JSON.

Saturation: a system is saturated at a rate when its queue grows during the run: the median TTFT of
the last third of the requests (in send order) is over twice that of the first third and over 0.5 s
later. (Whole-run completions per second are no test: with long outputs the drain at the end keeps them
below the offered rate even when the server keeps up.) Its saturation rate is the lowest such rate tested.
Continuous batching with room for every request in flight shows load as slower tokens (TPOT), not as a queue.
Targets (issue 8): where static is saturated, continuous >= 2x its output throughput (checked at the
highest rate, deepest in saturation; every saturated rate's ratio is listed); continuous has the lower
p50 e2e latency at every rate; at the peer's saturation rate, continuous has the higher goodput.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Dict, List, Optional

from load_tests import plots
from load_tests.bench_metrics import format_sweep


def queue_grows(row: dict) -> bool:
    ok = sorted((r for r in row["records"] if r["status"] == 200 and not r["error"]), key=lambda r: r["start_s"])
    third = len(ok) // 3
    if third < 2:
        return False
    first = statistics.median(r["ttft_s"] for r in ok[:third])
    last = statistics.median(r["ttft_s"] for r in ok[-third:])
    return last > 2 * first and last - first > 0.5


def saturation_rate(rows: List[dict]) -> Optional[float]:
    return next((row["rate"] for row in sorted(rows, key=lambda r: r["rate"]) if queue_grows(row)), None)


def _at(rows: List[dict], rate: float) -> Optional[dict]:
    return next((r["summary"] for r in rows if r["rate"] == rate), None)


def targets(by_system: Dict[str, List[dict]]) -> List[dict]:
    out = []
    static, cont, peer = by_system.get("static"), by_system.get("continuous"), by_system.get("peer")
    if static and cont:
        sat = saturation_rate(static)
        rates = sorted(r["rate"] for r in static)
        ratios = {
            rate: _at(cont, rate)["output_throughput"] / max(_at(static, rate)["output_throughput"], 1e-9)
            for rate in rates
            if sat is not None and rate >= sat and _at(cont, rate)
        }
        if ratios:
            top = max(ratios)
            detail = ", ".join(f"{x:.2f}x at {r:g}" for r, x in ratios.items())
            out.append(
                {
                    "target": "continuous >= 2x static output throughput where static saturates",
                    "value": ratios[top],
                    "met": ratios[top] >= 2.0,
                    "detail": f"static saturated from {sat:g} req/s; continuous/static: {detail} req/s",
                }
            )
        else:
            out.append(
                {
                    "target": "continuous >= 2x static output throughput where static saturates",
                    "value": None,
                    "met": False,
                    "detail": "static never saturated at the rates tested",
                }
            )
        worse = [r for r in rates if _at(cont, r) and _at(cont, r)["e2e_ms"]["p50"] >= _at(static, r)["e2e_ms"]["p50"]]
        pairs = ", ".join(
            f"{_at(cont, r)['e2e_ms']['p50']:.0f} vs {_at(static, r)['e2e_ms']['p50']:.0f} ms at {r:g}"
            for r in rates
            if _at(cont, r)
        )
        out.append(
            {
                "target": "continuous p50 e2e below static at every rate",
                "value": len(rates) - len(worse),
                "met": not worse,
                "detail": f"continuous vs static: {pairs}",
            }
        )
    if peer and cont:
        sat = saturation_rate(peer)
        rate = sat if sat is not None else max(r["rate"] for r in peer)
        ours, theirs = _at(cont, rate), _at(peer, rate)
        if ours and theirs and "goodput" in ours:
            g_ours, g_peer = ours["goodput"]["request_goodput"], theirs["goodput"]["request_goodput"]
            slos = " ".join(f"{k}<={v:g}ms" for k, v in ours["goodput"]["slos_ms"].items())
            note = f"peer saturated at {sat:g} req/s" if sat is not None else f"peer never saturated; at {rate:g} req/s"
            out.append(
                {
                    "target": "continuous goodput above the peer's at the peer's saturation rate",
                    "value": g_ours / g_peer if g_peer else None,
                    "met": g_ours > g_peer,
                    "detail": f"{note}; goodput ({slos}) {g_ours:.2f} vs {g_peer:.2f} req/s",
                }
            )
    return out


def occupancy_table(occupancy) -> str:
    lines = [f"{'mode':12s} {'slots':>5s} {'steps':>6s} {'busy slot-steps':>15s} {'tokens':>7s} {'engine s':>8s}"]
    for _, _, s in occupancy:
        lines.append(
            f"{s['scheduling']:12s} {s['slots']:>5d} {s['steps']:>6d} {s['slot_utilization']:>15.1%} "
            f"{s['generated_tokens']:>7d} {s['step_seconds']:>8.1f}"
        )
    return "\n".join(lines)


def write_report(out: Path, args, by_system: Dict[str, List[dict]], occupancy, slos, total_s: float) -> dict:
    rows = [r for name in by_system for r in by_system[name]]
    table = format_sweep(rows) if rows else "(no load runs)"
    checks = targets(by_system)
    target_text = "\n".join(f"{'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['detail']}" for t in checks)
    print("\n" + table + "\n\noccupancy:\n" + occupancy_table(occupancy) + "\n\ntargets:\n" + (target_text or "-"))
    images = []
    if rows:
        images.append(plots.plot_throughput(by_system, out / "throughput.png"))
        images.append(plots.plot_latency(by_system, out / "latency.png"))
    if occupancy:
        slots = max(s["slots"] for _, _, s in occupancy)
        images.append(
            plots.plot_occupancy(
                [(label, trace.grid(slots)) for label, trace, _ in occupancy],
                out / "occupancy.png",
                f"Batch occupancy, {args.model}, {slots} slots, same requests",
            )
        )
    load = os.getloadavg()
    notes = [
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} CPUs ({platform.platform()}); "
        f"1-min load average at the end {load[0]:.1f}. The machine is shared: other work may have run alongside.",
        f"Workload: max({args.num_requests}, rate x {args.window_s:g} s) chat requests per rate, ~{args.input_len}-word prompts, output lengths "
        f"exponential (mean {args.mean_output:g}) capped at {args.cap}, EOS ignored; Poisson arrivals; "
        f"model {args.model} fp32 on CPU; engine {args.threads} torch threads, max_num_seqs {args.max_num_seqs}, "
        f"static batches of {args.static_batch_size}.",
    ]
    if "llamacpp" in by_system:
        notes.append(
            f"llamacpp: llama.cpp's server on the same model's 4-bit GGUF (Q4_1), {args.threads} threads, "
            f"{args.max_num_seqs} slots: a speed anchor, its answers differ from fp32."
        )
    plots.write_html(
        out / "index.html",
        "iterserve: static vs continuous batching vs transformers serve, llama.cpp",
        images,
        [("Sweep", table), ("Targets", target_text or "-"), ("Occupancy", occupancy_table(occupancy))],
        notes,
    )
    result = {
        "benchmark": "experiment",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_end": load},
        "args": vars(args),
        "slos_ms": slos,
        "systems": by_system,
        "targets": checks,
        "occupancy": [{"label": label, "stats": s, "trace": t.to_dict()} for label, t, s in occupancy],
        "images": [str(p) for p in images],
        "total_seconds": total_s,
    }
    (out / "experiment.json").write_text(json.dumps(result, indent=1))
    return result

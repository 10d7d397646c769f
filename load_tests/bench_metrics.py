"""From per-request records to a load test's summary: throughput, latency percentiles, goodput, failures.

Definitions follow `vllm bench serve`: TPOT = (e2e - TTFT) / (output tokens - 1) per request; ITL = every
gap between streamed chunks, pooled over requests; throughput = completed requests (or their tokens)
over the run's duration; goodput = completed requests per second that met every SLO given. Percentiles
interpolate linearly between order statistics (numpy's default), so they can be checked against the records.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

from load_tests.bench_client import BenchRecord

PERCENTILES = (50, 90, 99)
SLO_METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s", "e2e": "e2e_s"}


def percentile(values: Sequence[float], p: float) -> Optional[float]:
    """The p-th percentile (0..100) with linear interpolation; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def distribution_ms(seconds: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> Dict[str, Optional[float]]:
    ms = [s * 1000.0 for s in seconds]
    out = {"mean": sum(ms) / len(ms) if ms else None, "count": len(ms)}
    out.update({f"p{p:g}": percentile(ms, p) for p in percentiles})
    return out


def parse_slos(items: Optional[Sequence[str]]) -> Dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"SLO {item!r}: expected NAME:MS with NAME in {sorted(SLO_METRICS)}")
        slos[name] = float(value)
        if slos[name] <= 0:
            raise ValueError(f"SLO {item!r} must be positive")
    return slos


def meets_slos(record: BenchRecord, slos: Dict[str, float]) -> bool:
    if not record.ok:
        return False
    for name, limit_ms in slos.items():
        value = getattr(record, SLO_METRICS[name])
        if value is not None and value * 1000.0 > limit_ms:  # no TPOT (one token): nothing to miss
            return False
    return True


def summarize(
    records: Sequence[BenchRecord],
    duration_s: float,
    slos: Optional[Dict[str, float]] = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict:
    """The summary of one run (see the module doc); `slos` in milliseconds by name (ttft, tpot, e2el)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    dur = max(duration_s, 1e-9)
    failures = [{"index": r.index, "turn": r.turn, "status": r.status, "error": r.error} for r in records if not r.ok]
    by_status: Dict[str, int] = {}
    for f in failures:
        by_status[str(f["status"])] = by_status.get(str(f["status"]), 0) + 1
    summary = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failures),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (prompt_tokens + out_tokens) / dur,
        "tokens_from_usage": all(r.tokens_from_usage for r in ok),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None], percentiles),
        "tpot_ms": distribution_ms([r.tpot_s for r in ok if r.tpot_s is not None], percentiles),
        "itl_ms": distribution_ms([x for r in ok for x in r.itl_s], percentiles),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok], percentiles),
        "failures_by_status": by_status,
        "failures": failures,
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in records)
        summary["goodput"] = {"slos_ms": dict(slos), "good_requests": good, "request_goodput": good / dur}
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if cached and prompt_tokens:
        summary["cached_token_share"] = sum(cached) / prompt_tokens
    return summary


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}"


def format_summary(s: dict, title: str = "load test") -> str:
    """A readable block, in the spirit of vllm bench serve's."""
    lines = [
        f"{'=' * 20} {title} {'=' * 20}",
        f"{'requests sent / completed / failed':40s} {s['requests']} / {s['completed']} / {s['failed']}",
        f"{'duration (s)':40s} {s['duration_s']:.2f}",
        f"{'prompt / output tokens':40s} {s['prompt_tokens']} / {s['output_tokens']}"
        + ("" if s["tokens_from_usage"] else "  (output: counted chunks, no usage)"),
        f"{'request throughput (req/s)':40s} {s['request_throughput']:.2f}",
        f"{'output token throughput (tok/s)':40s} {s['output_throughput']:.1f}",
        f"{'total token throughput (tok/s)':40s} {s['total_token_throughput']:.1f}",
    ]
    if "goodput" in s:
        g = s["goodput"]
        slos = " ".join(f"{k}<={v:g}ms" for k, v in g["slos_ms"].items())
        lines.append(f"{'goodput (req/s) ' + slos:40s} {g['request_goodput']:.2f} ({g['good_requests']} good)")
    if "cached_token_share" in s:
        lines.append(f"{'prompt tokens served from cache':40s} {s['cached_token_share']:.1%}")
    pcts = [k for k in s["ttft_ms"] if k.startswith("p")]
    lines.append(f"{'latency (ms)':10s} {'mean':>9s} " + " ".join(f"{k:>9s}" for k in pcts))
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = s[f"{name}_ms"]
        lines.append(f"{name.upper():10s} {_ms(d['mean']):>9s} " + " ".join(f"{_ms(d[k]):>9s}" for k in pcts))
    if s["failures"]:
        lines.append(f"failures by status: {s['failures_by_status']}")
        for f in s["failures"][:10]:
            lines.append(f"  request {f['index']} turn {f['turn']}: status {f['status']}: {f['error'][:120]}")
        if len(s["failures"]) > 10:
            lines.append(f"  ... {len(s['failures']) - 10} more in the JSON")
    return "\n".join(lines)


def format_sweep(rows: List[dict]) -> str:
    """One line per run of a sweep: rows carry 'label', 'rate' and 'summary'."""
    head = (
        f"{'system':22s} {'rate':>6s} {'done':>5s} {'fail':>4s} {'req/s':>6s} {'out tok/s':>9s} {'goodput':>7s} "
        f"{'TTFT p50':>8s} {'TTFT p99':>8s} {'TPOT p50':>8s} {'TPOT p99':>8s} {'e2e p50':>8s} {'e2e p99':>8s}"
    )
    lines = [head]
    for row in rows:
        s = row["summary"]
        good = f"{s['goodput']['request_goodput']:.2f}" if "goodput" in s else "-"
        lines.append(
            f"{row['label']:22s} {row['rate']:>6g} {s['completed']:>5d} {s['failed']:>4d} {s['request_throughput']:>6.2f} "
            f"{s['output_throughput']:>9.1f} {good:>7s} {_ms(s['ttft_ms']['p50']):>8s} {_ms(s['ttft_ms']['p99']):>8s} "
            f"{_ms(s['tpot_ms']['p50']):>8s} {_ms(s['tpot_ms']['p99']):>8s} {_ms(s['e2e_ms']['p50']):>8s} "
            f"{_ms(s['e2e_ms']['p99']):>8s}"
        )
    return "\n".join(lines)

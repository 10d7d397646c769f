"""Ratios, target checks and the printed table of the offline benchmark (pure functions on dicts)."""

from __future__ import annotations

from typing import Dict, List, Optional

BASELINES = {
    "vs_naive": "hf_naive",
    "vs_static16": "hf_static16",
    "vs_transformers_cb": "transformers_cb",
    "vs_engine_eager": "engine_continuous",
}
LABELS = {
    "hf_naive": "HF generate, one at a time",
    "hf_static16": "HF generate, static batches of 16",
    "transformers_cb": "transformers continuous batching",
    "engine_static": "iterserve engine, static (16)",
    "engine_continuous": "iterserve engine, continuous",
    "engine_fast": "iterserve engine, fast forward",
}
# The targets, judged at the largest cap (128 by default): (system, key, minimum).
TARGETS = [
    ("engine_continuous", "vs_naive", 4.0),
    ("engine_continuous", "vs_static16", 2.0),
    ("engine_continuous", "vs_transformers_cb", 1.5),
    ("engine_continuous", "forward_share", 0.85),
    ("engine_continuous", "kv_slot_use", 0.95),
    ("engine_fast", "vs_engine_eager", 2.0),  # the fast forward against the eager fp32 one
]


def add_ratios(systems: Dict[str, dict]) -> None:
    """Throughput ratios (output tokens/s) of every system against each baseline that ran."""
    for name, entry in systems.items():
        entry["ratios"] = {
            key: entry["tokens_per_second"] / systems[base]["tokens_per_second"]
            for key, base in BASELINES.items()
            if base in systems and base != name and systems[base]["tokens_per_second"] > 0
        }


def check_targets(systems: Dict[str, dict], cap: int) -> List[dict]:
    checks = []
    for name, key, minimum in TARGETS:
        entry = systems.get(name)
        if entry is None:
            continue
        value: Optional[float] = entry["ratios"].get(key, entry["metrics"].get(key))
        if value is None:
            continue
        checks.append(
            {"cap": cap, "system": name, "metric": key, "value": value, "target": minimum, "met": value >= minimum}
        )
    return checks


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_cap(cap_result: dict) -> str:
    w = cap_result["workload"]
    lines = [
        f"== cap {cap_result['cap']}: {w['num_requests']} requests x {w['prompt_tokens'] // max(1, w['num_requests'])}"
        f" prompt tokens; {w['output_tokens']} output tokens (mean {w['output_len_mean']:.1f}, "
        f"max {w['output_len_max']}), EOS ignored",
        f"{'system':<36}{'reqs':>5}{'out tok':>8}{'wall s':>8}{'tok/s':>8}{'x naive':>9}{'x stat16':>9}"
        f"{'x tfCB':>8}{'x eager':>8}{'fwd':>7}{'KV use':>8}{'load':>6}  check",
    ]
    for name, e in cap_result["systems"].items():
        label = LABELS.get(name, name) + (" *" if e.get("subset") else "")
        r, m = e["ratios"], e["metrics"]
        check = "len ok" if e["length_errors"] == 0 else f"{e['length_errors']} LEN ERR"
        if e.get("agreement_with_naive") is not None:
            a = e["agreement_with_naive"]
            check += f", {a['identical']}/{a['compared']} = naive"
        lines.append(
            f"{label:<36}{e['num_requests']:>5}{e['output_tokens']:>8}{e['wall_seconds']:>8.1f}"
            f"{e['tokens_per_second']:>8.1f}{_ratio(r.get('vs_naive')):>9}{_ratio(r.get('vs_static16')):>9}"
            f"{_ratio(r.get('vs_transformers_cb')):>8}{_ratio(r.get('vs_engine_eager')):>8}"
            f"{_pct(m.get('forward_share')):>7}"
            f"{_pct(m.get('kv_slot_use')):>8}{max(e.get('load_avg_1m_after_rounds') or [0]):>6.1f}  {check}"
        )
    naive = cap_result["systems"].get("hf_naive")
    if naive and naive.get("subset"):
        lines.append(
            f"* timed on {naive['num_requests']} of {w['num_requests']} requests (evenly spaced quantiles of "
            f"output length); full run estimated at {naive['estimated_full_wall_seconds']:.0f} s"
        )
    lines.append("load = 1-min load average after the system's runs (2 cores: above ~2.5 means outside load)")
    return "\n".join(lines)


def format_targets(checks: List[dict]) -> str:
    if not checks:
        return "targets: not judged (engine_continuous or its baselines did not run)"
    lines = [f"targets at cap {checks[0]['cap']}:"]
    for c in checks:
        shown = _pct(c["value"]) if c["target"] < 1 else _ratio(c["value"])
        want = _pct(c["target"]) if c["target"] < 1 else _ratio(c["target"])
        lines.append(
            f"  {c['system']} {c['metric']:<20} {shown:>8} (target >= {want})  {'met' if c['met'] else 'MISSED'}"
        )
    return "\n".join(lines)

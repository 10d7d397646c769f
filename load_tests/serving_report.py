"""The printed table and targets of `python -m load_tests.serving`, and where the CPU went."""

from __future__ import annotations

import os
from typing import Dict, List, Optional

# (label, phase, summary key, percentile or None, format, target: (comparison, ratio to the peer) or None)
ROWS = [
    ("saturated output tok/s", "saturated", "output_throughput", None, "{:.1f}", (">=", 1.8)),
    ("saturated TTFT p50 (ms)", "saturated", "ttft_ms", "p50", "{:.0f}", None),
    ("saturated e2e p50 (ms)", "saturated", "e2e_ms", "p50", "{:.0f}", None),
    ("light TTFT p50 (ms)", "light", "ttft_ms", "p50", "{:.1f}", ("<=", 0.8)),
    ("light TTFT p99 (ms)", "light", "ttft_ms", "p99", "{:.1f}", ("<=", 1.0)),
    ("light TPOT p50 (ms)", "light", "tpot_ms", "p50", "{:.1f}", None),
    ("light e2e p50 (ms)", "light", "e2e_ms", "p50", "{:.0f}", None),
]


def cpu_seconds() -> Dict[str, float]:
    """CPU seconds so far of the processes a serving benchmark involves, by role: Ray's workers
    (proctitle `ray::Role`), its daemons, the peer, and this client."""
    import psutil

    out = {"client": sum(psutil.Process().cpu_times()[:2])}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        if proc.info["pid"] == os.getpid() or not proc.info["cpu_times"]:
            continue
        cmd = " ".join(proc.info["cmdline"] or [])
        if cmd.startswith("ray::"):
            role = cmd.split()[0][5:].split(".")[0]  # ray::ServeReplica:app:LLMServer -> ServeReplica:app:LLMServer
        elif " serve " in f" {cmd} " and "transformers" in cmd:
            role = "transformers serve"
        elif proc.info["name"] in ("raylet", "gcs_server") or "dashboard" in cmd or "log_monitor" in cmd:
            role = (
                f"ray daemons ({proc.info['name']})"
                if proc.info["name"] in ("raylet", "gcs_server")
                else "ray daemons (python)"
            )
        elif "serve run" in cmd or cmd.endswith("/serve run"):
            role = "serve run (driver)"
        else:
            continue
        out[role] = out.get(role, 0.0) + sum(proc.info["cpu_times"][:2])
    return out


def _value(result: dict, phase: str, key: str, pct: Optional[str]) -> Optional[float]:
    v = result[phase]["summary"].get(key)
    return v.get(pct) if pct and isinstance(v, dict) else v


def _same_answers(a: List[Optional[str]], b: List[Optional[str]], prefix: bool = False) -> str:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    same = sum(y.startswith(x) if prefix else x == y for x, y in pairs)
    return f"{same}/{len(pairs)}"


def report(by_system: Dict[str, dict], requests: Dict[str, list]) -> dict:
    names = list(by_system)
    ours, peer = by_system.get("iterserve"), by_system.get("peer")
    print(f"\n{'':<32}" + "".join(f"{n:>14}" for n in names) + ("   ratio  target" if ours and peer else ""))
    targets = {}
    for label, phase, key, pct, fmt, target in ROWS:
        vals = [_value(by_system[n], phase, key, pct) for n in names]
        line = f"{label:<32}" + "".join(f"{fmt.format(v) if v is not None else '-':>14}" for v in vals)
        if ours and peer and target:
            a, b = _value(ours, phase, key, pct), _value(peer, phase, key, pct)
            ratio = a / b if a is not None and b else None
            op, bound = target
            ok = ratio is not None and (ratio >= bound if op == ">=" else ratio <= bound)
            targets[label] = {"ratio": ratio, "target": f"{op} {bound}x", "met": ok}
            line += f"{ratio or 0:>7.2f}x  {op} {bound:.1f}x {'met' if ok else 'MISSED'}"
        print(line)
    total = len(requests["saturated"])
    expected = sum(r.max_tokens for r in requests["saturated"])
    print(
        f"{'completed (saturated)':<32}"
        + "".join(f"{by_system[n]['saturated']['summary']['completed']:>11}/{total}" for n in names)
    )
    print(
        f"{'output tokens (saturated)':<32}"
        + "".join(f"{sum(by_system[n]['saturated']['output_tokens']):>14}" for n in names)
        + f"   expected {expected}"
    )
    print(
        f"{'one-at-a-time answer = start':<32}"
        + "".join(
            f"{_same_answers(by_system[n]['light']['answers'], by_system[n]['saturated']['answers'], True):>14}"
            for n in names
        )
        + "   (batching leaves greedy answers unchanged)"
    )
    if ours and peer:
        same = _same_answers(ours["saturated"]["answers"], peer["saturated"]["answers"])
        print(f"{'same answer as the peer':<32}{same:>14}   (saturated, greedy, fp32)")
        targets["same_answers_as_peer"] = same
    for n in names:
        cpu = by_system[n]["saturated"]["cpu_seconds"]
        print(
            f"CPU seconds in {n}'s saturated phase: "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
        )
    return targets

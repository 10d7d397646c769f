"""Printed tables of `python -m load_tests.serving`: in-process vs HTTP, and replica layouts."""
from __future__ import annotations

from typing import List


def report(inproc: dict, http: dict) -> dict:
    ratio = http["saturated"]["output_tokens_per_s"] / inproc["saturated"]["output_tokens_per_s"]
    added = http["light"]["ttft_ms_p50"] - inproc["light"]["ttft_ms_p50"]
    rows = [("saturated output tokens/s", "output_tokens_per_s", "saturated", "{:.1f}"),
            ("saturated TTFT p50 (ms)", "ttft_ms_p50", "saturated", "{:.0f}"),
            ("saturated e2e p50 (ms)", "e2e_ms_p50", "saturated", "{:.0f}"),
            ("light TTFT p50 (ms)", "ttft_ms_p50", "light", "{:.1f}"),
            ("light TTFT p90 (ms)", "ttft_ms_p90", "light", "{:.1f}"),
            ("light e2e p50 (ms)", "e2e_ms_p50", "light", "{:.1f}")]
    print(f"\n{'metric':<28}{'in-process':>12}{'HTTP':>12}")
    for label, key, regime, fmt in rows:
        print(f"{label:<28}{fmt.format(inproc[regime][key]):>12}{fmt.format(http[regime][key]):>12}")
    targets = {
        "throughput_ratio": ratio, "throughput_ratio_target": 0.90, "throughput_ok": ratio >= 0.90,
        "added_ttft_p50_ms": added, "added_ttft_target_ms": 25.0, "added_ttft_ok": added <= 25.0,
    }
    for name, res in (("in-process", inproc), ("HTTP", http)):
        cpu = res["saturated"]["cpu_seconds_by_process"]
        print(f"CPU seconds in the saturated phase, {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
    print(f"\nHTTP / in-process saturated throughput: {ratio:.1%} (target >= 90%: "
          f"{'met' if targets['throughput_ok'] else 'MISSED'})")
    print(f"TTFT added by the stack, p50 light load: {added:.1f} ms (target <= 25 ms: "
          f"{'met' if targets['added_ttft_ok'] else 'MISSED'})")
    return targets


def report_layouts(layouts: List[dict], burst: int) -> None:
    print(f"\n-- replica layouts over HTTP, {burst} requests at t=0")
    print(f"{'layout':<28}{'output tok/s':>14}{'light TTFT p50':>16}")
    for run in layouts:
        print(f"{run['layout']:<28}{run['http']['saturated']['output_tokens_per_s']:>14.1f}"
              f"{run['http']['light']['ttft_ms_p50']:>13.1f} ms")

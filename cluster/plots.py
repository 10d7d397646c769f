"""One PNG per simulated run: replicas (billed, ready, target) and queue depth over time."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cluster.fleet_sim_parts import Result
from cluster.traces import Trace


def plot_run(res: Result, trace: Trace, path: Path, startup_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    t = np.array(res.t) / 3600.0
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, height_ratios=[3, 2])
    top.plot(t, res.replicas, label="replicas (billed)", lw=1.2)
    top.plot(t, res.ready, label="ready", lw=0.8)
    top.plot(t, res.target, label="target", lw=0.8, ls="--")
    top.set_ylabel("replicas")
    rate = top.twinx()
    rate.plot(t, res.rate, color="grey", alpha=0.4, lw=0.8, label="arrival rate")
    rate.set_ylabel("requests / s")
    for s, e in trace.steady:
        top.axvspan(s / 3600.0, e / 3600.0, color="green", alpha=0.06)
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"{res.name}: start-up {startup_s:.0f} s, {res.replica_seconds / 3600:.0f} replica-hours, "
                  f"TTFT p99 {res.ttft_quantile(0.99):.2f} s (simulated)")
    bottom.plot(t, res.queue, color="tab:red", lw=0.8)
    bottom.set_ylabel("queued requests")
    bottom.set_xlabel("hours (steady spans shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

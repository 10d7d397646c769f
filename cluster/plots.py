"""PNGs: one per simulated run (replicas billed, ready and target, and queue depth over time), and
cluster.sim_check's real and simulated replicas side by side."""

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
    top.set_title(
        f"{res.name}: start-up {startup_s:.0f} s, {res.replica_seconds / 3600:.0f} replica-hours, "
        f"TTFT p99 {res.ttft_quantile(0.99):.2f} s (simulated)"
    )
    bottom.plot(t, res.queue, color="tab:red", lw=0.8)
    bottom.set_ylabel("queued requests")
    bottom.set_xlabel("hours (steady spans shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_sim_check(real, sim, rate: np.ndarray, verdict: dict, path: Path) -> Path:
    """cluster.sim_check's runs (sim_check.Run, real Serve and simulated): replicas over time."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.step(real.t, real.running, where="post", label=f"real Serve: running ({real.within_slo:.0%} in SLO)", lw=1.6)
    ax.step(
        sim.t, sim.running, where="post", label=f"fleet_sim: running ({sim.within_slo:.0%} in SLO)", lw=1.2, ls="--"
    )
    ax.step(real.t, real.asked, where="post", label="real: asked (starting + running)", lw=0.7, alpha=0.6)
    ax.step(sim.t, sim.asked, where="post", label="sim: asked", lw=0.7, alpha=0.6, ls=":")
    ax.set_ylabel("replicas")
    ax.set_xlabel("seconds")
    twin = ax.twinx()
    twin.fill_between(np.arange(len(rate)), rate, color="grey", alpha=0.2, step="post")
    twin.set_ylabel("arrivals / s (10 s bins)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(
        f"sim check: running within +-1 for {verdict['running_within_tolerance']:.0%} of the time, "
        f"SLO share gap {verdict['slo_gap_points']:.1f} points (simulated replicas)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

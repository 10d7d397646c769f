"""The experiment's pictures (matplotlib PNG) and the HTML page that holds them with the table.

- throughput vs offered request rate, one line per system;
- TTFT / TPOT / e2e latency p50 (solid) and p99 (dashed) vs rate;
- batch occupancy from a real engine trace: slots x iterations, prompt / generated / finished / idle
  cells, one panel per scheduling mode side by side (the seeds' T1..T8 slot diagrams).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

# idle, prompt (yellow), generated (blue), finished (red): the seeds' colours
CELL_COLOURS = ["#f2f2f2", "#f6c445", "#4a7fc1", "#d6453d"]
CELL_LABELS = ["idle", "prompt", "generated", "finished (last token)"]
Rows = Dict[str, List[dict]]  # system -> sweep rows {rate, summary}


def _series(rows: List[dict], key) -> Tuple[List[float], List[float]]:
    pts = sorted((r["rate"], key(r["summary"])) for r in rows if key(r["summary"]) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_throughput(by_system: Rows, path: Path, title: str = "") -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in by_system.items():
        axes[0].plot(*_series(rows, lambda s: s["output_throughput"]), marker="o", label=name)
        axes[1].plot(*_series(rows, lambda s: s["request_throughput"]), marker="o", label=name)
    rates = sorted({r["rate"] for rows in by_system.values() for r in rows})
    axes[1].plot(rates, rates, color="grey", linestyle=":", label="offered")
    for ax, what in zip(axes, ("output tokens/s", "completed requests/s")):
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "Throughput vs request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency(by_system: Rows, path: Path, title: str = "") -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, rows) in enumerate(by_system.items()):
        for ax, metric in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms")):
            for p, style in (("p50", "-"), ("p99", "--")):
                xs, ys = _series(rows, lambda s, metric=metric, p=p: s[metric][p])
                ax.plot(xs, ys, style, marker="o", color=colours[i % len(colours)], label=f"{name} {p}")
    for ax, metric in zip(axes, ("TTFT", "TPOT", "end-to-end latency")):
        ax.set_title(metric)
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(title or "Latency vs request rate (p50 solid, p99 dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_occupancy(panels: Sequence[Tuple[str, List[List[int]]]], path: Path, title: str = "") -> Path:
    """panels: (label, grid) with grid[slot][step] in trace codes (0 idle, 1 prompt, 2 generated, 3 finished)."""
    steps = max(len(g[0]) if g else 0 for _, g in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(min(18, 3 + 0.09 * steps * len(panels)), 4.2), squeeze=False)
    cmap = ListedColormap(CELL_COLOURS)
    for ax, (label, grid) in zip(axes[0], panels):
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("iteration (engine step)")
        ax.set_ylabel("batch slot")
        ax.set_yticks(range(len(grid)))
        ax.set_xlim(-0.5, steps - 0.5)
    fig.legend(
        handles=[Patch(color=c, label=lab) for c, lab in zip(CELL_COLOURS, CELL_LABELS)],
        loc="lower center",
        ncol=4,
        fontsize=9,
    )
    fig.suptitle(title or "Batch occupancy")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_html(
    path: Path, title: str, images: Sequence[Path], tables: Sequence[Tuple[str, str]], notes: Sequence[str] = ()
) -> Path:
    """A self-contained page (images by relative path): notes, then each (heading, preformatted text)."""
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1500px;margin:2em auto}"
        "pre{background:#f6f6f6;padding:1em;overflow-x:auto}img{max-width:100%}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    parts += [f"<p>{html.escape(n)}</p>" for n in notes]
    for heading, text in tables:
        parts.append(f"<h2>{html.escape(heading)}</h2><pre>{html.escape(text)}</pre>")
    for img in images:
        rel = Path(img).relative_to(path.parent) if Path(img).is_relative_to(path.parent) else Path(img)
        parts.append(f"<p><img src='{html.escape(str(rel))}' alt='{html.escape(Path(img).stem)}'></p>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts))
    return path

"""Request-level traces: one row per request (arrival time, input and output tokens, optionally the
prefix block ids it shares with others), read from the public formats and replayed by
`load_tests.bench --workload trace` (over HTTP) and `cluster.simulate --trace` (binned to a rate).

Formats (plain or gzipped, by extension):
- CSV with a header, the common public layout: a time column (`TIMESTAMP` as in Azure's LLM inference
  traces, or `timestamp` / `t_s` / `Timestamp` in seconds; dates are parsed as ISO times), an input
  column (`ContextTokens`, `input_tokens`, `input_length`, `Request tokens`) and an output column
  (`GeneratedTokens`, `output_tokens`, `output_length`, `Response tokens`).
- JSONL as Mooncake's traces: `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`;
  requests that share a block id share that block of their prompt (`block_tokens` tokens each, 512 in
  Mooncake's); `t_s` (seconds) may stand in for `timestamp`.
"""

from __future__ import annotations

import csv
import datetime
import gzip
import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from cluster.traces import Trace, steady_spans

TIME_COLUMNS = ("TIMESTAMP", "timestamp", "Timestamp", "t_s", "time")
INPUT_COLUMNS = ("ContextTokens", "input_tokens", "input_length", "Request tokens")
OUTPUT_COLUMNS = ("GeneratedTokens", "output_tokens", "output_length", "Response tokens")
TRACES_DIR = Path(__file__).resolve().parent.parent / "load_tests" / "traces"


@dataclass
class RequestTrace:
    """Arrivals in seconds from the first (ascending), with each request's token counts."""

    t_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_ids: Optional[List[List[int]]] = None  # per request, the prefix blocks it is made of
    block_tokens: int = 512
    name: str = "trace"
    notes: List[str] = field(default_factory=list)  # transformations applied, for reports

    def __len__(self) -> int:
        return len(self.t_s)

    @property
    def duration_s(self) -> float:
        return float(self.t_s[-1]) if len(self.t_s) else 0.0

    def _take(self, keep: np.ndarray, t_s: Optional[np.ndarray] = None, note: str = "") -> "RequestTrace":
        idx = np.flatnonzero(keep) if keep.dtype == bool else keep
        hashes = [self.hash_ids[i] for i in idx] if self.hash_ids is not None else None
        t = (self.t_s if t_s is None else t_s)[idx]
        return replace(
            self,
            t_s=t,
            input_tokens=self.input_tokens[idx],
            output_tokens=self.output_tokens[idx],
            hash_ids=hashes,
            notes=self.notes + ([note] if note else []),
        )

    def head(self, n: int) -> "RequestTrace":
        """The first n requests."""
        return self._take(np.arange(min(n, len(self))), note=f"first {n} requests") if n < len(self) else self

    def window(self, start_s: float, end_s: Optional[float] = None) -> "RequestTrace":
        """Requests arriving in [start_s, end_s), re-based so the window starts at 0."""
        end = np.inf if end_s is None else end_s
        keep = (self.t_s >= start_s) & (self.t_s < end)
        end_text = "end" if end_s is None else format(end_s, "g")
        return self._take(keep, self.t_s - start_s, f"window {start_s:g}-{end_text} s")

    def time_scaled(self, speedup: float) -> "RequestTrace":
        """The same requests `speedup` times faster (gaps divided by it): rates multiply by it."""
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        return self._take(np.arange(len(self)), self.t_s / speedup, f"time x1/{speedup:g}")

    def tick_s(self) -> float:
        """The clock the timestamps were recorded at, if they were recorded at ticks shared by several
        requests (most requests share their timestamp: Mooncake's are 3 s apart, ~10 requests each);
        0 for arrival times of their own. The median gap between distinct timestamps."""
        ticks = np.unique(self.t_s)
        if len(ticks) < 2 or len(ticks) > len(self) / 2:
            return 0.0
        return float(np.median(np.diff(ticks)))

    def spread_ticks(self, seed: int = 0) -> "RequestTrace":
        """The requests of each tick (tick_s) spread uniformly over it, in their order: a tick's ~10
        requests arrived some time within it, not all at once (replayed at the tick, they hit the
        fleet as one synchronized burst every tick that no user sends). Unchanged without ticks."""
        tick = self.tick_s()
        if tick <= 0:
            return self
        rng = np.random.default_rng(seed)
        starts, first, counts = np.unique(self.t_s, return_index=True, return_counts=True)
        # A tick lasts until the next one (recorded clocks jitter: 2.999 s, 3.001 s), the last one tick_s.
        lengths = np.minimum(np.diff(starts, append=np.inf), tick)
        t = self.t_s.astype(float).copy()
        for start, i, n, length in zip(starts, first, counts, lengths):
            t[i : i + n] = start + np.sort(rng.uniform(0.0, length, n))
        return self._take(np.arange(len(self)), t, f"each {tick:g} s tick's requests spread over it")

    def rate_scaled(self, factor: float, seed: int = 0) -> "RequestTrace":
        """About `factor` times the requests, same shape over time: each request is kept floor(factor)
        times plus once more with probability frac(factor). Copies are other users (their prefix
        block ids are renumbered, so they share nothing with the original) arriving up to 1 s later."""
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        rng = np.random.default_rng(seed)
        whole, frac = int(factor), factor - int(factor)
        copies = np.full(len(self), whole) + (rng.random(len(self)) < frac)
        idx = np.repeat(np.arange(len(self)), copies)
        nth = np.concatenate([np.arange(c) for c in copies]) if len(idx) else np.zeros(0, dtype=int)
        t = self.t_s[idx] + np.where(nth > 0, rng.random(len(idx)), 0.0)
        order = np.argsort(t, kind="stable")
        idx, nth, t = idx[order], nth[order], t[order]
        hashes = None
        if self.hash_ids is not None:
            top = 1 + max((max(h) for h in self.hash_ids if h), default=0)
            hashes = [[b + k * top for b in self.hash_ids[i]] for i, k in zip(idx, nth)]
        return replace(
            self,
            t_s=t,
            input_tokens=self.input_tokens[idx],
            output_tokens=self.output_tokens[idx],
            hash_ids=hashes,
            notes=self.notes + [f"rate x{factor:g}"],
        )

    def to_rate(self, bin_s: float = 10.0) -> Trace:
        """Requests per second in `bin_s` bins (a step at each bin's start), for the fleet simulator."""
        nbins = max(1, int(np.ceil((self.duration_s + 1e-9) / bin_s)))
        counts = np.bincount(np.minimum((self.t_s // bin_s).astype(int), nbins - 1), minlength=nbins)
        rate = counts / bin_s
        # Two points per bin make a step function under Trace's linear interpolation.
        t = np.repeat(np.arange(nbins) * bin_s, 2) + np.tile([0.0, bin_s - 1e-3], nbins)
        trace = Trace(t, np.repeat(rate, 2), self.name)
        trace.steady = steady_spans(trace)
        return trace

    def describe(self) -> dict:
        """Summary figures: length, rate, burstiness (peak bin over mean), token medians."""
        rate = self.to_rate(10.0).rate_rps[::2]
        return {
            "name": self.name,
            "requests": len(self),
            "duration_s": round(self.duration_s, 1),
            "mean_rps": float(rate.mean()),
            "peak_10s_rps": float(rate.max()),
            "peak_over_mean": float(rate.max() / max(rate.mean(), 1e-9)),
            "idle_10s_bins": float((rate == 0).mean()),
            "input_tokens_p50": float(np.median(self.input_tokens)) if len(self) else 0.0,
            "output_tokens_p50": float(np.median(self.output_tokens)) if len(self) else 0.0,
            "notes": list(self.notes),
        }


def _open_text(path: Path) -> io.TextIOBase:
    return gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="")


def _pick(header: Sequence[str], names: Sequence[str], path: Path, what: str) -> str:
    for n in names:
        if n in header:
            return n
    raise ValueError(f"{path}: no {what} column (one of {', '.join(names)}); header is {list(header)}")


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:  # an ISO time, e.g. "2023-11-16 18:17:03.9799600" (7 fraction digits: cut to 6)
        head, _, frac = value.partition(".")
        return datetime.datetime.fromisoformat(f"{head}.{frac[:6]}" if frac else head).timestamp()


def _trace(path: Path, t: List[float], inp: List[int], out: List[int], hashes=None, block_tokens=512) -> RequestTrace:
    if not t:
        raise ValueError(f"{path}: no requests")
    t_arr = np.asarray(t, dtype=float)
    order = np.argsort(t_arr, kind="stable")
    name = path.name.split(".")[0]
    hash_ids = [hashes[i] for i in order] if hashes is not None else None
    return RequestTrace(
        t_arr[order] - t_arr[order][0],
        np.asarray(inp, dtype=int)[order],
        np.asarray(out, dtype=int)[order],
        hash_ids,
        block_tokens,
        name,
    )


def load_request_trace(path, block_tokens: int = 512) -> RequestTrace:
    """A CSV or JSONL request trace (see the module docstring); errors name the file and line."""
    path = Path(path)
    kind = path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) > 1 else path.suffix
    t, inp, out = [], [], []
    with _open_text(path) as f:
        if kind == ".jsonl":
            hashes = []
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    t.append(float(row["t_s"]) if "t_s" in row else float(row["timestamp"]) / 1000.0)
                    inp.append(int(row["input_length"]))
                    out.append(int(row["output_length"]))
                    hashes.append([int(h) for h in row.get("hash_ids", [])])
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(
                        f"{path}:{n}: needs timestamp (ms) or t_s, input_length, output_length "
                        f"({type(e).__name__}: {e})"
                    ) from None
            return _trace(path, t, inp, out, hashes if any(hashes) else None, block_tokens)
        if kind != ".csv":
            raise ValueError(f"{path}: expected .csv or .jsonl (optionally .gz)")
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        tc, ic = _pick(header, TIME_COLUMNS, path, "time"), _pick(header, INPUT_COLUMNS, path, "input tokens")
        oc = _pick(header, OUTPUT_COLUMNS, path, "output tokens")
        for n, row in enumerate(reader, 2):
            try:
                t.append(_seconds(row[tc]))
                inp.append(int(float(row[ic])))
                out.append(int(float(row[oc])))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return _trace(path, t, inp, out)


def write_request_trace(trace: RequestTrace, path) -> Path:
    """Writes `trace` so that load_request_trace reads it back: CSV `timestamp,input_tokens,output_tokens`
    (seconds), or JSONL in Mooncake's layout (timestamp in ms, hash_ids when it has them); gzipped for
    .gz. Exact for times from the first request at 0 (loading re-bases) and, in JSONL, in whole ms."""
    path = Path(path)
    kind = path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) > 1 else path.suffix
    if kind not in (".csv", ".jsonl"):
        raise ValueError(f"{path}: expected .csv or .jsonl (optionally .gz)")
    if kind == ".csv" and trace.hash_ids is not None:
        raise ValueError(f"{path}: CSV has no column for hash_ids; write .jsonl to keep the prefix blocks")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = zip(trace.t_s.tolist(), trace.input_tokens.tolist(), trace.output_tokens.tolist())
    with gzip.open(path, "wt", newline="") if path.suffix == ".gz" else open(path, "w", newline="") as f:
        if kind == ".csv":
            writer = csv.writer(f)
            writer.writerow(["timestamp", "input_tokens", "output_tokens"])
            writer.writerows([repr(float(t)), int(i), int(o)] for t, i, o in rows)
            return path
        for n, (t, i, o) in enumerate(rows):
            ms = t * 1000.0
            row = {
                "timestamp": round(ms) if abs(ms - round(ms)) < 1e-6 else ms,
                "input_length": int(i),
                "output_length": int(o),
            }
            if trace.hash_ids is not None:
                row["hash_ids"] = [int(h) for h in trace.hash_ids[n]]
            f.write(json.dumps(row) + "\n")
    return path


def bundled(name: str) -> Path:
    """A trace shipped in load_tests/traces/ by file name or stem (see its README.md)."""
    hits = sorted(p for p in TRACES_DIR.glob(f"{name}*") if p.name.split(".")[0] == name or p.name == name)
    if not hits:
        have = sorted({p.name.split(".")[0] for p in TRACES_DIR.glob("*.*") if p.suffix != ".md"})
        raise FileNotFoundError(f"no bundled trace {name!r}; have {', '.join(have)}")
    return hits[0]


def prompt_token_ids(
    trace: RequestTrace, i: int, token_range: tuple, token_scale: float = 1.0, seed: int = 0
) -> List[int]:
    """Request i's prompt as token ids in [low, high): each prefix block id always becomes the same
    tokens, so requests sharing block ids share that prefix exactly in the engine's tokens (what a
    prefix cache and a prefix-aware router see). Without block ids every prompt is its own.
    `token_scale` < 1 shortens prompts and blocks alike (the sharing structure stays)."""
    low, high = token_range
    length = max(1, round(int(trace.input_tokens[i]) * token_scale))
    block = max(1, round(trace.block_tokens * token_scale))
    blocks = trace.hash_ids[i] if trace.hash_ids is not None and trace.hash_ids[i] else None
    if blocks is None:
        rng = np.random.default_rng([seed, 1, i])
        return rng.integers(low, high, length).tolist()
    if len(blocks) * trace.block_tokens >= int(trace.input_tokens[i]):
        # The blocks hold the whole prompt: rounding under token_scale must not add tokens of its own
        # (a turn would then stop being a prefix of the next).
        length = min(length, len(blocks) * block)
    out: List[int] = []
    for b in blocks:
        out.extend(np.random.default_rng([seed, 0, b]).integers(low, high, block).tolist())
        if len(out) >= length:
            break
    if len(out) < length:  # more tokens than the blocks cover: the rest is the request's own
        out.extend(np.random.default_rng([seed, 1, i]).integers(low, high, length - len(out)).tolist())
    return out[:length]

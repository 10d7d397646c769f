"""Synthetic request traces in the shapes real traffic has and uniform Poisson lacks, as RequestTrace:

- `on_off_bursts`: a Markov-modulated Poisson process (MMPP): an "on" and an "off" state with
  exponential sojourns, Poisson arrivals at a high rate when on and `ratio` times less when off
  (silent by default): minutes of quiet, then bursts, as in Azure's code-completion trace;
- `flash_crowd`: a base rate that steps to `k` times itself within `rise_s`, holds, and decays back
  with time constant `decay_s`;
- `diurnal`: a day's sinusoid (trough at the start, `peak_over_trough`) compressed into the duration;
- `sessions`: multi-turn sessions over a few long-lived system prompts: each turn's prompt is the
  session's system prompt, every earlier turn and answer, then the new user turn, as prefix block ids
  (Mooncake's layout), so a prefix cache and a prefix-aware router see real sharing;
- `LongTailLengths`: lognormal prompts and Pareto (Lomax) answers, capped; every generator takes one.

All are seeded and deterministic; arrivals are whole milliseconds from the first request (at 0), so
`write_request_trace` and `load_request_trace` give them back exactly. CLI:

    python -m cluster.synthetic_traces mmpp --duration-s 3600 --mean-rps 2 --out bursts.csv.gz
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from cluster.request_traces import RequestTrace, write_request_trace


@dataclass(frozen=True)
class LongTailLengths:
    """Prompt tokens lognormal (median, sigma) and answer tokens Lomax (scale, alpha: median about
    scale * (2^(1/alpha) - 1), mean scale / (alpha - 1)), each at least 1 and capped."""

    input_median: float = 1000.0
    input_sigma: float = 1.0
    input_cap: int = 16384
    output_scale: float = 100.0
    output_alpha: float = 1.5
    output_cap: int = 2048

    def draw(self, rng: np.random.Generator, n: int):
        inp = np.exp(rng.normal(math.log(self.input_median), self.input_sigma, n))
        out = self.output_scale * (rng.random(n) ** (-1.0 / self.output_alpha) - 1.0)
        return (
            np.clip(np.ceil(inp), 1, self.input_cap).astype(int),
            np.clip(np.ceil(out), 1, self.output_cap).astype(int),
        )


SESSION_TURN_LENGTHS = LongTailLengths(input_median=200.0, input_sigma=0.8, input_cap=4096)


def _whole_ms(t: np.ndarray) -> np.ndarray:
    """Sorted, in whole milliseconds from the first (integer arithmetic: exact through a file)."""
    ms = np.sort(np.round(np.asarray(t, dtype=float) * 1000.0).astype(np.int64), kind="stable")
    return (ms - ms[0]) / 1000.0 if len(ms) else ms.astype(float)


def _trace(t: np.ndarray, lengths: LongTailLengths, rng: np.random.Generator, name: str, note: str) -> RequestTrace:
    if not len(t):
        raise ValueError(f"{name}: no arrivals in the duration; raise the rate or the duration")
    inp, out = lengths.draw(rng, len(t))
    return RequestTrace(_whole_ms(t), inp, out, None, name=name, notes=[note])


def _poisson_in(rng: np.random.Generator, start: float, end: float, rate: float) -> np.ndarray:
    if rate <= 0 or end <= start:
        return np.zeros(0)
    return np.sort(rng.uniform(start, end, rng.poisson(rate * (end - start))))


def _thinned(
    rng: np.random.Generator, rate: Callable[[np.ndarray], np.ndarray], peak: float, duration_s: float
) -> np.ndarray:
    """A Poisson process of time-varying `rate` (never above `peak`), by thinning."""
    t = _poisson_in(rng, 0.0, duration_s, peak)
    return t[rng.random(len(t)) * peak < rate(t)]


def on_off_bursts(
    duration_s: float,
    mean_rps: float,
    on_s: float = 10.0,
    off_s: float = 120.0,
    ratio: float = math.inf,
    seed: int = 0,
    lengths: LongTailLengths = LongTailLengths(),
) -> RequestTrace:
    """MMPP: on/off sojourns exponential with means on_s and off_s; the on rate is `ratio` times the
    off rate (inf: silent when off), chosen so the long-run mean is mean_rps."""
    rng = np.random.default_rng([seed, 1])
    p_on = on_s / (on_s + off_s)
    on_rps = mean_rps / (p_on + (1 - p_on) / ratio)
    off_rps = on_rps / ratio
    t, arrivals, on = 0.0, [], rng.random() < p_on  # the first state from the stationary share
    while t < duration_s:
        end = min(duration_s, t + rng.exponential(on_s if on else off_s))
        arrivals.append(_poisson_in(rng, t, end, on_rps if on else off_rps))
        t, on = end, not on
    note = f"mmpp mean {mean_rps:g} rps, on {on_s:g} s at {on_rps:.3g} rps, off {off_s:g} s at {off_rps:.3g} rps"
    return _trace(np.concatenate(arrivals), lengths, rng, "mmpp", note)


def flash_rate(t, base_rps: float, k: float, at_s: float, rise_s: float, hold_s: float, decay_s: float) -> np.ndarray:
    """The flash crowd's rate at times t: base, a linear rise to k x base, a hold, an exponential decay."""
    t = np.asarray(t, dtype=float)
    rise = np.clip((t - at_s) / rise_s, 0.0, 1.0)
    after = np.maximum(0.0, t - (at_s + rise_s + hold_s))
    return base_rps * (1.0 + (k - 1.0) * rise * np.exp(-after / decay_s))


def flash_crowd(
    duration_s: float,
    base_rps: float,
    k: float = 10.0,
    at_s: Optional[float] = None,
    rise_s: float = 20.0,
    hold_s: float = 180.0,
    decay_s: float = 300.0,
    seed: int = 0,
    lengths: LongTailLengths = LongTailLengths(),
) -> RequestTrace:
    """A base rate, then at `at_s` (default: a third of the way in) k times it within rise_s, held
    for hold_s, decaying back with time constant decay_s."""
    rng = np.random.default_rng([seed, 2])
    at = duration_s / 3 if at_s is None else at_s
    t = _thinned(
        rng, lambda x: flash_rate(x, base_rps, k, at, rise_s, hold_s, decay_s), base_rps * max(k, 1.0), duration_s
    )
    note = (
        f"flash crowd {base_rps:g} rps -> x{k:g} at {at:g} s "
        f"(rise {rise_s:g} s, hold {hold_s:g} s, decay {decay_s:g} s)"
    )
    return _trace(t, lengths, rng, "flash", note)


def diurnal(
    duration_s: float,
    mean_rps: float,
    peak_over_trough: float = 4.0,
    days: float = 1.0,
    seed: int = 0,
    lengths: LongTailLengths = LongTailLengths(),
) -> RequestTrace:
    """`days` sinusoidal days in the duration, from a trough, peak/trough as given, mean mean_rps."""
    rng = np.random.default_rng([seed, 3])
    a = (peak_over_trough - 1.0) / (peak_over_trough + 1.0)
    period = duration_s / days

    def rate(x):
        return mean_rps * (1.0 - a * np.cos(2 * np.pi * x / period))

    t = _thinned(rng, rate, mean_rps * (1.0 + a), duration_s)
    note = f"diurnal {days:g} day(s), mean {mean_rps:g} rps, peak/trough {peak_over_trough:g}"
    return _trace(t, lengths, rng, "diurnal", note)


def sessions(
    duration_s: float,
    mean_rps: float,
    num_prefixes: int = 4,
    prefix_tokens: int = 2048,
    mean_turns: float = 4.0,
    think_s: float = 30.0,
    max_input_tokens: int = 32768,
    block_tokens: int = 512,
    seed: int = 0,
    lengths: LongTailLengths = SESSION_TURN_LENGTHS,
) -> RequestTrace:
    """Multi-turn sessions starting as Poisson (mean_rps / mean_turns per s), each over one of
    `num_prefixes` system prompts (Zipf-popular) of `prefix_tokens` tokens; turns geometric (mean
    mean_turns), think times exponential (mean think_s); `lengths` draws each user turn and answer.
    Turn n's prompt is the session's text so far: system prompt, turns and answers 1..n-1, user
    turn n; its hash_ids are the blocks of that text, so it extends turn n-1's prompt exactly."""
    rng = np.random.default_rng([seed, 4])
    prefix_blocks = max(1, math.ceil(prefix_tokens / block_tokens))
    prefix_len = prefix_blocks * block_tokens
    popularity = 1.0 / np.arange(1, num_prefixes + 1)
    next_id = num_prefixes * prefix_blocks  # block ids of the system prompts come first
    t_s: List[float] = []
    inp: List[int] = []
    out: List[int] = []
    hashes: List[List[int]] = []
    for start in _poisson_in(rng, 0.0, duration_s, mean_rps / mean_turns):
        p = rng.choice(num_prefixes, p=popularity / popularity.sum())
        prefix = list(range(p * prefix_blocks, (p + 1) * prefix_blocks))
        own: List[int] = []  # this session's blocks after the system prompt
        t, text = start, prefix_len
        for _ in range(rng.geometric(1.0 / mean_turns)):
            user, answer = (int(x[0]) for x in lengths.draw(rng, 1))
            if t >= duration_s or text + user > max_input_tokens:
                break
            text += user
            need = math.ceil(text / block_tokens) - prefix_blocks
            if need > len(own):  # the new text spills into fresh blocks of its own
                own.extend(range(next_id, next_id + need - len(own)))
                next_id = own[-1] + 1
            t_s.append(t)
            inp.append(text)
            out.append(answer)
            hashes.append(prefix + own[:need])
            text += answer
            t += rng.exponential(think_s)
    if not t_s:
        raise ValueError("sessions: no arrivals in the duration; raise the rate or the duration")
    order = np.argsort(np.asarray(t_s), kind="stable")
    note = (
        f"sessions mean {mean_rps:g} rps, {num_prefixes} system prompts of {prefix_len} tokens, "
        f"{mean_turns:g} turns, think {think_s:g} s"
    )
    return RequestTrace(
        _whole_ms(np.asarray(t_s)[order]),
        np.asarray(inp)[order],
        np.asarray(out)[order],
        [hashes[i] for i in order],
        block_tokens,
        "sessions",
        [note],
    )


def _lengths(args) -> LongTailLengths:
    base = SESSION_TURN_LENGTHS if args.shape == "sessions" else LongTailLengths()
    return LongTailLengths(
        args.input_median or base.input_median,
        args.input_sigma or base.input_sigma,
        args.input_cap or base.input_cap,
        args.output_scale or base.output_scale,
        args.output_alpha or base.output_alpha,
        args.output_cap or base.output_cap,
    )


def generate(args) -> RequestTrace:
    common = dict(seed=args.seed, lengths=_lengths(args))
    if args.shape == "mmpp":
        return on_off_bursts(args.duration_s, args.mean_rps, args.on_s, args.off_s, args.ratio, **common)
    if args.shape == "flash":
        return flash_crowd(
            args.duration_s, args.mean_rps, args.k, args.at_s, args.rise_s, args.hold_s, args.decay_s, **common
        )
    if args.shape == "diurnal":
        return diurnal(args.duration_s, args.mean_rps, args.peak_over_trough, args.days, **common)
    return sessions(
        args.duration_s,
        args.mean_rps,
        args.num_prefixes,
        args.prefix_tokens,
        args.mean_turns,
        args.think_s,
        args.max_input_tokens,
        args.block_tokens,
        **common,
    )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.synthetic_traces", description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=("mmpp", "flash", "diurnal", "sessions"))
    p.add_argument("--duration-s", type=float, default=3600.0)
    p.add_argument("--mean-rps", type=float, default=2.0, help="mean arrival rate (flash: the base rate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write here: .csv or .jsonl, optionally .gz (sessions: .jsonl keeps hash_ids)")
    g = p.add_argument_group("mmpp")
    g.add_argument("--on-s", type=float, default=10.0, help="mean burst length")
    g.add_argument("--off-s", type=float, default=120.0, help="mean lull length")
    g.add_argument("--ratio", type=float, default=math.inf, help="on rate / off rate (inf: silent lulls)")
    g = p.add_argument_group("flash")
    g.add_argument("--k", type=float, default=10.0, help="the crowd's rate over the base rate")
    g.add_argument("--at-s", type=float, help="when it starts (default: a third of the way in)")
    g.add_argument("--rise-s", type=float, default=20.0)
    g.add_argument("--hold-s", type=float, default=180.0)
    g.add_argument("--decay-s", type=float, default=300.0)
    g = p.add_argument_group("diurnal")
    g.add_argument("--peak-over-trough", type=float, default=4.0)
    g.add_argument("--days", type=float, default=1.0, help="days compressed into the duration")
    g = p.add_argument_group("sessions")
    g.add_argument("--num-prefixes", type=int, default=4, help="system prompts shared by the sessions")
    g.add_argument("--prefix-tokens", type=int, default=2048)
    g.add_argument("--mean-turns", type=float, default=4.0)
    g.add_argument("--think-s", type=float, default=30.0)
    g.add_argument("--max-input-tokens", type=int, default=32768)
    g.add_argument("--block-tokens", type=int, default=512)
    g = p.add_argument_group("lengths (default: prompts median 1000, sessions' turns median 200)")
    for name, kind in (
        ("input-median", float),
        ("input-sigma", float),
        ("input-cap", int),
        ("output-scale", float),
        ("output-alpha", float),
        ("output-cap", int),
    ):
        g.add_argument(f"--{name}", type=kind)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> RequestTrace:
    args = parse_args(argv)
    trace = generate(args)
    if args.out:
        write_request_trace(trace, args.out)
    print(json.dumps(trace.describe(), indent=1))
    if args.out:
        print(f"wrote {args.out}")
    return trace


if __name__ == "__main__":
    main()

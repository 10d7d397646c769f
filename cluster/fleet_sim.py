"""A fleet of simulated LLM replicas under an autoscaling policy: fixed ticks, no Ray, no sleeping.

Each replica is a continuous-batching engine whose step time is its preset's StepTimeModel (the one
`sim:<preset>` replicas sleep for). Per tick of `dt_s`, per replica: newly admitted requests add
their prompts to a prefill backlog, chunked at max_num_batched_tokens per step; every step also
decodes one token of each sequence whose prompt is prefilled (only those end); output lengths are
geometric (each decoding sequence ends with probability 1/mean_output_tokens per step), so the
counts are carried as a fluid. A replica reports what an engine does: `waiting` = admitted requests
whose prefill has not started, `running` = the others, and once a request of its has ended
`capacity` = what it completes full by its step-time model (a real replica estimates that from its
measured steps: router.cost_model; `cluster.sim_check` compares the two).
Callers hold one FIFO queue (Serve's handle queue): a request goes to a replica only when it has a
free slot (max_ongoing_requests = max_num_seqs), least-loaded first; each request's first token
comes after the step in flight, when the backlog ahead of it and its own prompt are prefilled (a
prompt alone costs its own tokens, not a full token budget). Arrivals are Poisson at the trace's
rate, or a request trace's times replayed exactly (`arrivals_s`).

Serve's controller is reproduced around the policy: metrics recorded every record interval, pushed
every `metrics_interval_s`, averaged over `look_back_period_s` (the handles' requests as Ray 2.60
merges them: serve_mean); the policy wrapped by Serve's own
`_apply_autoscaling_config` (factors, delays, cold start) and clamped to min/max, called every
`control_period_s`; each replica's metrics averaged over its own samples since it runs, as Serve
does. A new replica serves `startup_s` after it is asked for (or each its measured start-up,
`startups_s`); a removed one takes no new requests and leaves when its streams are done;
replica-seconds count from ask to leave. `python -m cluster.sim_check` compares it with real Serve.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Dict, List, Optional

import numpy as np

# Private in Ray 2.60, no public equivalent: raw_metrics' point type.
from ray.serve._private.common import TimeStampedValue
from ray.serve.config import AutoscalingContext

from batcher.simulated import PRESETS
from cluster.fleet_sim_parts import TTFT_BINS, Policy, Result, SimWorkload, serve_mean
from cluster.traces import Trace

STARTING, READY, DRAINING, GONE = 0, 1, 2, 3
LAST_REQUEST = 0.05  # requests running in the fleet (a fluid) under which the last one has ended
TTFT_QUANTILES = (0.125, 0.375, 0.625, 0.875)  # a cohort's first tokens are spread over its prefill


class FleetSim:
    def __init__(
        self,
        trace: Trace,
        work: SimWorkload,
        startup_s: float,
        dt_s: float = 0.25,
        slo_s: float = 1.0,
        control_period_s: float = 1.0,
        seed: int = 0,
        slots: int = 4096,
        arrivals_s: Optional[np.ndarray] = None,
        startups_s: Optional[List[float]] = None,
    ):
        """`arrivals_s`: replay these arrival times exactly (a request trace) instead of drawing
        Poisson arrivals at the trace's rate (`trace` still gives the plotted rate). `startups_s`:
        start-ups measured one per replica, given in turn to the replicas asked for (cycling), instead
        of startup_s for all (where replicas asked together land one by one)."""
        self.trace, self.w, self.startup_s, self.dt, self.slo_s = trace, work, startup_s, dt_s, slo_s
        self.startups_s = list(startups_s or [])
        self.arrivals_s = None if arrivals_s is None else np.sort(np.asarray(arrivals_s, dtype=float))
        self.control_period_s = control_period_s
        self.rng = np.random.default_rng(seed)
        n = slots
        self.state = np.full(n, GONE)
        self.ready_at = np.zeros(n)
        self.running = np.zeros(n)
        # Prompt tokens admitted, not yet prefilled (FIFO): backlog / prompt_tokens of a replica's
        # `running` are still prefilling; the others decode.
        self.backlog = np.zeros(n)
        self.finished = np.zeros(n)
        self.uid = np.zeros(n, dtype=np.int64)
        self._next_uid = self._initial = 0  # replicas ever asked for; those of the initial fleet
        self.queue: deque = deque()  # [arrival time, count] cohorts
        self.samples: deque = deque()  # (t, running, finished, kv, total, queued, waiting)

    # ---- replicas ------------------------------------------------------------------------------

    def _decoding(self, idx) -> np.ndarray:
        return np.maximum(0.0, self.running[idx] - self.backlog[idx] / self.w.prompt_tokens)

    def _waiting(self) -> np.ndarray:
        # The engine's waiting queue: prompts not started (the one being chunked is running).
        return np.maximum(0.0, self.backlog / self.w.prompt_tokens - 1.0)

    def _live(self) -> np.ndarray:
        return np.flatnonzero((self.state == STARTING) | (self.state == READY))

    def _scale_to(self, target: int, now: float) -> None:
        live = self._live()
        if target > len(live):
            free = np.flatnonzero(self.state == GONE)[: target - len(live)]
            if len(free) < target - len(live):
                raise RuntimeError("out of replica slots; raise FleetSim(slots=...)")
            self.state[free], self.ready_at[free] = STARTING, now + self.startup_s
            if self.startups_s:  # the n-th replica ever asked for takes the n-th measured start-up
                nth = np.arange(self._next_uid, self._next_uid + len(free)) - self._initial
                self.ready_at[free] = now + np.take(self.startups_s, nth, mode="wrap")
            self.running[free] = self.backlog[free] = self.finished[free] = 0.0
            self.uid[free] = np.arange(self._next_uid, self._next_uid + len(free))
            self._next_uid += len(free)
        elif target < len(live):
            # Like Serve: replicas still starting go first (newest first), then the least loaded.
            order = sorted(live, key=lambda i: (self.state[i] == READY, self.running[i], -self.ready_at[i]))
            for i in order[: len(live) - target]:
                self.state[i] = GONE if self.state[i] == STARTING else DRAINING

    # ---- one tick ------------------------------------------------------------------------------

    def _admit(self, now: float, res: Result, arrivals: float) -> None:
        w, step = self.w, self.w.step
        if arrivals > 0:
            self.queue.append([now + self.dt / 2, arrivals])
        ready = np.flatnonzero(self.state == READY)
        if not self.queue or not len(ready):
            return
        free = np.maximum(0.0, w.max_num_seqs - self.running[ready])
        total_free = free.sum()
        if total_free <= 0:
            return
        # The least loaded get most, but no more than power-of-two choices gives the least loaded of
        # N, 2/N of the requests, unless the others are full (the rest goes by free slots): by free
        # slots alone, a new replica among near-full ones took a quarter of a tick's arrivals at once.
        take = min(total_free, sum(c[1] for c in self.queue))
        alloc = take * np.minimum(free / total_free, 2.0 / len(ready))
        rest = free - alloc
        alloc += (take - alloc.sum()) * rest / max(rest.sum(), 1e-12)
        share = alloc / max(alloc.sum(), 1e-12)
        take_total = 0.0
        while self.queue and take_total < total_free - 1e-9:
            cohort = self.queue[0]
            take = min(cohort[1], total_free - take_total)
            wait = max(0.0, now - cohort[0])
            per = take * share
            # The replica's prefill backlog ahead of this cohort, and the cohort's own prompts.
            ahead = self.backlog[ready] + take_total * share * w.prompt_tokens
            m = w.max_num_batched_tokens
            # A step costs its prefill tokens plus the rest (fixed, decodes): a prompt is first the
            # end of the step in flight (half of one, on average), then its own and the backlog's
            # prefill tokens, over as many steps as they fill (one at least; not m tokens' worth).
            rest = step.fixed_s + self._decoding(ready) * (
                step.decode_seq_s + (w.prompt_tokens + w.mean_output) * step.context_token_s
            )
            in_flight = np.where(self.running[ready] > 0, 0.5 * rest, 0.0)
            for q in TTFT_QUANTILES:
                tokens = ahead + (q * per + 1) * w.prompt_tokens
                ttft = wait + in_flight + tokens * step.prefill_token_s + np.maximum(tokens / m, 1.0) * rest
                weight = per / len(TTFT_QUANTILES)
                np.add.at(res.ttft_hist, np.minimum(np.searchsorted(TTFT_BINS, ttft), len(TTFT_BINS) - 1), weight)
                res.within_slo += float(weight[ttft <= self.slo_s].sum())
                res.missed[int(cohort[0])] += float(weight[ttft > self.slo_s].sum())
            take_total += take
            cohort[1] -= take
            if cohort[1] <= 1e-9:
                self.queue.popleft()
        admitted = take_total * share
        self.running[ready] += admitted
        self.backlog[ready] += admitted * w.prompt_tokens

    def _step(self) -> None:
        w, s = self.w, self.w.step
        idx = np.flatnonzero((self.state == READY) | (self.state == DRAINING))
        if not len(idx):
            return
        r, b, dec = self.running[idx], self.backlog[idx], self._decoding(idx)
        m = w.max_num_batched_tokens
        base = s.fixed_s + dec * (s.decode_seq_s + (w.prompt_tokens + w.mean_output) * s.context_token_s)
        prefill_step = base + m * s.prefill_token_s
        clear_time = b / m * prefill_step
        full = clear_time >= self.dt
        steps = np.where(full, self.dt / prefill_step, b / m + (self.dt - clear_time) / base)
        self.backlog[idx] = np.where(full, b - steps * m, 0.0)
        # Only prefilled sequences decode and end: those decoding at the start for every step, those
        # whose prompts finish in this tick (spread over its prefill steps) for the steps after.
        prefilled, prefill_steps = (b - self.backlog[idx]) / w.prompt_tokens, (b - self.backlog[idx]) / m
        keep = 1.0 - 1.0 / w.mean_output
        done = dec * (1.0 - keep**steps) + prefilled * (1.0 - keep ** np.maximum(0.0, steps - prefill_steps / 2))
        # A fluid decays forever; requests end. Under LAST_REQUEST of one left in the whole fleet
        # (none queued or to prefill), the last one has ended: else "requests in the system" never
        # reach 0 after a burst. (Fleet-wide: a replica's share of a light load is a small fluid too.)
        if (r - done).sum() < LAST_REQUEST and not self.queue and self.backlog[idx].sum() <= 0:
            done = r
        self.running[idx] = r - done
        self.finished[idx] += done
        drained = idx[(self.state[idx] == DRAINING) & (self.running[idx] < 0.5)]
        self.state[drained] = GONE

    # ---- Serve's view ----------------------------------------------------------------------------

    def _record(self, now: float) -> None:
        waiting = self._waiting()
        running = self.running - waiting  # waiting ones hold no KV blocks yet
        kv = running * (self.w.prompt_tokens + self.w.mean_output) * PRESETS[self.w.preset].kv_bytes_per_token
        kv /= PRESETS[self.w.preset].kv_cache_memory_gib * 2**30
        queued = sum(c[1] for c in self.queue)
        total = float(self.running[self.state != GONE].sum() + queued)  # handles count draining ones too
        self.samples.append((now, running, self.finished.copy(), kv, total, queued, waiting))

    def _context(self, policy: Policy, now: float, pushed_at: float, target: int) -> AutoscalingContext:
        cfg = policy.config
        window = [s for s in self.samples if now - cfg.look_back_period_s <= s[0] <= pushed_at]
        ready = np.flatnonzero(self.state == READY)
        ids = [f"replica-{self.uid[i]}" for i in ready]
        if window:
            # The handles' series as Serve's controller reads them: pushed with a look-back of points.
            pushed = [s for s in self.samples if pushed_at - cfg.look_back_period_s <= s[0] <= pushed_at]
            times = np.array([s[0] for s in pushed])
            total = serve_mean(times, np.array([s[4] for s in pushed]), now)
            queued = serve_mean(times, np.array([s[5] for s in pushed]), now)
            # Each replica's own series, from when it runs (as Serve aggregates a replica's reports):
            # samples from before it started (another replica's slot, or none) are not its load.
            own = np.array([s[0] for s in window])[:, None] >= self.ready_at[ready][None, :]
            n = np.maximum(own.sum(axis=0), 1)
            running = (np.array([s[1][ready] for s in window]) * own).sum(axis=0) / n
            kv = (np.array([s[3][ready] for s in window]) * own).sum(axis=0) / n
            waiting = (np.array([s[6][ready] for s in window]) * own).sum(axis=0) / n
        else:
            total = queued = 0.0
            running = kv = waiting = np.zeros(len(ready))
        capacity = self.w.capacity_rps()

        def raw():
            out: Dict[str, Dict] = {"finished": {}, "preemptions": {}}
            for j, i in enumerate(ready):
                pts = [s for s in window if s[0] >= self.ready_at[i]]
                out["finished"][ids[j]] = [TimeStampedValue(s[0], float(s[2][i])) for s in pts]
            return out

        return AutoscalingContext(
            deployment_id=None,
            deployment_name="LLMServer",
            app_name="sim",
            current_num_replicas=len(ready),
            target_num_replicas=target,
            running_replicas=ids,
            total_num_requests=total,
            total_queued_requests=queued,
            aggregated_metrics={
                "running": dict(zip(ids, running.tolist())),
                "waiting": dict(zip(ids, waiting.tolist())),
                "kv_usage": dict(zip(ids, kv.tolist())),
                # What a replica estimates from its step times once it knows its requests' size
                # (router.cost_model.StepMeter.capacity): here the step-time model's own.
                "capacity": {r: capacity for r, i in zip(ids, ready) if self.finished[i] > 0},
            },
            raw_metrics=raw,
            capacity_adjusted_min_replicas=cfg.min_replicas,
            capacity_adjusted_max_replicas=cfg.max_replicas,
            policy_state=dict(policy.state),
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=cfg,
        )

    # ---- the run ---------------------------------------------------------------------------------

    def _arrivals(self, now: float) -> float:
        if self.arrivals_s is None:
            return float(self.rng.poisson(self.trace.rate(now + self.dt / 2) * self.dt))
        lo, hi = np.searchsorted(self.arrivals_s, [now, now + self.dt], side="left")
        return float(hi - lo)

    def run(
        self,
        policy: Optional[Policy] = None,
        schedule: Optional[Callable[[float], int]] = None,
        initial: int = 1,
        name: str = "",
    ) -> Result:
        """Either a Policy (through Serve's logic) or a schedule: t -> replica count (clairvoyant)."""
        res = Result(name or (policy.name if policy else "schedule"))
        cfg = policy.config if policy else None
        record_every = min(cfg.look_back_period_s * 0.2, cfg.metrics_interval_s) if cfg else 1.0
        res.arrived = np.zeros(int(self.trace.duration_s) + 2)
        res.missed = np.zeros_like(res.arrived)
        target = initial
        self._scale_to(target, -self.startup_s)  # the initial fleet is up at t = 0
        self.ready_at[self._live()] = 0.0
        self._initial = self._next_uid
        next_record = next_push = next_control = 0.0
        pushed_at = 0.0
        now, end = 0.0, self.trace.duration_s
        while now < end:
            self.state[(self.state == STARTING) & (self.ready_at <= now)] = READY
            if now >= next_record:
                self._record(now)
                next_record += record_every
                while self.samples and self.samples[0][0] < now - 60 - (cfg.look_back_period_s if cfg else 0):
                    self.samples.popleft()
            if cfg and now >= next_push:
                pushed_at, next_push = now, next_push + cfg.metrics_interval_s
            if now >= next_control:
                target = policy.decide(self._context(policy, now, pushed_at, target)) if policy else schedule(now)
                self._scale_to(target, now)
                queued = sum(c[1] for c in self.queue)
                res.t.append(now)
                res.replicas.append(int(np.count_nonzero(self.state != GONE)))
                res.ready.append(int(np.count_nonzero(self.state == READY)))
                res.target.append(target)
                res.queue.append(float(queued))
                res.rate.append(float(self.trace.rate(now)))
                next_control += self.control_period_s
            arrivals = self._arrivals(now)
            res.requests += arrivals
            res.arrived[int(now + self.dt / 2)] += arrivals
            self._admit(now, res, arrivals)
            self._step()
            res.replica_seconds += np.count_nonzero(self.state != GONE) * self.dt
            now += self.dt
        res.unfinished = sum(c[1] for c in self.queue)
        for t, n in self.queue:  # never served: missed
            res.missed[int(t)] += n
        return res

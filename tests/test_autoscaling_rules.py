"""QueueDepthPolicy's measured rules: mu read only from replicas settled in full, the capacity a
burst needed, replicas bought for a backlog only where queues outlast a start-up, the room a fleet
keeps going down, when a drop counts, how mu is averaged and what sizes a fleet before it, and
what a ramp is. Contexts and replicas as in tests/test_autoscaling_policy.py
(10 slots, 2 req/s full, a 4 s SLO, 30 s start-up: 5 s buckets)."""

from __future__ import annotations

import pytest

from deployments import demand_memory
from deployments.autoscaling import DOWN_HEADROOM
from deployments.queueing import burst_capacity
from tests.test_autoscaling_policy import MU, SLOTS, STARTUP, _steady_fleet, ctx, measured, policy


def test_mu_is_read_only_from_replicas_full_for_a_look_back_and_a_latency():
    p = policy()
    _, state = p(ctx(2, running=[2, 2], finished=[1.0, 1.0], now=0))  # an idle fleet at the first call
    # A burst fills both replicas at t = 1; their 5 s window still holds idle seconds: 0.8 req/s is a
    # ramp, not what a full replica does (read as mu, it sized the fleet for half the rate it serves).
    _, state = p(ctx(2, running=[10, 10], handle_queued=50, finished=[0.8, 0.8], now=1, state=state, hi=2))
    assert "mu" not in state["iterserve"]
    _, state = p(ctx(2, running=[10, 10], handle_queued=50, finished=[1.5, 1.5], now=6, state=state, hi=2))
    assert "mu" not in state["iterserve"]  # full 5 s: under a look-back (5 s) + a latency (10 / 1.5 s)
    # Full 10 s at 2 req/s: a look-back plus a request's latency (10 running / 2 req/s).
    _, state = p(ctx(2, running=[10, 10], handle_queued=50, finished=[MU, MU], now=11, state=state, hi=2))
    assert state["iterserve"]["mu"] == MU


def test_mu_is_averaged_over_the_seconds_replicas_were_full_not_the_time_between():
    # mu measured (2 req/s), then 1000 s without a full replica. A burst fills both again; as it
    # drains, they read 3 req/s for a few seconds (azure_code: 16.2 where full replicas do 13.2). Each
    # reading weighs the seconds it covers (a look-back), not the 1000 s since the last: weighed by
    # the gap, the first reading replaced mu and the fleet was sized a fifth short for the next bursts.
    p = policy()
    state = measured(p, now=-1000.0)
    _, state = p(ctx(2, running=[3, 3], finished=[1.0, 1.0], now=-999.0, state=state, hi=2))
    for t in range(0, 16):  # full from t = 0; settled (a look-back + 10 / 3 s) from t = 9
        _, state = p(ctx(2, running=[10, 10], handle_queued=5, finished=[3.0, 3.0], now=float(t), state=state, hi=2))
    assert 2.0 < state["iterserve"]["mu"] < 2.4, state["iterserve"]
    for t in range(16, 16 + 4 * int(STARTUP)):  # a rate held for start-ups is what replicas do now
        _, state = p(ctx(2, running=[10, 10], handle_queued=5, finished=[3.0, 3.0], now=float(t), state=state, hi=2))
    assert state["iterserve"]["mu"] > 2.9


def test_the_first_reading_of_mu_starts_from_the_capacity_replicas_report():
    # Full 10 s at a drain's 3 req/s where the replicas estimate 2 (router.cost_model): mu moves from
    # 2 by the seconds read, not to 3 at once (conv on the 70B preset: a first reading of 14.4 where
    # a full replica does 12.4). Without an estimate the first reading is all there is.
    def mu_after(capacity):
        p, state = policy(), None
        for t in range(0, 11):
            _, state = p(
                ctx(
                    2,
                    running=[10, 10],
                    handle_queued=5,
                    finished=[3.0, 3.0],
                    now=float(t),
                    state=state,
                    hi=2,
                    capacity=capacity,
                )
            )
        return state["iterserve"]["mu"]

    assert 2.0 < mu_after([MU, MU]) < 2.4
    assert mu_after(None) == 3.0


def test_a_slow_ramp_at_a_high_rate_is_a_ramp_though_half_its_steps_fall():
    # 10 s buckets rising ~10 req/s each around 1000 req/s, with noise of about that width: half the
    # steps fall, so "up in 5 of 6" never fired, and on the built-in day the fleet ran at its edge
    # through each slow climb (a queue of thousands, every request past the SLO). The least-squares
    # slope is ~6 standard errors above zero: one start-up's rise (6 buckets) is projected.
    def rise(rates):
        return demand_memory.trend({"memory": [[10.0 * i, r, 0.0, 1] for i, r in enumerate(rates + [0.0])]}, 60.0)

    assert rise([1000, 1019, 1014, 1041, 1036, 1063, 1058]) == pytest.approx(60.9, abs=0.1)
    assert rise([1000, 1005, 1010, 1015, 1020, 1025, 1030]) == 30  # a steady rise, as before
    assert rise([1000, 1010, 1000, 1010, 1000, 1010, 1000]) == 0  # noise
    assert rise([100, 101, 102, 103, 104, 105, 400]) == 0  # a jump: the backlog rule's


def test_burst_capacity_keeps_a_bursts_queue_within_the_slo():
    # 10 s buckets, a 1 s SLO. A lone 10 s burst of 110 req/s needs 100: 1000 served in the burst, the
    # other 100 within the SLO after it. The bucket after it: the two buckets' 1100 over 21 s.
    assert burst_capacity([0.0, 110.0, 0.0], 10.0, 1.0, 6) == [0.0, 100.0, pytest.approx(1100 / 21)]
    # A rate held a start-up (6 buckets) needs 60/61 of itself; longer spells are not looked at.
    held = burst_capacity([61.0] * 8, 10.0, 1.0, 6)
    assert held[0] == pytest.approx(61 * 10 / 11) and held[5] == held[7] == pytest.approx(60.0)


def _spells(length_s: int, count: int = 4) -> list:
    """The policy's decisions over `count` spells of `length_s` s with 600 requests queued at the
    handles, 20 s apart, from the measured state (whose queue is the first spell's start)."""
    p, t, out = policy(), 0, []
    state = measured(p)
    for _ in range(count):
        decisions = []
        for queued in [600.0] * length_s + [0.0] * 20:
            n, state = p(
                ctx(
                    2,
                    running=[10, 10] if queued else [5, 5],
                    handle_queued=queued,
                    finished=[MU, MU],
                    now=float(t),
                    state=state,
                )
            )
            decisions.append(n)
            t += 1
        out.append(decisions[:length_s])
    return out


def test_a_backlog_buys_replicas_only_where_queues_outlast_a_start_up():
    # Queues that ended within 10 s (bursts): once two have (the median spell under a start-up), a
    # queue is left to the replicas there; the rate's need still buys (the queue's growth is arrivals).
    short = _spells(10)
    backlog = round(600 / STARTUP / MU)  # draining 600 within a start-up: 20 req/s, 10 replicas
    assert short[2] == short[1]  # one spell ended, the first: it lasted longer (the measured tick's)
    assert [b - a for a, b in zip(short[3], short[1])] == [backlog] * 10, short
    # Queues that outlasted a start-up: every spell is drained within one.
    long = _spells(40)
    assert long[3] == long[1] and max(long[3]) == max(short[1]), long


def test_a_queue_that_outlasts_every_spell_before_it_is_drained():
    # After 10 s queues, one that stays (a closed loop's standing queue, a longer burst) is not one of
    # them once it has lasted longer than all: from then on the backlog buys as where queues outlast.
    p, t, spells = policy(), 0, []
    _, state = p(ctx(2, running=[4, 3], kv=[0.95, 0.3], finished=[MU, 1.0], now=-1000))  # mu, no queue
    for length in (10, 10, 10, 40):
        decisions = []
        for queued in [600.0] * length + [0.0] * 20:
            n, state = p(
                ctx(
                    2,
                    running=[10, 10] if queued else [5, 5],
                    handle_queued=queued,
                    finished=[MU, MU],
                    now=float(t),
                    state=state,
                )
            )
            decisions.append(n)
            t += 1
        spells.append(decisions[:length])
    assert spells[3][:10] == spells[1]  # as long as the spells before: no backlog bought
    assert spells[3][10:] == _spells(40)[1][10:]  # longer: bought as where queues outlast a start-up


def test_going_down_keeps_room_for_a_rise_within_a_start_up():
    # 100 replicas at 197 req/s; the rate falls to 120 and stays. The fleet goes down, but only to
    # what DOWN_HEADROOM (1.3x) the new rate needs, not to what 1.1x needs (the band it had).
    out = _steady_fleet(policy(), [197.0] * 60 + [120.0] * 300)
    p = policy()
    kept = p._need(120.0 * DOWN_HEADROOM, 240.0 * DOWN_HEADROOM, MU, 10)
    # (Down to it, or within the noise band above it: the steps it takes depend on the buckets.)
    assert kept <= out[359] < kept + max(1.0, out[359] ** 0.5 / 2), out
    assert kept > p._need(120.0 * 1.1, 240.0 * 1.1, MU, 10), out


def test_a_drop_counts_once_it_has_held_half_a_start_up():
    # 100 replicas at 197 req/s; the rate dips to 120 for two whole 5 s buckets (10 s, under half the
    # 30 s start-up) and comes back: the fleet holds its 100 (going down in the dip bought the replicas
    # back a start-up later, after a queue). Held three buckets, the drop is taken.
    dip = _steady_fleet(policy(), [197.0] * 60 + [120.0] * 10 + [197.0] * 30)
    # (Up to a start-up after: later, the climb back reads as a ramp, the ramp rule's known limit noted
    # in tests/test_autoscaling_policy.py.)
    assert set(dip[t] for t in range(60, 95)) == {100}, dip
    held = _steady_fleet(policy(), [197.0] * 60 + [120.0] * 40)
    assert held[99] < 100, held


def test_the_memory_keeps_a_bursts_measured_rate_not_its_smoothed_one():
    # 10 replicas at 10 req/s; 40 req/s for one 5 s bucket. The bucket is remembered at the rate
    # measured in it (arrivals plus the system's growth: 52), not the arrival estimate smoothed over a
    # bucket (28): a level kept for that burst must serve it.
    p, target = policy(), 10
    state = measured(p)
    for t, rps in enumerate([10.0] * 20 + [40.0] * 5 + [10.0] * 10):
        _, state = p(
            ctx(
                target,
                running=[rps * 2.0 / target] * target,
                finished=[rps / target] * target,
                now=float(t),
                state=state,
                hi=10,
            )
        )
    burst = {b[0]: b[1] for b in state["iterserve"]["memory"]}[20.0]
    assert burst >= 40.0, state["iterserve"]["memory"]


def test_mus_floor_is_what_replicas_did_over_a_bucket_not_a_drains_few_seconds():
    # Never full, 10 replicas finish 1 req/s each; for 3 s, as the system drains, 3 req/s each (more
    # than they sustain), then 1 again. mu's floor (the estimate until a replica is full)
    # reads the drain over a 5 s bucket: under 2. Read at its peak (3), the fleet was sized for three
    # times what a replica had shown it does (azure_conv: 18.9 against a measured 15.0, a fifth short).
    p, state = policy(), None
    drain = [(3.0, 2.0), (3.0, 1.0), (3.0, 0.5)]  # (finished req/s, running) per replica
    for t, (each, running) in enumerate([(1.0, 3.0)] * 20 + drain + [(1.0, 3.0)] * 10):
        _, state = p(ctx(10, running=[running] * 10, finished=[each] * 10, now=float(t), state=state, hi=10))
    floor = state["iterserve"]["mu_floor"]
    assert 1.0 < floor < 2.0, state["iterserve"]
    assert p._need(10.0, 0.0, floor, SLOTS) > p._need(10.0, 0.0, 3.0, SLOTS)


def test_a_drain_read_over_the_floor_does_not_override_the_capacity_replicas_report():
    # 4 replicas that report 2 req/s full finish 1 req/s each, then drain a backlog at 3 req/s each
    # for 8 s: the floor reads 2.6, more than they sustain. Then arrivals rise to ~15 req/s (10 more
    # requests a second): the fleet is sized by the capacity, not the floor (sized by the floor, it
    # runs short at each rise: MMPP, 14.3 req/s read where a full replica does 13.0, 97.6% within
    # the SLO; by the capacity 100%, with fewer replica-seconds).
    p, state = policy(), None
    for t, each in enumerate([1.0] * 10 + [3.0] * 8 + [1.0] * 5):
        n, state = p(ctx(4, running=[3.0] * 4, finished=[each] * 4, now=float(t), state=state, capacity=[MU] * 4))
    floor = state["iterserve"]["mu_floor"]
    assert floor > 1.2 * MU and "mu" not in state["iterserve"]
    total = 12.0
    for t in range(23, 33):
        total += 10.0
        n, state = p(
            ctx(4, running=[9.0] * 4, finished=[1.9] * 4, total=total, now=float(t), state=state, capacity=[MU] * 4)
        )
    arrivals = state["iterserve"]["arrivals"][1]
    assert n == p._need(arrivals, 0.0, MU, SLOTS) > p._need(arrivals, 0.0, floor, SLOTS), (n, arrivals)


def test_replicas_that_never_fill_are_sized_by_the_capacity_they_report():
    # 4 replicas running 3 of 10 slots, finishing 1.5 req/s each: never full, so mu is not measured.
    # With the capacity they report (2 req/s full, from their step times: router.cost_model), 6 req/s
    # needs 4 replicas; by the rate they ran at (the floor, 1.5) it needs 5, a fleet a fifth too big
    # on smooth traffic (azure_conv). No capacity yet (none, or 0) leaves the floor.
    def target(capacity, ticks=40):
        p, state = policy(), None
        for t in range(ticks):
            n, state = p(ctx(4, running=[3.0] * 4, finished=[1.5] * 4, now=float(t), state=state, capacity=capacity))
        return n, state["iterserve"]

    assert policy()._need(6.0, 12.0, MU, SLOTS) == 4 < policy()._need(6.0, 12.0, 1.5, SLOTS) == 5
    n, s = target([MU] * 4)
    assert n == 4 and s["capacity"] == MU and "mu" not in s
    assert target(None)[0] == target([0.0] * 4)[0] == 5
    # Once replicas were full, what they did is mu, whatever they estimate: 16 req/s need 9 at 2 each.
    p = policy()
    n, state = p(ctx(4, running=[8.0] * 4, finished=[4.0] * 4, now=0.0, state=measured(p), capacity=[10 * MU] * 4))
    assert state["iterserve"]["mu"] == MU and n == p._need(16.0, 32.0, MU, SLOTS) == 9

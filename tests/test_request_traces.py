"""Request traces (cluster.request_traces) and the synthetic generators (cluster.synthetic_traces): no
server, seconds."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from cluster import synthetic_traces as syn
from cluster.request_traces import RequestTrace, bundled, load_request_trace, prompt_token_ids, write_request_trace
from cluster.traces import day_trace

VOCAB = (17, 49152)  # SmolLM2's ordinary text tokens


@pytest.fixture(scope="module")
def code():
    return load_request_trace(bundled("azure_code_2023"))


@pytest.fixture(scope="module")
def mooncake():
    return load_request_trace(bundled("mooncake_conversation"))


def _same(a: RequestTrace, b: RequestTrace) -> None:
    assert np.array_equal(a.t_s, b.t_s) and a.t_s.dtype == b.t_s.dtype
    assert np.array_equal(a.input_tokens, b.input_tokens) and np.array_equal(a.output_tokens, b.output_tokens)
    assert a.hash_ids == b.hash_ids and a.block_tokens == b.block_tokens


# ---- the bundled public traces --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,requests,bursty,blocks",
    [
        ("azure_code_2023", 8819, True, False),
        ("azure_conv_2023", 19366, False, False),
        ("mooncake_conversation", 12031, False, True),
    ],
)
def test_bundled_traces_load_with_their_counts_and_shapes(name, requests, bursty, blocks):
    trace = load_request_trace(bundled(name))
    d = trace.describe()
    assert len(trace) == d["requests"] == requests and trace.name == name
    assert trace.t_s[0] == 0 and (np.diff(trace.t_s) >= 0).all() and 3300 < trace.duration_s < 3600
    assert (trace.input_tokens > 0).all() and (trace.output_tokens > 0).all()
    if bursty:  # minutes of silence, then bursts (the README's figures)
        assert d["idle_10s_bins"] > 0.5 and d["peak_over_mean"] > 10
    else:
        assert d["idle_10s_bins"] == 0 and d["peak_over_mean"] < 2.5
    assert (trace.hash_ids is not None) == blocks
    if blocks:
        assert all(len(h) * trace.block_tokens >= n for h, n in zip(trace.hash_ids, trace.input_tokens))


def test_bundled_names_an_unknown_trace_with_the_known_ones():
    assert bundled("azure_code_2023.csv.gz") == bundled("azure_code_2023")
    with pytest.raises(FileNotFoundError, match="azure_code_2023, azure_conv_2023, mooncake_conversation"):
        bundled("azure")


# ---- malformed files ------------------------------------------------------------------------------


def test_malformed_files_are_named_with_their_line(tmp_path):
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("timestamp,input_tokens,output_tokens\n0.0,10,5\n0.5,ten,5\n")
    with pytest.raises(ValueError, match=f"{bad_csv}:3"):
        load_request_trace(bad_csv)
    no_column = tmp_path / "cols.csv"
    no_column.write_text("timestamp,prompt_len,output_tokens\n0,1,2\n")
    with pytest.raises(ValueError, match=f"{no_column}: no input tokens column"):
        load_request_trace(no_column)
    bad_jsonl = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad_jsonl, "wt") as f:
        f.write('{"timestamp": 0, "input_length": 3, "output_length": 1}\n\n{"timestamp": 5, "input_length": 3}\n')
    with pytest.raises(ValueError, match=f"{bad_jsonl}:3: needs"):
        load_request_trace(bad_jsonl)
    not_json = tmp_path / "x.jsonl"
    not_json.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1}\n{oops\n')
    with pytest.raises(ValueError, match=f"{not_json}:2"):
        load_request_trace(not_json)
    empty = tmp_path / "empty.csv"
    empty.write_text("timestamp,input_tokens,output_tokens\n")
    with pytest.raises(ValueError, match=f"{empty}: no requests"):
        load_request_trace(empty)
    parquet = tmp_path / "trace.parquet"
    parquet.write_text("PAR1")
    with pytest.raises(ValueError, match=f"{parquet}: expected .csv or .jsonl"):
        load_request_trace(parquet)


# ---- transformations ------------------------------------------------------------------------------


def test_window_keeps_the_requests_inside_rebased(code):
    w = code.window(600.0, 1200.0)
    inside = (code.t_s >= 600) & (code.t_s < 1200)
    assert len(w) == inside.sum() > 100
    assert np.allclose(w.t_s, code.t_s[inside] - 600) and (w.t_s >= 0).all() and (w.t_s < 600).all()
    assert np.array_equal(w.input_tokens, code.input_tokens[inside]) and w.notes == ["window 600-1200 s"]
    assert len(code.head(10)) == 10 and np.array_equal(code.head(10).t_s, code.t_s[:10])


def test_time_scaling_divides_the_gaps_and_multiplies_the_rate(code):
    fast = code.time_scaled(4.0)
    assert len(fast) == len(code) and np.allclose(fast.t_s, code.t_s / 4)
    assert fast.describe()["mean_rps"] == pytest.approx(4 * code.describe()["mean_rps"], rel=0.01)
    with pytest.raises(ValueError):
        code.time_scaled(0)


def test_rate_scaling_multiplies_the_requests_and_keeps_the_shape(code, mooncake):
    more = code.rate_scaled(2.5, seed=1)
    assert len(more) == pytest.approx(2.5 * len(code), rel=0.02) and (np.diff(more.t_s) >= 0).all()
    before, after = code.to_rate(10).rate_rps[::2], more.to_rate(10).rate_rps[::2]
    n = min(len(before), len(after))
    assert np.corrcoef(before[:n], after[:n])[0, 1] > 0.95  # the bursts stay where they were
    assert more.describe()["idle_10s_bins"] > 0.4
    twice = mooncake.head(500).rate_scaled(2.0)
    assert len(twice) == 1000
    # The copies are other users: the block ids of the copies share nothing with the originals'.
    ids = [set(h) for h in twice.hash_ids]
    originals = set().union(*(set(h) for h in mooncake.head(500).hash_ids))
    copies = [s for s in ids if not s <= originals]
    assert len(copies) == 500 and all(not (s & originals) for s in copies)


def test_a_trace_recorded_at_ticks_spreads_each_ticks_requests_over_it(mooncake, code):
    assert mooncake.tick_s() == 3.0 and code.tick_s() == 0.0  # Mooncake's 3 s clock; Azure's own times
    assert code.spread_ticks() is code
    spread = mooncake.spread_ticks(seed=1)
    assert spread.hash_ids == mooncake.hash_ids and np.array_equal(spread.input_tokens, mooncake.input_tokens)
    assert (np.diff(spread.t_s) >= 0).all() and len(np.unique(spread.t_s)) == len(spread)
    # Each request stays within its tick: from its timestamp to the next tick's.
    starts = np.unique(mooncake.t_s)
    nxt = np.append(starts[1:], np.inf)[np.searchsorted(starts, mooncake.t_s)]
    assert (spread.t_s >= mooncake.t_s).all() and (spread.t_s < np.minimum(nxt, mooncake.t_s + 3.0)).all()

    # As recorded, ~10 requests land at once each tick; spread, a 100 ms window holds a few at most.
    def same_100ms(t):  # per request, the requests in its 100 ms bin
        bins = (t / 0.1).astype(int)
        return np.bincount(bins)[bins]

    assert np.median(same_100ms(mooncake.t_s)) >= 8 and np.percentile(same_100ms(spread.t_s), 99) <= 4
    assert np.array_equal(mooncake.spread_ticks(seed=1).t_s, spread.t_s)
    assert not np.array_equal(mooncake.spread_ticks(seed=2).t_s, spread.t_s)


@pytest.mark.parametrize("bin_s", [1.0, 10.0, 60.0])
def test_to_rate_integrates_to_the_request_count(code, bin_s):
    rate = code.to_rate(bin_s)
    per_bin = rate.rate_rps[::2]
    assert per_bin.sum() * bin_s == pytest.approx(len(code))
    assert rate.t_s[-1] >= code.duration_s - bin_s and (np.diff(rate.t_s) > 0).all()


# ---- prompts from block ids -----------------------------------------------------------------------


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_requests_sharing_k_leading_blocks_share_exactly_k_blocks_of_tokens():
    trace = RequestTrace(
        np.zeros(4), np.full(4, 2048), np.ones(4, dtype=int), [[1, 2, 3, 4], [1, 2, 3, 9], [7, 2, 3, 4], [1, 2, 3, 4]]
    )
    block = round(512 * 0.05)
    p = [prompt_token_ids(trace, i, VOCAB, 0.05) for i in range(4)]
    assert [len(x) for x in p] == [round(2048 * 0.05)] * 4 and all(VOCAB[0] <= t < VOCAB[1] for x in p for t in x)
    assert _common_prefix(p[0], p[1]) == 3 * block  # three shared blocks, then different ones
    assert _common_prefix(p[0], p[2]) == 0  # a different first block: nothing shared
    assert p[0] == p[3] and p[0] != prompt_token_ids(trace, 0, VOCAB, 0.05, seed=1)
    plain = RequestTrace(np.zeros(2), np.full(2, 40), np.ones(2, dtype=int))
    assert _common_prefix(prompt_token_ids(plain, 0, VOCAB), prompt_token_ids(plain, 1, VOCAB)) == 0


def test_bundled_mooncake_prompts_share_their_first_block(mooncake):
    a, b = (prompt_token_ids(mooncake, i, VOCAB) for i in (0, 1))
    assert mooncake.hash_ids[0][0] == mooncake.hash_ids[1][0] and mooncake.hash_ids[0][1] != mooncake.hash_ids[1][1]
    assert _common_prefix(a, b) == 512 and len(a) == mooncake.input_tokens[0]


def test_token_scale_rounding_keeps_a_turn_a_prefix_of_the_next():
    # 512 x 0.0029 rounds to 1-token blocks while 2048 x 0.0029 rounds to 6 tokens: the blocks hold the
    # whole prompt, so no request-own tokens may fill the difference (they once did, breaking the prefix).
    turns = RequestTrace(
        np.array([0.0, 1.0]), np.array([2048, 2560]), np.ones(2, dtype=int), [[0, 1, 2, 3], [0, 1, 2, 3, 4]]
    )
    first, second = (prompt_token_ids(turns, i, VOCAB, 0.0029) for i in (0, 1))
    assert second[: len(first)] == first and len(second) > len(first)


# ---- writing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".csv.gz", ".jsonl", ".jsonl.gz"])
def test_written_traces_read_back_identically(tmp_path, code, suffix):
    original = code.head(300)
    _same(load_request_trace(write_request_trace(original, tmp_path / f"t{suffix}")), original)
    flash = syn.flash_crowd(600, 1.0, seed=3)
    _same(load_request_trace(write_request_trace(flash, tmp_path / f"f{suffix}")), flash)


def test_prefix_blocks_read_back_from_jsonl_and_csv_refuses_them(tmp_path, mooncake):
    sessions = syn.sessions(900, 1.0, seed=2)
    _same(load_request_trace(write_request_trace(sessions, tmp_path / "s.jsonl.gz")), sessions)
    part = mooncake.head(200)
    _same(load_request_trace(write_request_trace(part, tmp_path / "m.jsonl")), part)
    with pytest.raises(ValueError, match="CSV has no column for hash_ids"):
        write_request_trace(sessions, tmp_path / "s.csv")


# ---- generators -----------------------------------------------------------------------------------


def _poisson(mean_rps, duration_s, seed=0):
    return syn.diurnal(duration_s, mean_rps, peak_over_trough=1.0, seed=seed)  # a flat day: Poisson


def test_the_bursty_traces_load_a_start_up_ahead_is_unrelated_to_now_and_the_days_is_not(code):
    # What bounds any online autoscaler on a trace (docs/autoscaling.md): the bursty public trace's
    # rate 60 s ahead is uncorrelated with now (measured 0.05), the day's follows it.
    assert abs(code.to_rate(10.0).lookahead_correlation(60.0)) < 0.15
    assert day_trace().lookahead_correlation(60.0) > 0.9
    mmpp = syn.on_off_bursts(3600, 2.0, on_s=10, off_s=120, seed=1)
    assert abs(mmpp.to_rate(10.0).lookahead_correlation(60.0)) < 0.15


def test_mmpp_is_idle_most_of_the_time_and_bursts_far_above_poisson():
    bursts = syn.on_off_bursts(3600, 2.0, on_s=10, off_s=120, seed=1).describe()
    flat = _poisson(2.0, 3600, seed=1).describe()
    assert bursts["mean_rps"] == pytest.approx(2.0, rel=0.3) and flat["mean_rps"] == pytest.approx(2.0, rel=0.05)
    assert flat["idle_10s_bins"] < 0.01 and flat["peak_over_mean"] < 2.5
    assert bursts["idle_10s_bins"] > 0.6 and bursts["peak_over_mean"] > 6
    # A finite ratio: the lulls carry on_rate / ratio, so no 10 s bin is empty at these rates.
    hum = syn.on_off_bursts(3600, 20.0, on_s=10, off_s=120, ratio=10, seed=1).describe()
    assert hum["idle_10s_bins"] == 0 and hum["peak_over_mean"] > 3


def test_flash_crowd_steps_to_k_times_the_base_then_decays():
    trace = syn.flash_crowd(3600, 2.0, k=10, at_s=1200, rise_s=20, hold_s=300, decay_s=300, seed=4)

    def rate(a, b):
        return ((trace.t_s >= a) & (trace.t_s < b)).sum() / (b - a)

    t0 = trace.t_s[0]  # arrivals are re-based to the first one
    before, crowd, late = rate(0, 1200 - t0), rate(1220 - t0, 1520 - t0), rate(3000 - t0, 3600 - t0)
    assert before == pytest.approx(2.0, rel=0.1) and crowd == pytest.approx(20.0, rel=0.1)
    assert late == pytest.approx(2.0 * (1 + 9 * np.exp(-1480 / 300)), rel=0.15)
    assert 2.0 < rate(1820 - t0, 1920 - t0) < 10.0  # half way down the decay, not a cliff


def test_diurnal_peaks_in_the_middle_of_the_day():
    trace = syn.diurnal(3600, 4.0, peak_over_trough=4.0, seed=5)
    bins = np.bincount((trace.t_s // 300).astype(int), minlength=12)[:12]
    assert bins[5:7].mean() / bins[[0, 11]].mean() == pytest.approx(3.4, rel=0.2)  # 300 s bins blur the 4x
    assert len(trace) / 3600 == pytest.approx(4.0, rel=0.05)


def test_long_tailed_lengths_have_their_median_tail_and_caps():
    lengths = syn.LongTailLengths(input_median=800, input_sigma=1.0, input_cap=8000, output_cap=1000)
    inp, out = lengths.draw(np.random.default_rng(0), 20000)
    assert np.median(inp) == pytest.approx(800, rel=0.05) and inp.max() == 8000 and inp.min() >= 1
    assert np.percentile(out, 99) / np.median(out) > 10 and out.max() == 1000 and out.min() >= 1
    trace = syn.on_off_bursts(600, 5.0, lengths=lengths, seed=6)
    assert trace.input_tokens.max() <= 8000 and trace.output_tokens.max() <= 1000


def test_sessions_share_system_prompts_and_each_turn_extends_the_last():
    trace = syn.sessions(1800, 2.0, num_prefixes=3, prefix_tokens=1024, mean_turns=4, think_s=20, seed=7)
    prefix_blocks = 2
    by_session: dict = {}
    for i, h in enumerate(trace.hash_ids):
        by_session.setdefault(h[prefix_blocks], []).append(i)  # a session's first own block names it
    assert len(by_session) > 100 and np.mean([len(v) for v in by_session.values()]) > 2
    prefixes = [tuple(trace.hash_ids[v[0]][:prefix_blocks]) for v in by_session.values()]
    assert len(set(prefixes)) == 3 and max(prefixes.count(p) for p in set(prefixes)) > 40
    owners: dict = {}
    for key, turns in by_session.items():
        for a, b in zip(turns, turns[1:]):
            ha, hb = trace.hash_ids[a], trace.hash_ids[b]
            assert (
                hb[: len(ha)] == ha and trace.input_tokens[b] > trace.input_tokens[a] and trace.t_s[b] >= trace.t_s[a]
            )
            pa, pb = (prompt_token_ids(trace, i, VOCAB, 0.02) for i in (a, b))
            assert pb[: len(pa)] == pa  # in tokens too, at a small token scale
        for block in trace.hash_ids[turns[-1]][prefix_blocks:]:
            assert owners.setdefault(block, key) == key  # no block after the system prompt is shared
    # Two sessions on one system prompt share exactly its tokens.
    a, b = [v[0] for v in by_session.values() if tuple(trace.hash_ids[v[0]][:prefix_blocks]) == prefixes[0]][:2]
    assert _common_prefix(prompt_token_ids(trace, a, VOCAB), prompt_token_ids(trace, b, VOCAB)) == 1024


@pytest.mark.parametrize(
    "make",
    [
        lambda s: syn.on_off_bursts(900, 2.0, seed=s),
        lambda s: syn.flash_crowd(900, 1.0, seed=s),
        lambda s: syn.diurnal(900, 2.0, seed=s),
        lambda s: syn.sessions(900, 1.0, seed=s),
    ],
)
def test_generators_are_seeded(make):
    _same(make(0), make(0))
    assert not np.array_equal(make(0).t_s[:20], make(1).t_s[:20])


def test_cli_writes_what_the_generator_makes(tmp_path, capsys):
    out = tmp_path / "s.jsonl.gz"
    made = syn.main(["sessions", "--duration-s", "600", "--mean-rps", "1", "--seed", "3", "--out", str(out)])
    _same(load_request_trace(out), made)
    _same(made, syn.sessions(600, 1.0, seed=3))
    assert '"requests": %d' % len(made) in capsys.readouterr().out

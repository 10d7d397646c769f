"""Scheduler without a model: a fake step appends token 0 for every sequence that samples."""

from batcher.block_manager import BlockManager
from batcher.sampling_params import SamplingParams
from batcher.scheduler import Scheduler
from batcher.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, watermark=0.0, static=None):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, budget, watermark, static), bm


def seq(rid, prompt_len, max_tokens, base=0):
    return Sequence(rid, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens))


def step(sched):
    out = sched.schedule()
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.samples:
            s.seq.append_token(0)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                sched.finish(s.seq, "length")
    return out


def test_decode_first_then_admission_within_budget():
    sched, _ = make(budget=10)
    a, b = seq("a", 8, 5), seq("b", 8, 5, base=100)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    # a's whole prompt, then the 2 tokens left of the budget go to b (chunked prefill)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 8), ("b", 2)]
    out = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 6)]
    assert [s.samples for s in out.scheduled] == [True, True]


def test_finished_sequence_leaves_and_waiting_one_joins_next_step():
    sched, bm = make(max_num_seqs=2)
    for rid, n in (("a", 1), ("b", 6), ("c", 3)):
        sched.add(seq(rid, 4, n, base=ord(rid) * 10))
    step(sched)  # a and b prefill; a samples its only token and finishes
    assert [s.request_id for s in sched.running] == ["b"]
    out = step(sched)
    assert {s.seq.request_id for s in out.scheduled} == {"b", "c"}


def test_max_num_seqs_caps_the_batch():
    sched, _ = make(max_num_seqs=3, budget=1000)
    for i in range(5):
        sched.add(seq(str(i), 4, 10, base=i * 10))
    out = step(sched)
    assert len(out.scheduled) == 3 and len(sched.waiting) == 2


def test_preempts_latest_admitted_and_recomputes_to_the_same_length():
    sched, bm = make(num_blocks=6, block_size=4, budget=100)
    a, b = seq("a", 8, 8), seq("b", 8, 8, base=50)
    sched.add(a)
    sched.add(b)
    preempted = []
    while sched.has_unfinished():
        out = step(sched)
        preempted += [p.request_id for p in out.preempted]
        if out.preempted:
            assert not any(s.seq.request_id == "b" for s in out.scheduled)
    assert preempted and set(preempted) == {"b"}
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert bm.num_free_blocks == 6 and sched.num_preemptions == len(preempted)


def test_no_admission_in_a_step_that_preempted():
    sched, _ = make(num_blocks=4, block_size=4, budget=100)
    a, b = seq("a", 4, 12), seq("b", 4, 12, base=50)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)  # a and b hold 2 blocks each: the cache is full
    c = seq("c", 1, 1, base=90)
    sched.add(c)
    out = step(sched)
    while not out.preempted:  # decoding into position 8 needs a third block for a
        assert c.status is SequenceStatus.WAITING
        out = step(sched)
    assert [p.request_id for p in out.preempted] == ["b"]
    assert c.status is SequenceStatus.WAITING and list(sched.waiting)[:2] == [b, c]


def test_watermark_holds_back_admission():
    sched, _ = make(num_blocks=10, block_size=4, watermark=0.2)
    sched.add(seq("a", 32, 1))  # needs 8 blocks: 10 - 8 = 2 = the reserve, so it fits
    sched.add(seq("b", 4, 1, base=100))  # one more block would break the reserve
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]


def test_static_batches_wait_for_the_whole_batch():
    sched, _ = make(max_num_seqs=8, budget=1000, static=2)
    a, b, c = seq("a", 4, 1), seq("b", 4, 4, base=20), seq("c", 4, 1, base=40)
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert a.is_finished and not b.is_finished
    # c waits although a's slot is free: the batch runs until its longest member ends
    while not b.is_finished:
        out = step(sched)
        assert all(s.seq is b for s in out.scheduled)
    out = step(sched)
    assert [s.seq for s in out.scheduled] == [c]


def test_abort_of_waiting_and_running_frees_blocks():
    sched, bm = make()
    a, b = seq("a", 8, 5), seq("b", 8, 5, base=100)
    sched.add(a)
    step(sched)
    sched.add(b)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    assert a.finish_reason == b.finish_reason == "abort"

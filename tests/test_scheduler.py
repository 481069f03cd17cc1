"""Scheduler and Sequence accounting: token budget, chunked prefill, policies, admission, preemption.

Steps are committed by the scheduler's own Scheduler.update_from_output, as the engine core commits them, and
finished with Scheduler.finish, as the core ends a request. `Driver(depth=2)` plans step t+1 before
committing step t (the engine's default pipelined loop); `Driver(depth=1)` commits each step right after
planning it (pipeline_depth=1). Every expected chunk and block id below is worked out by hand.
"""

import itertools
from types import SimpleNamespace

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SeqStatus
from engine.slot import StepResult

BS = 4
TOKEN = 300  # every sampled token (never the eos id 0)
_calls = itertools.count(1)


def make_seq(rid, prompt, max_tokens=8, max_model_len=256):
    """`prompt` is a token list, or a length: then the tokens start a block no other call's tokens start."""
    if isinstance(prompt, int):
        k = next(_calls)
        prompt = [(53 * k + i) % 511 + 1 for i in range(prompt)]
    return Sequence(rid, None, prompt, SamplingParams(max_tokens=max_tokens), frozenset({0}),
                    max_model_len=max_model_len, vocab_size=512)


def distinct(n, start):
    return list(range(start, start + n))


def make_sched(num_blocks=32, *, max_num_seqs=8, budget=64, policy="fifo", margin=0.0,
               prefix_caching=True):
    bm = BlockManager(num_blocks, BS, prefix_caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                     admission_margin=margin)


def commit(sched, out):
    """Commit a planned step the way the engine core does: its results (every sampled token is TOKEN) through
    Scheduler.update_from_output, then end whatever finished (EngineCore._finish)."""
    step = SimpleNamespace(chunks=out.chunks, forks=out.forks, launch_time=0.0)
    rows = sum(c.samples for c in [*out.chunks, *out.forks])
    result = StepResult([TOKEN] * rows, None, None, None, 0.0, 0.0)
    for seq in sched.update_from_output(step, result):
        if seq.finish_reason is not None and not seq.finalized:
            sched.finish(seq, seq.finish_reason)


def finish(sched, seq):
    """EngineCore._finish (an abort, say): finalize, take out of the queues, free now or when its steps drain."""
    sched.finish(seq, "abort")


class Driver:
    """The engine loop's order: plan the next step, commit the previous one (depth 2), or plan and commit
    the same step (depth 1)."""

    def __init__(self, sched, depth=1):
        self.sched, self.depth, self.inflight = sched, depth, None

    def step(self):
        out = self.sched.schedule() if self.sched.has_work() else None
        if self.inflight is not None:
            commit(self.sched, self.inflight)
            self.inflight = None
        if out:
            if self.depth == 1:
                commit(self.sched, out)
            else:
                self.inflight = out
        return out


def plan(out):
    return [(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in out.chunks]


def live(seqs):
    return [s for s in seqs if not s.released]


# ---- Sequence accounting -----------------------------------------------------------------------------------
def test_sequence_token_accounting():
    seq = make_seq("a", [5, 6, 7], max_tokens=4)
    assert (seq.num_prompt_tokens, seq.num_total, seq.num_uncomputed) == (3, 3, 3)
    assert seq.max_total_len == 7 and not seq.is_decoding
    seq.num_computed, seq.num_pending = 3, 1  # prefill launched, first token sampled on the device
    assert (seq.num_total, seq.num_uncomputed, seq.is_decoding) == (4, 1, True)
    seq.num_pending = 0
    seq.token_ids.append(9)                   # committed
    assert seq.output_token_ids == [9] and seq.num_output_tokens == 1
    assert seq.prompt_token_ids.tolist() == [5, 6, 7]
    assert (seq.num_total, seq.num_uncomputed, seq.is_decoding) == (4, 1, True)  # same at depth 1


def test_sequence_length_cap():
    assert make_seq("a", 10, max_tokens=None, max_model_len=64).max_total_len == 64
    assert make_seq("a", 10, max_tokens=100, max_model_len=64).max_total_len == 64
    assert make_seq("a", 10, max_tokens=5, max_model_len=64).max_total_len == 15


# ---- construction ------------------------------------------------------------------------------------------
def test_unknown_policy_is_rejected_with_valid_names():
    with pytest.raises(ValueError, match="fifo.*prefill_first"):
        make_sched(policy="lifo")


# ---- single request, budget, chunking ----------------------------------------------------------------------
def test_single_request_prefill_then_decodes_until_length_cap():
    sched = make_sched()
    seq = make_seq("a", 6, max_tokens=3)  # stops at 9 tokens
    sched.add(seq)
    d = Driver(sched, depth=1)
    assert plan(d.step()) == [("a", 0, 6, True)]
    assert seq.block_table == [0, 1] and len(seq.token_ids) == 7
    assert plan(d.step()) == [("a", 6, 1, True)]
    assert seq.block_table == [0, 1]
    assert plan(d.step()) == [("a", 7, 1, True)]  # positions 0..7 still fit in two blocks
    assert seq.finalized and seq.released and seq.output_token_ids == [TOKEN] * 3
    assert d.step() is None and not sched.has_work()
    assert sched.bm.num_free == sched.bm.num_blocks
    sched.bm.check_integrity([])


def test_pipelined_decode_is_planned_before_previous_commit():
    sched = make_sched()
    seq = make_seq("a", 4, max_tokens=3)  # stops at 7 tokens
    sched.add(seq)
    d = Driver(sched, depth=2)
    assert plan(d.step()) == [("a", 0, 4, True)]
    assert (seq.num_computed, seq.num_pending, seq.inflight_refs) == (4, 1, 1)
    assert plan(d.step()) == [("a", 4, 1, True)]   # reads the token step 1 is still sampling
    assert seq.block_table == [0, 1]
    assert (len(seq.token_ids), seq.num_pending, seq.inflight_refs) == (5, 1, 1)
    assert plan(d.step()) == [("a", 5, 1, True)]
    # The pending token of that step reaches the cap: no further step is planned for it.
    assert d.step() is None
    assert seq.finalized and seq.released and len(seq.token_ids) == 7
    assert sched.bm.num_free == sched.bm.num_blocks


def test_chunked_prefill_exact_chunks_and_blocks():
    sched = make_sched(budget=8)
    seq = make_seq("a", 20)
    sched.add(seq)
    d = Driver(sched, depth=1)
    out = d.step()
    assert plan(out) == [("a", 0, 8, False)] and out.num_tokens == 8
    assert seq.block_table == [0, 1] and seq.num_pending == 0 and len(seq.token_ids) == 20
    assert plan(d.step()) == [("a", 8, 8, False)]
    assert seq.block_table == [0, 1, 2, 3]
    assert plan(d.step()) == [("a", 16, 4, True)]   # the chunk that reaches the end samples
    assert seq.block_table == [0, 1, 2, 3, 4]
    assert seq.output_token_ids == [TOKEN]
    assert plan(d.step()) == [("a", 20, 1, True)]
    assert seq.block_table == [0, 1, 2, 3, 4, 5]  # position 20 opens a sixth block


def test_token_budget_splits_work_across_requests():
    sched = make_sched(budget=10)
    for rid in "abc":
        sched.add(make_seq(rid, 6))
    d = Driver(sched, depth=1)
    out = d.step()
    assert plan(out) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert out.num_tokens == 10
    assert [s.request_id for s in sched.waiting] == ["c"]
    out = d.step()
    assert plan(out) == [("a", 6, 1, True), ("b", 4, 2, True), ("c", 0, 6, True)]
    assert out.num_tokens == 9


def test_token_budget_never_exceeded_in_mixed_workload():
    sched = make_sched(num_blocks=64, budget=16, max_num_seqs=4)
    seqs = [make_seq(f"r{i}", n, max_tokens=m) for i, (n, m) in
            enumerate([(30, 3), (5, 6), (17, 2), (9, 9), (1, 4), (40, 1)])]
    for s in seqs:
        sched.add(s)
    d = Driver(sched, depth=2)
    prefill_work = 0
    for _ in range(200):
        out = d.step()
        if out is None and d.inflight is None:
            break
        if out:
            assert out.num_tokens == sum(c.num_tokens for c in out.chunks) <= 16
            assert len({c.seq.request_id for c in out.chunks}) == len(out.chunks)
            prefill_work += sum(c.num_tokens for c in out.chunks)
        sched.bm.check_integrity(live(seqs))
    assert all(s.released and s.num_output_tokens == s.params.max_tokens for s in seqs)
    # Each position before the last one is computed exactly once (no preemption here).
    assert prefill_work == sum(len(s.token_ids) - 1 for s in seqs)
    assert sched.bm.num_free == 64


# ---- policies ----------------------------------------------------------------------------------------------
def _decode_prefill_waiting(policy, budget, depth, p_len=14):
    """Step 1: d (4 tokens) prefills fully, p gets the rest of the budget, w waits. Returns step 2's plan."""
    sched = make_sched(budget=budget, policy=policy)
    for rid, n in (("d", 4), ("p", p_len), ("w", 3)):
        sched.add(make_seq(rid, n))
    d = Driver(sched, depth=depth)
    assert plan(d.step()) == [("d", 0, 4, True), ("p", 0, budget - 4, False)]
    return plan(d.step())


def test_fifo_order_is_decodes_then_prefills_then_waiting():
    assert _decode_prefill_waiting("fifo", 12, depth=2) == [
        ("d", 4, 1, True), ("p", 8, 6, True), ("w", 0, 3, True)]


def test_fifo_decode_gets_budget_before_a_long_prefill():
    assert _decode_prefill_waiting("fifo", 8, depth=2, p_len=40) == [
        ("d", 4, 1, True), ("p", 4, 7, False)]


def test_prefill_first_order_is_prefills_then_waiting_then_decodes():
    assert _decode_prefill_waiting("prefill_first", 12, depth=2) == [
        ("p", 8, 6, True), ("w", 0, 3, True), ("d", 4, 1, True)]


def test_prefill_first_decode_waits_for_a_long_prefill():
    assert _decode_prefill_waiting("prefill_first", 8, depth=2, p_len=40) == [("p", 4, 8, False)]


@pytest.mark.parametrize("policy, expected", [
    ("fifo", [("d", 4, 1, True), ("p", 8, 6, True), ("w", 0, 3, True)]),
    ("prefill_first", [("p", 8, 6, True), ("w", 0, 3, True), ("d", 4, 1, True)]),
])
def test_policy_order_is_the_same_with_blocking_commits(policy, expected):
    # pipeline_depth=1 runs "the same code blocking": d's first token is committed before step 2 is
    # planned, but d is still decoding (one new token to compute), not prefilling.
    assert _decode_prefill_waiting(policy, 12, depth=1) == expected


# ---- admission ---------------------------------------------------------------------------------------------
def test_max_num_seqs_limits_running_requests():
    sched = make_sched(max_num_seqs=2)
    a, b, c = (make_seq(rid, 4, max_tokens=2) for rid in "abc")
    for s in (a, b, c):
        sched.add(s)
    d = Driver(sched, depth=1)
    assert plan(d.step()) == [("a", 0, 4, True), ("b", 0, 4, True)]
    assert list(sched.waiting) == [c]
    assert plan(d.step()) == [("a", 4, 1, True), ("b", 4, 1, True)]  # both finish at this commit
    assert a.released and b.released and sched.running == []
    assert plan(d.step()) == [("c", 0, 4, True)]
    # a and b took blocks 0-3; never-used blocks stay ahead of freed ones in the LRU queue
    assert c.block_table == [4]


def test_admission_waits_until_blocks_fit_in_arrival_order():
    sched = make_sched(num_blocks=4)
    a = make_seq("a", 12, max_tokens=1)  # 3 blocks
    b = make_seq("b", 8)                 # 2 blocks: does not fit beside a
    c = make_seq("c", 2)                 # would fit, but arrived after b
    for s in (a, b, c):
        sched.add(s)
    d = Driver(sched, depth=1)
    assert plan(d.step()) == [("a", 0, 12, True)]
    assert list(sched.waiting) == [b, c] and b.block_table == [] and b.status is SeqStatus.WAITING
    assert a.released  # a reached its cap at that commit; free queue: 3, then a's 2, 1, 0
    assert plan(d.step()) == [("b", 0, 8, True), ("c", 0, 2, True)]
    assert b.block_table == [3, 2] and c.block_table == [1]


def _two_admissions(b_len, margin=0.1):
    sched = make_sched(num_blocks=20, budget=128, margin=margin)  # margin: ceil(0.1 * 20) = 2 blocks
    sched.add(make_seq("a", 40))     # 10 blocks; nothing running yet
    sched.add(make_seq("b", b_len))
    return sched, plan(sched.schedule())


def test_admission_keeps_the_safety_margin_free():
    sched, out = _two_admissions(32)  # 8 blocks: 10 free - 8 = 2 left, exactly the margin
    assert [c[0] for c in out] == ["a", "b"] and sched.bm.num_free == 2
    sched, out = _two_admissions(33)  # 9 blocks: would fit, but leaves 1 < margin
    assert [c[0] for c in out] == ["a"] and sched.bm.num_free == 10
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_without_margin_admission_may_use_every_block():
    sched, out = _two_admissions(40, margin=0.0)
    assert [c[0] for c in out] == ["a", "b"] and sched.bm.num_free == 0


def test_margin_is_ignored_when_nothing_is_running():
    sched = make_sched(num_blocks=20, budget=128, margin=0.1)
    a = make_seq("a", 80)  # needs all 20 blocks
    sched.add(a)
    assert plan(sched.schedule()) == [("a", 0, 80, True)]
    assert a.block_table == list(range(20))


# ---- prefix cache on admission -----------------------------------------------------------------------------
def test_prefix_hit_on_admission_skips_prefill():
    sched = make_sched()
    a = make_seq("a", distinct(12, 1) + [50], max_tokens=1)
    sched.add(a)
    d = Driver(sched, depth=1)
    assert plan(d.step()) == [("a", 0, 13, True)]
    assert a.released  # blocks 0-3 free, 0-2 still hashed
    b = make_seq("b", distinct(12, 1) + [60, 61])
    sched.add(b)
    assert plan(d.step()) == [("b", 12, 2, True)]
    assert b.num_cached == 12
    assert b.block_table == [0, 1, 2, 4]  # three hits, then the head of the free queue


def test_prefix_hit_shares_blocks_with_a_running_sequence():
    sched = make_sched()
    a = make_seq("a", distinct(12, 1) + [50])
    sched.add(a)
    d = Driver(sched, depth=1)
    d.step()
    b = make_seq("b", distinct(8, 1) + [70, 71, 72])
    sched.add(b)
    assert plan(d.step()) == [("a", 13, 1, True), ("b", 8, 3, True)]
    assert b.block_table == [0, 1, 4] and a.block_table == [0, 1, 2, 3]
    assert sched.bm.ref_counts[:5] == [2, 2, 1, 1, 1]
    sched.bm.check_integrity([a, b])


def test_disabled_prefix_caching_recomputes_everything():
    sched = make_sched(prefix_caching=False)
    a = make_seq("a", distinct(12, 1) + [50], max_tokens=1)
    sched.add(a)
    d = Driver(sched, depth=1)
    d.step()
    b = make_seq("b", distinct(12, 1) + [60, 61])
    sched.add(b)
    assert plan(d.step()) == [("b", 0, 14, True)] and b.num_cached == 0


# ---- preemption --------------------------------------------------------------------------------------------
def _three_running(num_blocks=3):
    """a (4 tokens), b (2), c (3), one block each, step 1 planned and in flight."""
    sched = make_sched(num_blocks=num_blocks)
    a, b, c = make_seq("a", 4), make_seq("b", 2), make_seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    step1 = sched.schedule()
    assert plan(step1) == [("a", 0, 4, True), ("b", 0, 2, True), ("c", 0, 3, True)]
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    return sched, (a, b, c), step1


def test_preemption_picks_newest_and_defers_reset_until_inflight_drains():
    sched, (a, b, c), step1 = _three_running()
    e = make_seq("e", 20)  # can never fit: stays at the back of the queue
    sched.add(e)
    step2 = sched.schedule()  # a's decode needs a second block; c is newest
    assert plan(step2) == [("b", 2, 1, True)]  # a waits for c's block; b needs none
    assert c.preempted and c.status is SeqStatus.WAITING and sched.num_preemptions == 1
    assert c not in sched.running and c not in sched.waiting
    assert c.block_table == [2] and sched.bm.num_free == 0  # c's step 1 still reads its block
    assert not a.preempted and not b.preempted

    commit(sched, step1)  # c's step drains: now it is soft-reset
    assert list(sched.waiting) == [c, e]
    assert c.block_table == [] and c.num_computed == 0 and not c.preempted
    assert c.token_ids.tolist() == c.prompt_token_ids.tolist() + [TOKEN]  # generated token kept
    sched.bm.check_integrity([a, b])

    step3 = sched.schedule()
    assert sorted(plan(step3)) == [("a", 4, 1, True), ("b", 3, 1, True)]
    assert a.block_table == [0, 2]
    assert list(sched.waiting) == [c, e]  # c needs a block again: none free


def test_soft_reset_sequence_recomputes_its_generated_tokens():
    sched, (a, b, c), step1 = _three_running()
    step2 = sched.schedule()
    commit(sched, step1)
    commit(sched, step2)
    for s in (a, b):
        finish(sched, s)  # abort: nothing in flight, blocks free at once
    assert sched.bm.num_free == 3
    assert plan(sched.schedule()) == [("c", 0, 4, True)]  # 3 prompt tokens + the kept one
    assert c.num_pending == 1 and c.status is SeqStatus.RUNNING


def test_last_running_sequence_is_never_preempted():
    sched = make_sched(num_blocks=1)
    a = make_seq("a", 4)
    sched.add(a)
    d = Driver(sched, depth=1)
    assert plan(d.step()) == [("a", 0, 4, True)]
    out = sched.schedule()  # needs a second block; nobody else to take it from
    assert plan(out) == [] and not out
    assert sched.running == [a] and not a.preempted and sched.num_preemptions == 0
    assert a.block_table == [0] and a.num_computed == 4


def test_idle_victim_is_not_rescheduled_in_the_same_pass():
    # Blocking commits: nothing is in flight when step 2 is planned, so the victim is reset at once.
    sched = make_sched(num_blocks=2)
    a, b = make_seq("a", 4), make_seq("b", 3)
    sched.add(a)
    sched.add(b)
    d = Driver(sched, depth=1)
    assert plan(d.step()) == [("a", 0, 4, True), ("b", 0, 3, True)]
    out = sched.schedule()  # a needs a second block; b (newest) gives its only one
    assert plan(out) == [("a", 4, 1, True)]
    assert a.block_table == [0, 1]
    assert sched.running == [a] and not a.preempted
    assert list(sched.waiting) == [b] and b.block_table == [] and b.num_computed == 0
    assert sched.num_preemptions == 1


def test_idle_victim_reset_in_this_pass_gets_no_blocks_while_waiting():
    sched = make_sched(num_blocks=3, budget=4)
    a, b = make_seq("a", 2), make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    d = Driver(sched, depth=1)
    assert plan(d.step()) == [("a", 0, 2, True), ("b", 0, 2, False)]
    assert plan(d.step()) == [("a", 2, 1, True), ("b", 2, 2, True)]
    assert plan(d.step()) == [("a", 3, 1, True), ("b", 4, 1, True)]
    assert (a.block_table, b.block_table) == ([0], [1, 2])
    out = sched.schedule()  # a needs a second block: b (newest, idle) is reset; free queue 2, 1
    assert plan(out) == [("a", 4, 1, True)]
    assert a.block_table == [0, 2]
    assert list(sched.waiting) == [b] and b.block_table == [] and b.num_computed == 0
    sched.bm.check_integrity([a])
    commit(sched, out)
    sched.schedule()  # must not trip over b


def test_idle_victims_free_their_blocks_at_once_so_requester_grows_now():
    # The contract of _fit, called directly: which sequence asks first inside schedule()
    # depends on the decode/prefill split, which this test is not about.
    sched = make_sched(num_blocks=4, budget=12)
    v1, v2, r = make_seq("v1", 2), make_seq("v2", 2), make_seq("r", 30)
    for s in (v1, v2, r):
        sched.add(s)
    d = Driver(sched, depth=1)
    assert plan(d.step()) == [("v1", 0, 2, True), ("v2", 0, 2, True), ("r", 0, 8, False)]
    assert (v1.block_table, v2.block_table, r.block_table, sched.bm.num_free) == ([0], [1], [2, 3], 0)
    # r's next 8 positions need 2 blocks. v2 and v1 have nothing in flight, so each gives its block back
    # the moment it is preempted: preempting both is enough for r to grow now.
    assert sched._fit(r, 8) == 8
    assert r.block_table == [2, 3, 1, 0]
    assert list(sched.waiting) == [v1, v2] and sched.running == [r]
    assert sched.num_preemptions == 2
    sched.bm.check_integrity([r])


# ---- draining ----------------------------------------------------------------------------------------------
WORKLOAD = [(30, 3), (5, 6), (17, 2), (9, 9), (1, 4), (40, 1), (12, 5), (3, 7)]


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("depth", [1, 2])
def test_all_blocks_free_after_every_request_finishes(policy, depth):
    sched = make_sched(num_blocks=64, budget=16, max_num_seqs=4, policy=policy, margin=0.05)
    seqs = [make_seq(f"r{i}", n, max_tokens=m) for i, (n, m) in enumerate(WORKLOAD)]
    _run_to_completion(sched, seqs, depth)


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("depth", [1, 2])
def test_all_blocks_free_after_preemptions(policy, depth):
    # 9 blocks of 4: the requests cannot all hold their KV at once, so some get preempted.
    sched = make_sched(num_blocks=9, budget=16, max_num_seqs=4, policy=policy, margin=0.0)
    work = [(9, 8), (7, 9), (10, 6), (6, 8)]
    seqs = [make_seq(f"r{i}", n, max_tokens=m) for i, (n, m) in enumerate(work)]
    _run_to_completion(sched, seqs, depth)
    assert sched.num_preemptions > 0


def _run_to_completion(sched, seqs, depth):
    for s in seqs:
        sched.add(s)
    d = Driver(sched, depth=depth)
    for _ in range(500):
        out = d.step()
        sched.bm.check_integrity(live(seqs))
        assert all(not s.block_table for s in sched.waiting)
        assert all(s.status is SeqStatus.RUNNING and not s.preempted for s in sched.running)
        if out is None and d.inflight is None:
            break
    assert all(s.released for s in seqs), [s for s in seqs if not s.released]
    assert [s.num_output_tokens for s in seqs] == [s.params.max_tokens for s in seqs]
    assert sched.bm.num_free == sched.bm.num_blocks
    assert not sched.running and not sched.waiting
    sched.bm.check_integrity([])


def test_prefill_chunk_shrinks_to_free_blocks_when_nobody_can_be_preempted():
    sched = make_sched(num_blocks=4, budget=8)
    seq = make_seq("a", 13)
    sched.add(seq)
    d = Driver(sched, depth=1)
    assert plan(d.step()) == [("a", 0, 8, False)]
    zombie = make_seq("z", 1)  # holds block 2 and is not running: cannot be preempted
    assert sched.bm.allocate(zombie, 1) and zombie.block_table == [2]
    assert plan(d.step()) == [("a", 8, 4, False)]  # 5 positions left, one free block holds 4
    assert seq.block_table == [0, 1, 3]
    assert plan(d.step()) == []  # no block left and nobody to preempt
    assert sched.stuck() == [seq]

"""KV memory hierarchy: preemption with offload to a host block pool, swap-in without recompute, soft reset.

The copy path is checked bit for bit; the scheduler's offload/swap-in decisions with exact block ids (worked
out by hand); the whole engine against Hugging Face's greedy output (tests/test_correctness_hf.py's oracle)
with a device cache too small for the workload, offload on and off.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu_block_pool import CpuBlockPool, contiguous_runs
from engine.kv_offload import KVOffloader
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SwapOp
from engine.sequence import SeqStatus
from test_correctness_hf import assert_matches_hf, make_prompts
from test_scheduler import BS, TOKEN, Driver, commit, finish, live, make_seq, plan

# ---- host pool accounting -----------------------------------------------------------------------------------


def test_cpu_pool_prefers_a_contiguous_run():
    pool = CpuBlockPool(8)
    a, b = pool.allocate(3), pool.allocate(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    pool.release([1])
    assert pool.allocate(2) == [5, 6]  # 1 alone is too short: the first run of two
    assert pool.allocate(2) == [1, 7]  # no run of two left: the lowest free ids
    assert pool.allocate(1) is None and pool.num_free == 0
    pool.check_integrity([0, 2, 3, 4, 5, 6, 1, 7])


def test_cpu_pool_shares_blocks_by_hash_and_frees_on_last_release():
    pool = CpuBlockPool(4)
    [x] = pool.allocate(1)
    pool.register(x, 1234)
    assert pool.lookup(1234) == x and pool.lookup(99) is None and pool.lookup(None) is None
    pool.share(x)
    pool.check_integrity([x, x])
    pool.release([x])
    assert pool.lookup(1234) == x and pool.num_free == 3
    pool.release([x])
    assert pool.lookup(1234) is None and pool.num_free == 4  # the hash goes with the last reference
    pool.check_integrity([])


def test_cpu_pool_rejects_double_free_and_catches_leaks():
    pool = CpuBlockPool(4)
    ids = pool.allocate(2)
    pool.release(ids)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.release(ids[:1])
    held = pool.allocate(3)
    with pytest.raises(AssertionError, match="ref counts"):
        pool.check_integrity(held[:2])


def test_contiguous_runs():
    assert contiguous_runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert contiguous_runs([]) == []


# ---- the copy path ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_out_and_in_round_trip_bit_exactly(dtype):
    torch.manual_seed(0)
    layers, blocks, bs, heads, dim = 3, 12, 4, 2, 8
    kv = torch.randn(layers, 2, blocks, bs, heads, dim).to(dtype)
    kv.view(-1)[::7] = float("nan")  # bit patterns a lossy path would not keep
    original = kv.clone()
    off = KVOffloader(kv, num_cpu_blocks=10)
    out_dev, out_cpu = [5, 2, 9, 11], [6, 7, 0, 1]  # two host runs: one request may span several
    off.run([SwapOp("out", out_dev, out_cpu)])
    assert off.blocks_out == 4
    for dev, cpu in zip(out_dev, out_cpu):
        assert _bits(off.host[cpu]) == _bits(original[:, :, dev]), f"device block {dev} -> host {cpu}"
    kv[:, :, out_dev] = 0.0  # the device blocks are reused for other content
    in_dev = [1, 7, 3, 10]
    off.run([SwapOp("in", in_dev, out_cpu)])
    for src, dst in zip(out_dev, in_dev):
        assert _bits(kv[:, :, dst]) == _bits(original[:, :, src]), f"block {src} came back wrong in {dst}"
    untouched = [b for b in range(blocks) if b not in out_dev + in_dev]
    assert _bits(kv[:, :, untouched]) == _bits(original[:, :, untouched])


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_swap_ops_run_in_issue_order():
    """A host block freed by a swap-in and reused by a later swap-out in the same batch: the swap-in must
    read it first."""
    kv = torch.arange(2 * 2 * 4 * 2 * 1 * 1, dtype=torch.float32).view(2, 2, 4, 2, 1, 1)
    original = kv.clone()
    off = KVOffloader(kv, num_cpu_blocks=1)
    off.run([SwapOp("out", [0], [0])])
    off.run([SwapOp("in", [3], [0]), SwapOp("out", [1], [0])])
    assert torch.equal(kv[:, :, 3], original[:, :, 0])
    assert torch.equal(off.host[0], original[:, :, 1])


# ---- scheduler decisions (exact block ids; BS = 4) ----------------------------------------------------------


def offload_sched(num_blocks, cpu_blocks, *, max_num_seqs=8, budget=64, policy="fifo", margin=0.0):
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     policy=policy, admission_margin=margin, cpu_pool=CpuBlockPool(cpu_blocks))


def test_victim_is_offloaded_once_its_step_drains_and_swapped_in_before_new_requests():
    sched = offload_sched(num_blocks=3, cpu_blocks=4)
    a, b, c = make_seq("a", 4), make_seq("b", 2), make_seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    step1 = sched.schedule()
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    step2 = sched.schedule()  # a's decode needs a block: c (newest) is preempted, its step 1 in flight
    assert plan(step2) == [("b", 2, 1, True)] and c.preempted and sched.num_preemptions == 1
    assert step2.swaps == [] and c.block_table == [2]
    commit(sched, step1)  # c's step drained: offloaded now
    assert c.status is SeqStatus.SWAPPED and sched.swapped == [c] and sched.num_offloads == 1
    assert c.block_table == [] and c.cpu_blocks == [0] and c.num_computed == 3
    assert c.token_ids.tolist() == c.prompt_token_ids.tolist() + [TOKEN]
    late = make_seq("late", 2)
    sched.add(late)
    step3 = sched.schedule()
    assert step3.swaps == [SwapOp("out", [2], [0])]  # rides with the step that may reuse block 2
    assert sorted(plan(step3)) == [("a", 4, 1, True), ("b", 3, 1, True)] and a.block_table == [0, 2]
    commit(sched, step2)
    commit(sched, step3)
    finish(sched, b)  # b gives block 1 back
    step4 = sched.schedule()  # c comes back (into block 1) before `late` is admitted
    assert step4.swaps == [SwapOp("in", [1], [0])]
    assert plan(step4) == [("a", 5, 1, True), ("c", 3, 1, True)]
    assert c.block_table == [1] and c.status is SeqStatus.RUNNING and c.cpu_blocks is None
    assert sched.num_swap_ins == 1 and sched.cpu_pool.num_free == 4 and list(sched.waiting) == [late]
    assert sched.num_soft_resets == 0
    sched.bm.check_integrity([a, c])


def _shared_prefix_pair(sched):
    """a and b share two full prefix blocks (0, 1); a fourth holder takes the last free block."""
    prefix = list(range(1, 9))
    a = make_seq("a", prefix + [40, 41])
    sched.add(a)
    d = Driver(sched, depth=1)
    d.step()
    b = make_seq("b", prefix + [50])
    sched.add(b)
    assert plan(d.step()) == [("a", 10, 1, True), ("b", 8, 1, True)]
    assert (a.block_table, b.block_table) == ([0, 1, 2], [0, 1, 3])
    sched.bm.allocate(make_seq("hog", 1), 1)  # block 4
    return a, b


def test_shared_prefix_blocks_stay_with_their_other_holder_and_come_back_without_a_copy():
    sched = offload_sched(num_blocks=5, cpu_blocks=8, budget=64)
    a, b = _shared_prefix_pair(sched)
    assert sched._fit(a, 2) == 2  # a grows into block 3: b (newest) is offloaded
    assert b.status is SeqStatus.SWAPPED and b.cpu_blocks == [0, 1, 2]
    assert sched._swaps == [SwapOp("out", [0, 1, 3], [0, 1, 2])]
    assert sched.bm.ref_counts[0] == sched.bm.ref_counts[1] == 1  # still a's: not freed while shared
    assert a.block_table == [0, 1, 2, 3]
    finish(sched, a)  # free queue: 3, 2, 1, 0 (tail blocks first); 0 and 1 keep their hashes
    out = sched.schedule()
    # The prefix comes back from the device prefix cache; only b's own block is copied in.
    assert out.swaps == [SwapOp("out", [0, 1, 3], [0, 1, 2]), SwapOp("in", [3], [2])]
    assert b.block_table == [0, 1, 3] and plan(out) == [("b", 9, 1, True)]
    assert sched.num_swap_ins == 1 and sched.num_soft_resets == 0 and sched.cpu_pool.num_free == 8


def test_evicted_prefix_blocks_come_back_from_the_host_copy():
    sched = offload_sched(num_blocks=5, cpu_blocks=8, budget=64)
    a, b = _shared_prefix_pair(sched)
    sched._fit(a, 2)
    finish(sched, a)
    sched.bm.reset_prefix_cache()  # the device forgets the prefix (as if its blocks were evicted)
    out = sched.schedule()
    assert out.swaps[1:] == [SwapOp("in", [3, 2, 1], [0, 1, 2])]
    assert plan(out) == [("b", 9, 1, True)] and sched.num_soft_resets == 0


def test_a_prefix_shared_by_two_offloaded_sequences_is_copied_once():
    sched = offload_sched(num_blocks=8, cpu_blocks=8, budget=64)
    prefix = list(range(1, 9))
    seqs = [make_seq(name, prefix + tail) for name, tail in (("a", [40, 41]), ("b", [50]), ("c", [60, 61]))]
    d = Driver(sched, depth=1)
    sched.add(seqs[0])
    d.step()
    for s in seqs[1:]:
        sched.add(s)
    d.step()
    a, b, c = seqs
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [0, 1, 3], [0, 1, 4])
    sched._preempt(c)
    sched._preempt(b)
    assert sched._swaps == [SwapOp("out", [0, 1, 4], [0, 1, 2]), SwapOp("out", [3], [3])]
    assert (c.cpu_blocks, b.cpu_blocks) == ([0, 1, 2], [0, 1, 3])
    sched.cpu_pool.check_integrity(c.cpu_blocks + b.cpu_blocks)
    assert sched.bm.ref_counts[:2] == [1, 1]  # a still holds the prefix on the device


def test_swap_in_keeps_the_admission_margin_free():
    sched = offload_sched(num_blocks=10, cpu_blocks=8, margin=0.2)  # margin: 2 blocks
    a, b = make_seq("a", 13), make_seq("b", 12)
    sched.add(a)
    sched.add(b)
    Driver(sched, depth=1).step()
    assert (len(a.block_table), len(b.block_table)) == (4, 3)  # a's next decodes fit its 4th block
    sched._preempt(b)
    assert b.status is SeqStatus.SWAPPED and sched.bm.num_free == 6
    hog = make_seq("hog", 1)
    sched.bm.allocate(hog, 8)  # 4 free: b's 3 blocks + 1 to decode into fit, but not with the margin
    sched.schedule()
    assert sched.swapped == [b] and sched.num_swap_ins == 0
    sched.bm.free(hog)  # 6 free: 4 for b + the 2-block margin
    sched.schedule()
    assert b.status is SeqStatus.RUNNING and sched.num_swap_ins == 1 and len(b.block_table) == 4


def test_full_host_pool_falls_back_to_soft_reset():
    sched = offload_sched(num_blocks=3, cpu_blocks=0)
    assert sched.cpu_pool is None  # a zero-block pool is no pool
    sched = offload_sched(num_blocks=4, cpu_blocks=1)
    a, b = make_seq("a", 4), make_seq("b", 6)
    sched.add(a)
    sched.add(b)
    Driver(sched, depth=1).step()
    assert (a.block_table, b.block_table) == ([0], [1, 2])
    sched._preempt(b)  # needs 2 host blocks, has 1
    assert b.status is SeqStatus.WAITING and list(sched.waiting) == [b]
    assert (sched.num_offloads, sched.num_soft_resets) == (0, 1) and sched.cpu_pool.num_free == 1


def test_aborting_a_swapped_sequence_frees_its_host_blocks():
    sched = offload_sched(num_blocks=4, cpu_blocks=4)
    a, b = make_seq("a", 4), make_seq("b", 6)
    sched.add(a)
    sched.add(b)
    Driver(sched, depth=1).step()
    sched._preempt(b)
    assert sched.cpu_pool.num_free == 2
    finish(sched, b)
    assert sched.cpu_pool.num_free == 4 and not sched.swapped and b.released
    sched.bm.check_integrity([a])


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("cpu_blocks", [64, 3])  # room for everyone / a mix of offloads and soft resets
def test_pressured_workload_drains_with_every_block_free(policy, depth, cpu_blocks):
    sched = offload_sched(num_blocks=9, cpu_blocks=cpu_blocks, budget=16, max_num_seqs=4, policy=policy)
    seqs = [make_seq(f"r{i}", n, max_tokens=m) for i, (n, m) in enumerate([(9, 8), (7, 9), (10, 6), (6, 8)])]
    for s in seqs:
        sched.add(s)
    d = Driver(sched, depth=depth)
    for _ in range(500):
        out = d.step()
        held = [c for s in sched.swapped for c in s.cpu_blocks if c is not None]
        sched.cpu_pool.check_integrity(held)
        sched.bm.check_integrity(live(seqs))
        assert all(not s.block_table for s in sched.swapped)
        if out is None and d.inflight is None:
            break
    assert [s.num_output_tokens for s in seqs] == [s.params.max_tokens for s in seqs]
    assert sched.num_offloads > 0 and sched.num_swap_ins + sched.num_soft_resets >= sched.num_offloads
    assert sched.bm.num_free == sched.bm.num_blocks and sched.cpu_pool.num_free == cpu_blocks


# ---- the engine against Hugging Face -------------------------------------------------------------------------

MAX_NEW = 24


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    llm.check_integrity()  # device and host pools: every block free again
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["cpu_blocks_free"] == s["cpu_blocks_total"]
    return outs


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("cpu_blocks", [64, 0], ids=["offload", "soft_reset"])
def test_greedy_under_kv_pressure_matches_hf(tiny_model_factory, depth, cpu_blocks):
    """16 blocks of 4 for six requests that together need ~40: preemptions happen, outputs do not change.
    Three prompts share a 12-token prefix, so victims hold prefix-cache blocks shared with others."""
    path, hf = tiny_model_factory("qwen2")
    llm = LLM(str(path), pipeline_depth=depth, block_size=4, num_kv_blocks=16, num_cpu_blocks=cpu_blocks,
              admission_margin=0.0, max_num_batched_tokens=32)
    shared = make_prompts(seed=11, lengths=(12,))[0]
    prompts = make_prompts(seed=12, lengths=(9, 14, 11)) + [shared + t for t in make_prompts(13, (2, 5, 3))]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outs = _run(llm, prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length" and out.error is None
        assert_matches_hf(hf, prompt, out.token_ids, n=MAX_NEW)
    s = llm.stats()
    assert s["num_preemptions"] > 0
    if cpu_blocks:
        assert s["num_offloads"] > 0 and s["num_swap_ins"] > 0 and s["blocks_swapped_in"] > 0
        assert s["num_soft_resets"] == 0
    else:
        assert s["num_offloads"] == s["num_swap_ins"] == 0 and s["num_soft_resets"] > 0


@pytest.mark.parametrize("cpu_blocks", [64, 0], ids=["offload", "soft_reset"])
def test_seeded_sampling_under_kv_pressure_equals_unpressured_run(tiny_model_factory, cpu_blocks):
    path, _ = tiny_model_factory("llama")
    prompts = make_prompts(seed=14, lengths=(10, 13, 7, 12))
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True,
                             frequency_penalty=0.4, min_tokens=3, stop=["zzz"], logprobs=1) for s in range(4)]
    ref = LLM(str(path), block_size=4).generate(prompts, params)
    for depth in (1, 2):
        llm = LLM(str(path), pipeline_depth=depth, block_size=4, num_kv_blocks=14, num_cpu_blocks=cpu_blocks,
                  admission_margin=0.0)
        outs = _run(llm, prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        assert [o.text for o in outs] == [o.text for o in ref]
        assert [lp.logprob for o in outs for lp in o.logprobs] == pytest.approx(
            [lp.logprob for o in ref for lp in o.logprobs], abs=1e-4)
        assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("num_cpu_blocks", [16, 0], ids=["offload", "soft_reset"])
def test_pathological_workload_makes_forward_progress(tiny_model_factory, num_cpu_blocks):
    """Twelve requests each needing 8 of the 12 blocks, all arriving at once, no margin: only one fits at a
    time once they grow. Every request still finishes with its full output, in a bounded number of steps."""
    path, hf = tiny_model_factory("llama")
    llm = LLM(str(path), block_size=4, num_kv_blocks=12, num_cpu_blocks=num_cpu_blocks, admission_margin=0.0)
    prompts = make_prompts(seed=15, lengths=(6,) * 12)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = _run(llm, prompts, params)
    assert all(o.finish_reason == "length" and o.error is None and len(o.token_ids) == 24 for o in outs)
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, prompt, out.token_ids, n=24)
    s = llm.stats()
    assert s["num_preemptions"] > 0
    # Run alone, each request takes 25 steps (a 6-token prefill, 24 decodes); run one after the other,
    # 300. Thrashing (swapping in to be preempted again at once) would blow well past that.
    assert s["steps"] <= 300, s


def test_swap_space_gb_sizes_the_host_pool(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    llm = LLM(str(path), block_size=4, num_kv_blocks=8, swap_space_gb=0.001)
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 positions, 2 kv heads, head_dim 16, fp32
    assert llm.stats()["cpu_blocks_total"] == int(0.001 * 1024**3) // per_block
    with pytest.raises(ValueError, match="num_cpu_blocks or swap_space_gb"):
        LLM(str(path), num_cpu_blocks=4, swap_space_gb=1.0)
    with pytest.raises(ValueError, match="swap_space_gb"):
        LLM(str(path), swap_space_gb=-1.0)


@pytest.mark.gpu
def test_swap_round_trip_on_cuda_side_stream_is_bit_exact_and_ordered_before_the_next_forward():
    """On CUDA the copies run on a side stream; the compute stream must not touch the blocks before the
    swap-out read them, and a kernel queued after a swap-in must see the restored data."""
    torch.manual_seed(0)
    kv = torch.randn(4, 2, 64, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    original = kv.clone()
    off = KVOffloader(kv, num_cpu_blocks=64)
    assert off.host.is_pinned()
    dev = [3, 40, 41, 42, 7]
    off.run([SwapOp("out", dev, [10, 11, 12, 13, 20])])
    kv[:, :, dev] = 0  # queued on the compute stream: must run after the swap-out read the blocks
    off.run([SwapOp("in", [50, 51, 52, 53, 54], [10, 11, 12, 13, 20])])
    restored = kv[:, :, [50, 51, 52, 53, 54]].clone()  # compute stream, after the swap-in
    torch.cuda.synchronize()
    assert torch.equal(restored.view(torch.int16), original[:, :, dev].view(torch.int16))


def test_a_failed_swap_stops_the_engine_instead_of_serving_wrong_kv(tiny_model_factory, monkeypatch):
    from engine.kv_offload import KVSwapError

    path, _ = tiny_model_factory("llama")
    llm = LLM(str(path), block_size=4, num_kv_blocks=12, num_cpu_blocks=16, admission_margin=0.0)

    def broken(self, idx, cpu_blocks):
        raise RuntimeError("DMA engine on fire")

    monkeypatch.setattr(KVOffloader, "_out", broken)
    with pytest.raises(KVSwapError, match="DMA engine on fire"):
        llm.generate(make_prompts(seed=15, lengths=(6,) * 6), SamplingParams(max_tokens=24, ignore_eos=True))

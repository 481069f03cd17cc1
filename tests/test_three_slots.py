"""pipeline_depth=3: three step slots, so two launched steps wait on the device while the loop commits the oldest.

Oracles: HF greedy on the same weights (tests/test_correctness_hf.py runs its batch, prefix-cache, stop-token and
preemption cases at depth 3 too), and the depth-2 engine for sampled, penalized and constrained requests, which
its own tests check against HF's processors. Here: that the third slot is really used (two steps uncommitted at
once, pending tokens gathered from the slot of the step that sampled them, whichever it is), that penalized rows
are finalized on an uncommitted input token and still match (the sampling counts that token on the device), that
the loop keeps to two slots while a request whose sampling reads its commits on the host runs (a grammar,
allowed_token_ids, min_tokens), and that the CPU worker thread (the forward running beside the loop) gives the
same tokens.
"""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.scheduler import sampling_waits_for_commit
from test_correctness_hf import assert_matches_hf, make_prompts

MAX_NEW = 16


def _requests():
    """A mixed batch of requests whose sampling reads no commit on the host: greedy, seeded, penalized, n = 2."""
    prompts = make_prompts(seed=31, lengths=(5, 9, 13, 7, 11))
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=MAX_NEW, temperature=0, repetition_penalty=1.4, ignore_eos=True),
              SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=8, frequency_penalty=0.6,
                             presence_penalty=0.3, ignore_eos=True),
              SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=5, n=2, ignore_eos=True)]
    return prompts, params


def _readers():
    """Requests whose sampling reads their commits on the host (min_tokens, allowed_token_ids), beside plain ones."""
    prompts = make_prompts(seed=32, lengths=(6, 10, 8, 12))
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, min_tokens=12),
              SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=4, allowed_token_ids=list(range(40, 200)),
                             ignore_eos=True),
              SamplingParams(max_tokens=MAX_NEW, temperature=0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=9, ignore_eos=True)]
    return prompts, params


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def _watch_finalize(llm: LLM) -> dict:
    """Wrap the runner's finalize: count the sampling rows whose input token (the chunk's last position) was still
    uncommitted when the step was finalized: rows whose sampling reads commits on the host ("waits"), penalized
    rows, and the rest ("plain"); and the most steps left in flight at a finalize."""
    runner, seen = llm.engine.core.runner, {"plain": 0, "penalized": 0, "waits": 0, "max_pending": 0}
    finalize, core = runner.finalize, llm.engine.core

    def watched(step):
        seen["max_pending"] = max(seen["max_pending"], len(core.pending))
        for c in step.sample_chunks:
            if c.parent is not None or c.draft:
                continue
            last = c.start + c.num_tokens - 1  # the position whose token the row reads
            if last >= len(c.seq.token_ids):  # sampled by a step that is not committed yet
                kind = "waits" if sampling_waits_for_commit(c.seq) else \
                    "penalized" if c.seq.params.needs_penalties else "plain"
                seen[kind] += 1
        finalize(step)

    runner.finalize = watched
    return seen


def _engine(path, depth: int, **kw) -> LLM:
    # max_num_batched_tokens 16: prompt chunks share steps with decodes (a mixed step gathers pending tokens too)
    return LLM(str(path), pipeline_depth=depth, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, **kw)


@pytest.mark.parametrize("thread", [False, True])
def test_three_slots_give_the_same_tokens_with_two_steps_uncommitted(tiny_model_factory, thread):
    path, hf = tiny_model_factory("llama")
    prompts, params = _requests()
    two = _engine(path, 2)
    ref = _tokens(two.generate(prompts, params))
    two.shutdown()
    llm = _engine(path, 3, cpu_executor_thread=thread)
    assert len(llm.engine.core.runner.slots) == 3 and llm.engine.core.pipeline_depth == 3
    seen = _watch_finalize(llm)
    outs = llm.generate(prompts, params)
    assert _tokens(outs) == ref
    assert_matches_hf(hf, prompts[0], outs[0].token_ids, MAX_NEW)
    # The third slot is used: a step is finalized while the one launched before it is uncommitted, and rows read
    # the token that step sampled (gathered from its slot), penalized ones too.
    assert seen["max_pending"] == 1 and seen["plain"] > 0 and seen["penalized"] > 0
    llm.check_integrity()
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


def test_requests_reading_their_commits_keep_the_loop_to_two_slots(tiny_model_factory):
    """While a min_tokens or allowed_token_ids request runs, every step is finalized with the step before it
    committed (as with two slots), so those requests ride in every step: the same tokens and the same number of
    steps as depth 2. Once they finish, the third slot is used again."""
    path, _ = tiny_model_factory("llama")
    prompts, params = _readers()
    two = _engine(path, 2)
    ref = _tokens(two.generate(prompts, params))
    steps_two = two.stats()["steps"]
    two.shutdown()
    llm = _engine(path, 3)
    seen = _watch_finalize(llm)
    assert _tokens(llm.generate(prompts, params)) == ref
    assert seen == {"plain": 0, "penalized": 0, "waits": 0, "max_pending": 0}
    assert llm.stats()["steps"] == steps_two
    plain = [SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)] * 3
    llm.generate(prompts[:3], plain)
    assert seen["max_pending"] == 1 and seen["plain"] > 0
    llm.check_integrity()
    llm.shutdown()


def test_a_min_tokens_request_past_its_minimum_lets_the_third_slot_back(tiny_model_factory):
    """min_tokens is decided from the committed count only until it is reached: from then on the request reads no
    commit, the loop goes back to three slots and its rows are finalized on uncommitted tokens, with the same
    tokens as depth 2 (whose min_tokens tests/test_sampling.py checks). No row is finalized on an uncommitted token
    while its ban still applies."""
    path, _ = tiny_model_factory("llama")
    prompts = make_prompts(seed=33, lengths=(6, 9))
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, min_tokens=4),
              SamplingParams(max_tokens=MAX_NEW, temperature=0.7, seed=2, min_tokens=5)]
    two = _engine(path, 2)
    ref = _tokens(two.generate(prompts, params))
    two.shutdown()
    assert all(len(t) > 5 for t in ref)  # both run past their minimum
    llm = _engine(path, 3)
    seen = _watch_finalize(llm)
    core, limits = llm.engine.core, []
    step = core.step

    def watched_step():
        limits.append(core.scheduler.commit_readers)
        return step()

    core.step = watched_step
    assert _tokens(llm.generate(prompts, params)) == ref
    assert seen["waits"] == 0 and seen["plain"] > 0 and seen["max_pending"] == 1
    assert False in limits[limits.index(True):]  # two slots while below the minimum, three after
    llm.check_integrity()
    llm.shutdown()


def test_two_slots_never_finalize_a_row_on_an_uncommitted_token(tiny_model_factory):
    """The control for the watch above: with two slots the step before is committed before the next finalize."""
    path, _ = tiny_model_factory("llama")
    prompts, params = _requests()
    llm = _engine(path, 2)
    seen = _watch_finalize(llm)
    llm.generate(prompts, params)
    assert seen == {"plain": 0, "penalized": 0, "waits": 0, "max_pending": 0}
    llm.shutdown()


def test_three_slots_on_the_simulated_device_keep_two_steps_queued():
    """SIMULATED device: 64 streams run with two steps uncommitted at every launch of the decode phase, finish,
    and leave no block behind; zombie rows (a finished request riding in the steps already launched) appear."""
    from test_sim_device import QWEN, sim_llm

    llm = sim_llm(QWEN, pipeline_depth=3, max_num_seqs=64)
    core, depths = llm.engine.core, []
    launch = core.runner.launch

    def watched(sched, slot, prev):
        depths.append(len(core.pending))
        return launch(sched, slot, prev)

    core.runner.launch = watched
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=1)
    outs = llm.generate([[1, 2, 3, 4, 5] * 20] * 64, params)
    assert all(o.finished for o in outs)
    assert max(depths) == 2 and depths.count(2) > len(depths) // 2
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["pipeline_depth"] == 3
    llm.check_integrity()
    llm.shutdown()


@pytest.mark.parametrize("kw", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)])
def test_three_slots_need_a_single_device(tiny_model_factory, kw):
    path, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="pipeline_depth=3"):
        EngineConfig(model=str(path), pipeline_depth=3, **kw)
